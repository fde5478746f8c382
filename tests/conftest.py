"""Test-session setup shared by every test module.

Triton fixes interpreter mode when a kernel is decorated, at import. Whichever test module
imports the package first decides it for the whole session, so it is set here, before any
test module is imported: on a host without CUDA every Triton kernel (ours and SGLang's) runs
under the interpreter, in whatever order the modules are collected.
"""

import json
import logging
import os
import re
import traceback

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


class _ErrorRecords(logging.Handler):
    """The error records of a logger, since they were last cleared."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# A request whose planning raises is served without its checkpoints and the error logged
# (``anchor_capture._plan``), as a server must: a test driving the cache would see only fewer
# checkpoints. So such an error fails the test, unless it is marked planning_failure_expected.
_planning_errors = _ErrorRecords()
logging.getLogger("sglang_hybrid.runtime.anchor_capture").addHandler(_planning_errors)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _planning_errors.records.clear()
    result = yield
    if _planning_errors.records and item.get_closest_marker("planning_failure_expected") is None:
        record = _planning_errors.records[0]
        raise AssertionError(f"{record.getMessage()}:\n" + "".join(traceback.format_exception(*record.exc_info)))
    return result


@pytest.fixture(scope="session")
def documented_cpu_server(tmp_path_factory):
    """The server docs/serving.md's section for a machine without a GPU starts, by its own
    command, shared by every test that needs a text-serving server with the semantic cache."""
    from sglang_hybrid.harness.server_process import ServerProcess
    from tiny_server import STARTUP_TIMEOUT_S, documented_cpu_commands

    launch = documented_cpu_commands()[0]
    # A fresh cache directory: the tiny model is generated as on a newcomer's first run.
    env = {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg_cache"))}
    server = ServerProcess(
        launch,
        "http://localhost:" + re.search(r"--port (\d+)", launch).group(1),
        env=env,
        log_path=tmp_path_factory.mktemp("documented_cpu_server") / "server.log",
    )
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_server_pair(tmp_path_factory):
    """(semantic, no-cache) ``sglang.launch_server`` processes serving the same tiny random
    Qwen3-Next from token ids, started together, killed with their process groups; shared by
    the server tests, which compare the two."""
    from tiny_server import PAIR_CHECKPOINT_SLOTS, SGLangServer, write_tiny_qwen3_next

    model_dir = write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"))
    logs = tmp_path_factory.mktemp("server_logs")
    semantic = SGLangServer(
        model_dir,
        ["--radix-cache-backend", "semantic", "--enable-metrics"],
        env={"SGLANG_HYBRID_CONFIG": json.dumps({"state_checkpoint_slots": PAIR_CHECKPOINT_SLOTS})},
        log_path=logs / "semantic.log",
    )
    no_cache = SGLangServer(model_dir, ["--disable-radix-cache"], log_path=logs / "no_cache.log")
    try:
        # Two servers starting at once on two shared cores: generous start-up limits.
        semantic.wait_ready(timeout_s=600)
        no_cache.wait_ready(timeout_s=600)
        yield semantic, no_cache
    finally:
        semantic.stop()
        no_cache.stop()

"""The documented CPU server (`sglang-hybrid launch --tiny-model qwen3-next`), for the benchmarks
that measure the real server on this machine: started in its own process group, stopped with
every process it forked, its resident memory read from /proc."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator, Sequence

from sglang_hybrid.harness.server_process import ServerProcess, free_local_port, process_group_members

STARTUP_TIMEOUT_S = 600.0


@contextlib.contextmanager
def tiny_cpu_server(log_path: Path, extra_args: Sequence[str] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base url, launcher process) of a ready `sglang-hybrid launch --tiny-model qwen3-next`."""
    port = free_local_port()
    command = ["sglang-hybrid", "launch", "--tiny-model", "qwen3-next", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(command, f"http://127.0.0.1:{port}", log_path=log_path)
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        yield server.base_url, server.process
    finally:
        server.stop()


def process_group_rss_mib(process: subprocess.Popen) -> dict[str, float]:
    """Resident memory of each process in ``process``'s group (launcher, scheduler,
    detokenizer), in MiB, keyed by process name (SGLang titles its workers
    ``sglang::scheduler`` and so on) and pid."""
    rss = {}
    for entry in process_group_members(process.pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines())
            if "VmRSS" in fields:
                rss[f"{fields['Name'].strip()}[{entry.name}]"] = int(fields["VmRSS"].split()[0]) / 1024
    return rss

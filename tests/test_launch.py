"""``sglang-hybrid launch``: argument parsing, validation and SGLang option checks.

Nothing here starts a server: every check runs on ``prepare_launch`` (what the launcher
does before it hands the record to SGLang's ``run_server``) or on ``launch_main`` with
``run_server`` replaced by a function that fails the test if it is reached.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import sglang.launch_server
import sglang.srt.plugins
from sglang_hybrid import cli
from sglang_hybrid.config import CONFIG_ENV_VAR, SemanticCacheConfig
from sglang_hybrid.launch import (
    CPU_KV_TOKENS,
    CPU_LIVE_STATE_SLOTS,
    LaunchError,
    build_parser,
    check_plugin_loadable,
    launch_main,
    prepare_launch,
)

MODEL = ["--model-path", "Qwen/Qwen3-Next-80B-A3B-Instruct"]
OUR_FLAGS = (
    "--state-checkpoint-slots",
    "--state-checkpoint-memory-gib",
    "--state-checkpoint-host-slots",
    "--checkpoint-planner",
    "--checkpoint-eviction",
    "--anchor-template-family",
)


@pytest.fixture
def server_never_starts(monkeypatch):
    """launch_main's SGLang steps made observable: plugin loading is recorded instead of
    done (it would install every installed plugin's hooks into the test process), and
    reaching run_server fails the test."""
    plugin_loads = []

    def refuse(server_args):
        raise AssertionError("run_server was reached; the launch should have failed first")

    monkeypatch.setattr(sglang.launch_server, "run_server", refuse)
    monkeypatch.setattr(sglang.srt.plugins, "load_plugins", lambda: plugin_loads.append(True))
    return plugin_loads


def test_help_lists_sglang_flags_and_ours(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["launch", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: sglang-hybrid launch")
    for flag in ("--model-path", "--tp-size", "--radix-cache-backend", "--enable-metrics"):
        assert flag in text
    assert "semantic state cache (sglang-hybrid)" in text
    for flag in OUR_FLAGS:
        assert flag in text
    assert "{adaptive,messages,none}" in text
    assert "{lru,expected-saving}" in text


def test_our_flags_sit_in_their_own_help_group():
    parser = build_parser()
    group = next(g for g in parser._action_groups if g.title == "semantic state cache (sglang-hybrid)")
    assert {a.option_strings[0] for a in group._group_actions} == set(OUR_FLAGS)


def test_defaults_select_the_semantic_backend_and_its_settings():
    server_args, config = prepare_launch(MODEL)
    assert server_args.radix_cache_backend == "semantic"
    assert server_args.mamba_radix_cache_strategy == "no_buffer"
    assert server_args.page_size == 1
    assert server_args.model_path == MODEL[1]
    assert config == SemanticCacheConfig()
    assert config.checkpoint_planner == "adaptive"
    assert config.checkpoint_eviction == "expected-saving"


def test_the_backend_runs_with_the_overlap_scheduler_off_and_the_cache_report_on(capsys):
    # SGLang asserts "no_buffer do not support overlap schedule" when it resolves the record.
    for cuda_available in (True, False):
        server_args, _ = prepare_launch(MODEL, cuda_available=cuda_available)
        assert server_args.disable_overlap_schedule is True
        assert server_args.enable_cache_report is True  # OpenAI usage.prompt_tokens_details
    logged = capsys.readouterr().err  # SGLang's argument parsing configures the logging
    assert "--disable-overlap-schedule" in logged and "--enable-cache-report" in logged


def test_a_cuda_host_gets_flashinfer_and_the_triton_gdn_prefill_unless_chosen(capsys):
    server_args, _ = prepare_launch(MODEL, cuda_available=True)
    assert server_args.attention_backend == "flashinfer"
    assert server_args.linear_attn_prefill_backend == "triton"
    assert server_args.device is None  # SGLang picks the GPU
    logged = capsys.readouterr().err
    assert "CUDA host" in logged and "--attention-backend flashinfer" in logged
    chosen = MODEL + ["--attention-backend", "fa3", "--linear-attn-prefill-backend", "flashinfer"]
    server_args, _ = prepare_launch(chosen, cuda_available=True)
    assert (server_args.attention_backend, server_args.linear_attn_prefill_backend) == ("fa3", "flashinfer")


def test_a_host_without_cuda_gets_the_cpu_settings_unless_chosen():
    server_args, _ = prepare_launch(MODEL, cuda_available=False)
    assert server_args.device == "cpu"
    assert server_args.attention_backend == "torch_native"
    assert server_args.sampling_backend == "pytorch"
    assert server_args.grammar_backend == "none"
    assert server_args.disable_cuda_graph and server_args.sleep_on_idle
    assert server_args.max_mamba_cache_size == CPU_LIVE_STATE_SLOTS
    assert server_args.max_total_tokens == CPU_KV_TOKENS
    server_args, _ = prepare_launch(MODEL + ["--max-mamba-cache-size", "8"], cuda_available=False)
    assert server_args.max_mamba_cache_size == 8


def test_the_uncached_baseline_gets_no_settings_of_ours():
    server_args, _ = prepare_launch(MODEL + ["--disable-radix-cache"], cuda_available=True)
    assert server_args.disable_overlap_schedule is False and server_args.attention_backend is None


def test_tiny_model_stands_in_for_the_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    server_args, _ = prepare_launch(["--tiny-model", "qwen3-next"], cuda_available=False)
    model_dir = Path(server_args.model_path)
    assert model_dir.parent == tmp_path / "sglang-hybrid" / "tiny-models"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and (model_dir / "tokenizer.json").exists()
    written = (model_dir / "model.safetensors").stat().st_mtime_ns
    prepare_launch(["--tiny-model", "qwen3-next"], cuda_available=False)
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == written  # built once
    with pytest.raises(LaunchError, match="drop --model-path"):
        prepare_launch(["--tiny-model", "qwen3-next", *MODEL])


def test_explicit_compatible_settings_are_accepted():
    argv = MODEL + [
        "--radix-cache-backend", "semantic",
        "--mamba-radix-cache-strategy", "no_buffer",
        "--page-size", "1",
        "--tp-size", "2",
    ]  # fmt: skip
    server_args, _ = prepare_launch(argv)
    assert (server_args.radix_cache_backend, server_args.page_size) == ("semantic", 1)
    assert server_args.tp_size == 2


def test_our_flags_become_the_config_the_schedulers_read():
    argv = MODEL + [
        "--state-checkpoint-memory-gib", "2.5",
        "--state-checkpoint-host-slots", "512",
        "--checkpoint-planner", "messages",
        "--checkpoint-eviction", "lru",
        "--anchor-template-family", "qwen3_5",
        "--enable-metrics",
    ]  # fmt: skip
    server_args, config = prepare_launch(argv)
    assert config == SemanticCacheConfig(
        state_checkpoint_memory_gib=2.5,
        state_checkpoint_host_slots=512,
        checkpoint_planner="messages",
        checkpoint_eviction="lru",
        anchor_template_family="qwen3_5",
    )
    # SGLang's flags are SGLang's, whatever their position among ours.
    assert server_args.enable_metrics is True
    assert SemanticCacheConfig.from_env(config.to_env()) == config


def test_flags_mixed_in_any_order():
    argv = ["--checkpoint-planner", "none", *MODEL, "--state-checkpoint-slots=12", "--port", "31000"]
    server_args, config = prepare_launch(argv)
    assert (config.checkpoint_planner, config.checkpoint_eviction) == ("none", "lru")
    assert config.state_checkpoint_slots == 12
    assert server_args.port == 31000


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--enable-int8-mamba-checkpoint"], "--enable-int8-mamba-checkpoint"),
        (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
        (["--enable-hicache"], "--enable-hierarchical-cache"),
        (["--enable-session-radix-cache"], "--enable-session-radix-cache"),
        (["--enable-lmcache"], "--enable-lmcache"),
        (["--mamba-max-states-per-path", "4"], "--mamba-max-states-per-path"),
        (["--mamba-radix-cache-strategy", "extra_buffer"], "--mamba-radix-cache-strategy extra_buffer"),
        (["--mamba-radix-cache-strategy", "extra_buffer_lazy"], "needs no_buffer"),
        (["--page-size", "16"], "--page-size 16"),
        (["--radix-cache-backend", "flexkv"], "got 'flexkv'"),
        (["--disable-radix-cache", "--radix-cache-backend", "semantic"], "drop --radix-cache-backend"),
    ],
)
def test_incompatible_sglang_options_are_refused(extra, message):
    with pytest.raises(LaunchError, match=message.replace("-", r"\-")):
        prepare_launch(MODEL + extra)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--state-checkpoint-slots", "-1"], "--state-checkpoint-slots must be >= 0"),
        (["--state-checkpoint-memory-gib", "-0.5"], "--state-checkpoint-memory-gib must be >= 0"),
        (["--state-checkpoint-host-slots", "-8"], "--state-checkpoint-host-slots must be >= 0"),
        (
            ["--checkpoint-planner", "messages", "--checkpoint-eviction", "expected-saving"],
            "use it with --checkpoint-planner adaptive",
        ),
    ],
)
def test_bad_cache_settings_are_refused(extra, message):
    with pytest.raises(LaunchError, match=message.replace("-", r"\-")):
        prepare_launch(MODEL + extra)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--checkpoint-planner", "greedy"], "invalid choice: 'greedy'"),
        (["--checkpoint-eviction", "fifo"], "invalid choice: 'fifo'"),
        (["--anchor-template-family", "gemma"], "invalid choice: 'gemma'"),
        (["--state-checkpoint-slots", "many"], "invalid int value: 'many'"),
        (
            ["--state-checkpoint-slots", "8", "--state-checkpoint-memory-gib", "1"],
            "not allowed with argument",
        ),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_malformed_arguments_exit_with_usage(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        prepare_launch(MODEL + extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "sglang-hybrid launch: error:" in err
    assert message in err


def test_missing_model_path_is_reported_before_anything_loads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        prepare_launch(["--state-checkpoint-slots", "8"])
    assert exit_info.value.code == 2
    assert "--model-path" in capsys.readouterr().err


def test_launch_main_fails_before_the_server_starts(server_never_starts, capsys, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    assert launch_main(MODEL + ["--page-size", "64"]) == 2
    assert server_never_starts == [True]  # plugins load first, as in SGLang's launcher
    err = capsys.readouterr().err
    assert err.startswith("sglang-hybrid launch: error: ")
    assert "--page-size 64" in err
    assert CONFIG_ENV_VAR not in os.environ


def test_config_file_values_are_checked_too(tmp_path):
    config_file = tmp_path / "server.yaml"
    config_file.write_text(f"model-path: {MODEL[1]}\npage-size: 32\n")
    with pytest.raises(LaunchError, match="--page-size 32"):
        prepare_launch(["--config", str(config_file), "--state-checkpoint-slots", "8"])


def test_config_file_with_compatible_values(tmp_path):
    config_file = tmp_path / "server.yaml"
    config_file.write_text(f"model-path: {MODEL[1]}\nport: 30123\n")
    server_args, config = prepare_launch(["--config", str(config_file), "--state-checkpoint-slots", "8"])
    assert (server_args.port, server_args.radix_cache_backend) == (30123, "semantic")
    assert config.state_checkpoint_slots == 8


def test_disable_radix_cache_serves_the_uncached_baseline():
    server_args, _ = prepare_launch(MODEL + ["--disable-radix-cache"])
    assert server_args.disable_radix_cache is True
    assert server_args.radix_cache_backend is None


def test_plugin_whitelist_must_include_our_plugin():
    check_plugin_loadable({})
    check_plugin_loadable({"SGLANG_PLUGINS": "smg-zmq, sglang_hybrid"})
    with pytest.raises(LaunchError, match="SGLANG_PLUGINS='smg-zmq' leaves out 'sglang_hybrid'"):
        check_plugin_loadable({"SGLANG_PLUGINS": "smg-zmq"})


def test_config_rejects_unknown_choices_from_the_environment():
    with pytest.raises(ValueError, match="--checkpoint-planner must be one of"):
        SemanticCacheConfig.from_env({CONFIG_ENV_VAR: '{"checkpoint_planner": "greedy"}'})
    with pytest.raises(ValueError, match="--anchor-template-family must be one of"):
        SemanticCacheConfig.from_env({CONFIG_ENV_VAR: '{"anchor_template_family": "gemma"}'})

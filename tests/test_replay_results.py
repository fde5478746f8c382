"""run_replay output: results.json exactly as DESIGN.md specifies, report and plots; the CLIs."""

import json
from pathlib import Path

import numpy as np
import pytest

from sglang_hybrid.replay.cli_replay import replay_main
from sglang_hybrid.replay.cli_trace import convert_main, edit_main
from sglang_hybrid.replay.cost_model import PROFILES, get_profile
from sglang_hybrid.replay.policies import PEER_POLICIES
from sglang_hybrid.replay.shared_data import TAU_BENCH_AIRLINE, TRACES
from sglang_hybrid.replay.sim import run_replay
from sglang_hybrid.replay.trace import Request, load_trace, write_trace

POLICY_KEYS = {"requests", "prompt_tokens", "cached_tokens", "recomputed_tokens", "hit_rate",
               "checkpoints_taken", "checkpoint_slots_peak", "ttft_s"}


def check_schema(results, policies, budget):
    assert set(results) == {"trace", "backend", "profile", "budget_slots", "policies"}
    assert isinstance(results["trace"], str) and results["backend"] == "sim"
    assert results["profile"] in PROFILES and results["budget_slots"] == budget
    assert list(results["policies"]) == policies
    for row in results["policies"].values():
        assert set(row) == POLICY_KEYS
        for key in POLICY_KEYS - {"hit_rate", "ttft_s"}:
            assert isinstance(row[key], int)
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert set(row["ttft_s"]) == {"mean", "p50", "p95", "p99"}
        assert row["ttft_s"]["p50"] <= row["ttft_s"]["p95"] <= row["ttft_s"]["p99"]
        assert row["cached_tokens"] + row["recomputed_tokens"] == row["prompt_tokens"]


def test_run_replay_writes_results_report_and_plots(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1000, 3000).astype(np.int32)
    requests = [Request("s", t, float(t), base[: 1000 + 500 * t], rng.integers(0, 1000, 20).astype(np.int32))
                for t in range(4)]
    path = write_trace(tmp_path / "t.jsonl", requests)
    names = list(PEER_POLICIES)
    results = run_replay(path, names, budget_gib=2.0, out_dir=tmp_path / "out", progress=False)
    budget = get_profile("qwen3-next-80b@h200").slots_for_gib(2.0)
    check_schema(results, names, budget)
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk == results
    assert set(json.loads((tmp_path / "out" / "budget_sweep.json").read_text())) == {"16", "64", "256", str(budget)}
    for name in ("report.md", "hit_rate_vs_budget.png", "ttft_cdf.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    # Prefixes are nested and shorter than each next prompt: the oracle reuses every previous prompt.
    assert results["policies"]["oracle"]["cached_tokens"] == 1000 + 1500 + 2000


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(ValueError, match="backend 'cluster' is not available"):
        run_replay(Path("unused"), ["none"], backend="cluster", out_dir=tmp_path)


def test_replay_cli_default_runs_the_synthetic_sessions(tmp_path, capsys):
    assert replay_main(["--policies", "oracle,sglang-no-buffer", "--budget-slots", "16", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    check_schema(results, ["oracle", "sglang-no-buffer"], 16)
    assert results["trace"].startswith("synthetic-agent")
    # The synthetic sessions are edited (last-5 observations), so even the oracle misses some tokens.
    assert 0 < results["policies"]["oracle"]["hit_rate"] < 1


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared trace data not present")
def test_trace_convert_then_edit_cli(tmp_path):
    converted = tmp_path / "tau.jsonl"
    assert convert_main(["tau-bench", str(TAU_BENCH_AIRLINE), "--limit", "2",
                         "--out", str(converted)]) == 0
    edited = tmp_path / "tau-masked.jsonl"
    assert edit_main([str(converted), "--emulator", "openhands-masking", "--out", str(edited)]) == 0
    before, after = load_trace(converted), load_trace(edited)
    assert len(before.requests) == len(after.requests)
    assert after.meta["emulator"]["name"] == "openhands-masking"
    # Outputs are unchanged by the edit; masked prompts are never longer.
    key = lambda r: (r.session, r.turn)
    for b, a in zip(sorted(before.requests, key=key), sorted(after.requests, key=key)):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        assert len(a.input_ids) <= len(b.input_ids)
    assert sum(len(r.input_ids) for r in after.requests) < sum(len(r.input_ids) for r in before.requests)


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared trace data not present")
def test_trace_edit_cli_overrides_emulator_parameters(tmp_path, capsys):
    converted = tmp_path / "tau.jsonl"
    assert convert_main(["tau-bench", str(TAU_BENCH_AIRLINE), "--limit", "4",
                         "--out", str(converted)]) == 0
    prompt_tokens = {}
    for max_size in (120, 12):
        edited = tmp_path / f"tau-summarized-{max_size}.jsonl"
        assert edit_main([str(converted), "--emulator", "openhands-summarize", "--param", f"max_size={max_size}",
                          "--param", "summary_words=20", "--out", str(edited)]) == 0
        trace = load_trace(edited)
        assert trace.meta["emulator"]["max_size"] == max_size and trace.meta["emulator"]["summary_words"] == 20
        prompt_tokens[max_size] = trace.prompt_tokens
    # The default threshold never fires on these sessions; a view of 12 events is condensed.
    assert prompt_tokens[12] < prompt_tokens[120] == load_trace(converted).prompt_tokens
    for bad in ("max_size=many", "window=3", "max_size", "max_size=8"):
        with pytest.raises(SystemExit) as exit_info:
            edit_main([str(converted), "--emulator", "openhands-summarize", "--param", bad,
                       "--out", str(tmp_path / "bad.jsonl")])
        assert exit_info.value.code == 2
    assert "has no parameter 'window'" in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()

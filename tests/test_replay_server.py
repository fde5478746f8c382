"""`sglang-hybrid replay --backend server` against the real SGLang server on this CPU host.

Two ``sglang.launch_server`` processes serve the same tiny random-weight Qwen3-Next, one with
the ``semantic`` cache backend (and ``--enable-metrics``), one with ``--disable-radix-cache``.
Agent traces are recorded from the no-cache server, the way a real trace is recorded from the
model that served it: each turn's prompt re-sends the previous prompt with the answer the
server gave, and later turns edit their history (an old tool result masked). The recorded
outputs are then the reference every replay must reproduce token for token.

The replay's own bookkeeping (metrics parsing, the leak arithmetic, the comparison with the
simulator) is tested first, without a server.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sglang_hybrid.cache.stats import CheckpointStats
from sglang_hybrid.metrics import CheckpointMetricsCollector
from sglang_hybrid.replay.cli_replay import replay_main
from sglang_hybrid.replay.prometheus import metrics_summary, parse_cache_metrics
from sglang_hybrid.replay.server_backend import compare_with_sim, server_replay
from sglang_hybrid.replay.server_client import ServedRequest
from sglang_hybrid.replay.sim import run_replay
from sglang_hybrid.replay.trace import Request, Trace, write_trace
from tiny_server import PAIR_CHECKPOINT_SLOTS, SERVER_ON_CPU_HOST

# Room for every checkpoint the tests' runs take, so neither the server nor the simulator
# evicts: the server's pool also holds its warm-up's and earlier tests' checkpoints, which
# the simulator never sees.
CHECKPOINT_SLOTS = PAIR_CHECKPOINT_SLOTS
NEW_TOKENS = 4
# The aborted request asks for this many tokens and is aborted after ABORT_AFTER of them,
# well before it could finish.
LONG_OUTPUT = 24
ABORT_AFTER = 2


# ---- without a server ----


def _exposition(stats: CheckpointStats, live_in_use: int = 0) -> str:
    """What the real collector exports for one rank's ``stats`` (prometheus_client's text)."""

    class LiveAllocator:  # the members of SGLang's MambaSlotAllocator the collector reads
        size = 8

        def available_size(self):
            return self.size - live_in_use

    class CheckpointPool:  # the members of StateCheckpointPool the collector reads
        num_slots = CHECKPOINT_SLOTS

        def used_size(self):
            return stats.taken - stats.evicted - stats.dropped_with_kv

    registry = CollectorRegistry()
    labels = {"cache_type": "SemanticStateCache", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
    collector = CheckpointMetricsCollector(labels, registry=registry, live_allocator=LiveAllocator())
    collector.observe(stats, CheckpointPool())
    return generate_latest(registry).decode()


# Two tensor-parallel ranks as SGLang's multiprocess /metrics serves them (abridged).
TWO_RANKS = """\
# HELP sglang:semantic_checkpoints_taken_total Recurrent-state checkpoints attached to the radix tree.
# TYPE sglang:semantic_checkpoints_taken_total counter
sglang:semantic_checkpoints_taken_total{cache_type="SemanticStateCache",dp_rank="0",pp_rank="0",tp_rank="0"} 5.0
sglang:semantic_checkpoints_taken_total{cache_type="SemanticStateCache",dp_rank="0",pp_rank="0",tp_rank="1"} 5.0
# HELP sglang:semantic_live_state_slots_in_use Live recurrent-state slots held by requests.
# TYPE sglang:semantic_live_state_slots_in_use gauge
sglang:semantic_live_state_slots_in_use{cache_type="SemanticStateCache",dp_rank="0",pp_rank="0",tp_rank="0"} 1.0
sglang:semantic_live_state_slots_in_use{cache_type="SemanticStateCache",dp_rank="0",pp_rank="0",tp_rank="1"} 1.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="tiny",tp_rank="0"} 0.0
"""


def test_cache_metrics_are_read_per_series_and_summed_over_ranks():
    assert parse_cache_metrics(TWO_RANKS) == {"checkpoints_taken_total": 10.0, "live_state_slots_in_use": 2.0}
    values = parse_cache_metrics(_exposition(CheckpointStats(taken=5, restored=2, evicted=1), live_in_use=1))
    assert values["checkpoints_taken_total"] == 5
    assert values["checkpoints_restored_total"] == 2
    assert values["checkpoint_slots_in_use"] == 4
    assert values["checkpoint_slots_capacity"] == CHECKPOINT_SLOTS
    assert values["live_state_slots_in_use"] == 1
    assert not any(name.endswith("_created") for name in values)


def test_metrics_summary_reports_increments_and_leaks():
    before = parse_cache_metrics(_exposition(CheckpointStats(taken=3, restored=1)))
    after = parse_cache_metrics(_exposition(CheckpointStats(taken=9, restored=4, evicted=2, dropped_with_kv=1)))
    summary = metrics_summary(before, after)
    assert summary["counters"]["checkpoints_taken"] == 6
    assert summary["counters"]["checkpoints_restored"] == 3
    assert summary["tree_checkpoints"] == 6 == summary["idle"]["checkpoint_slots_in_use"]
    assert summary["leaked_checkpoint_slots"] == 0 and summary["leaked_live_slots"] == 0

    # A live slot held with no request running, and a checkpoint slot the tree does not hold.
    leaking = parse_cache_metrics(_exposition(CheckpointStats(taken=9, evicted=2), live_in_use=1))
    leaking["checkpoint_slots_in_use"] += 1
    summary = metrics_summary(before, leaking)
    assert summary["leaked_live_slots"] == 1
    assert summary["leaked_checkpoint_slots"] == 1


def _served(session, turn, prompt, output, restored, finish="length"):
    request = Request(session, turn, float(turn), np.asarray(prompt, dtype=np.int32),
                      np.zeros(len(output), dtype=np.int32))
    return ServedRequest(request, f"rid-{session}-{turn}", float(turn), tuple(output), finish,
                         cached_tokens=restored, restored_tokens=restored, kv_hit_tokens=restored,
                         ttft_s=0.1, e2e_s=0.2)


def test_sim_comparison_uses_the_served_outputs_and_names_each_disagreement():
    prompt = list(range(10, 50))
    served_output = [7, 8, 9]
    continuation = prompt + served_output + [60, 61]
    end_depth = len(prompt) + len(served_output) - 1  # the last token is never fed back
    agreeing = [_served("a", 0, prompt, served_output, 0), _served("a", 1, continuation, [5, 6], end_depth)]
    comparison = compare_with_sim(agreeing, CHECKPOINT_SLOTS)
    assert comparison["requests_agreeing"] == 2 and comparison["mismatches"] == []
    assert comparison["server_recomputed_tokens"] == comparison["sim_recomputed_tokens"] \
        == len(prompt) + len(continuation) - end_depth

    # An identical repeat: the planner kept len(prompt) - 1, a checkpoint the server does
    # not capture yet.
    repeat = [*agreeing, _served("a", 2, continuation, [5, 6], end_depth)]
    comparison = compare_with_sim(repeat, CHECKPOINT_SLOTS)
    (mismatch,) = comparison["mismatches"]
    assert mismatch["sim_restored"] == len(continuation) - 1
    assert mismatch["sim_source"] == "inside a prefill" and mismatch["server_source"] == "request end"
    assert comparison["mismatch_causes"] == {"sim restores deeper, from inside a prefill": 1}


def test_server_backend_needs_a_server_url(tmp_path):
    with pytest.raises(ValueError, match="needs a server_url"):
        run_replay(Path("unused"), [], backend="server", out_dir=tmp_path)
    with pytest.raises(ValueError, match="needs a server_url"):
        run_replay(Path("unused"), ["none"], server_url="http://127.0.0.1:1", out_dir=tmp_path)


def test_cli_refuses_server_flags_on_other_backends(tmp_path, capsys):
    with pytest.raises(SystemExit):
        replay_main(["--backend", "server", "--out", str(tmp_path)])
    assert "--server-url" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay_main(["--server-url", "http://127.0.0.1:1", "--out", str(tmp_path)])
    assert "apply to --backend server only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay_main(["--backend", "server", "--server-url", "http://127.0.0.1:1", "--budget-slots", "4",
                     "--out", str(tmp_path)])
    assert "own cache" in capsys.readouterr().err


# ---- against the real server ----

server_test, needs_cpu_host = SERVER_ON_CPU_HOST


@pytest.fixture(scope="module")
def servers(tiny_server_pair):
    return tiny_server_pair


def _tokens(rng: random.Random, n: int) -> list[int]:
    # Token 0 and the EOS id (vocab - 1) are left out so that every prompt is plain text.
    return [rng.randrange(1, 511) for _ in range(n)]


class Recorder:
    """Records agent sessions from a server: each call sends a prompt, keeps the answer."""

    def __init__(self, server):
        self.server = server
        self.requests: list[Request] = []

    def turn(self, session: str, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
        output = self.server.generate(prompt, new_tokens)["output_ids"]
        turn = sum(r.session == session for r in self.requests)
        self.requests.append(Request(session, turn, float(len(self.requests)),
                                     np.asarray(prompt, dtype=np.int32), np.asarray(output, dtype=np.int32)))
        return output


def record_edited_sessions(server, seed: int) -> Trace:
    """Two agent sessions sharing a system prompt: tool calls and results appended turn after
    turn, then the first tool result masked (the edit lands after the first turn's answer),
    and one session retrying its last request unchanged."""
    rng = random.Random(seed)
    system = _tokens(rng, 24)
    recorder = Recorder(server)
    sessions = {name: system + _tokens(rng, 12) for name in ("a", "b")}
    outputs = {name: [] for name in sessions}
    tool_results = {name: _tokens(rng, 10) for name in sessions}
    for name, prompt in sessions.items():
        outputs[name].append(recorder.turn(name, prompt))
    for name, prompt in sessions.items():
        sessions[name] = prompt + outputs[name][0] + tool_results[name]
        outputs[name].append(recorder.turn(name, sessions[name]))
    for name, first_turn in sessions.items():
        masked_start = len(first_turn) - len(tool_results[name])
        masked = first_turn[:masked_start] + [7, 7, 7] + outputs[name][1] + _tokens(rng, 8)
        recorder.turn(name, masked)
    recorder.turn("a", recorder.requests[-2].input_ids.tolist())
    return Trace(recorder.requests, meta={"name": f"recorded edited sessions (seed {seed})"})


def record_session_to_abort(server, seed: int) -> Trace:
    """One session whose middle turn generates LONG_OUTPUT tokens (the one to abort)."""
    rng = random.Random(seed)
    recorder = Recorder(server)
    prompt = _tokens(rng, 30)
    answer = recorder.turn("long", prompt)
    prompt = prompt + answer + _tokens(rng, 6)
    answer = recorder.turn("long", prompt, new_tokens=LONG_OUTPUT)
    recorder.turn("long", prompt + answer + _tokens(rng, 6))
    return Trace(recorder.requests, meta={"name": f"recorded session to abort (seed {seed})"})


@pytest.fixture(scope="module")
def recorded(servers):
    _, no_cache = servers
    return record_edited_sessions(no_cache, seed=1), record_session_to_abort(no_cache, seed=2)


def _served_requests(out_dir) -> list[dict]:
    return json.loads((out_dir / "server_requests.json").read_text())


def _assert_no_leaks(server: dict) -> None:
    metrics = server["metrics"]
    assert metrics["idle"]["live_state_slots_in_use"] == 0
    assert metrics["leaked_live_slots"] == 0
    assert metrics["idle"]["checkpoint_slots_in_use"] == metrics["tree_checkpoints"]
    assert metrics["leaked_checkpoint_slots"] == 0


def _assert_sim_agrees(comparison: dict) -> None:
    """The server captures the planner's checkpoints inside a prefill (runtime/) as the
    simulator's `semantic` policy places them, so every restore depth agrees."""
    assert comparison["mismatches"] == [], comparison["mismatch_causes"]
    assert comparison["server_recomputed_tokens"] == comparison["sim_recomputed_tokens"]


@server_test
@needs_cpu_host
def test_replay_matches_no_cache_and_restores_checkpoints(servers, recorded, tmp_path, capsys):
    semantic, no_cache = servers
    trace, _ = recorded
    trace_path = write_trace(tmp_path / "trace.jsonl", trace.requests, trace.meta)

    assert replay_main([str(trace_path), "--backend", "server", "--server-url", semantic.base_url,
                        "--out", str(tmp_path / "semantic")]) == 0
    assert replay_main([str(trace_path), "--backend", "server", "--server-url", no_cache.base_url,
                        "--out", str(tmp_path / "none")]) == 0
    assert "sim `semantic` on the served outputs" in capsys.readouterr().out

    cached = _served_requests(tmp_path / "semantic")
    uncached = _served_requests(tmp_path / "none")
    ordered = sorted(trace.requests, key=lambda r: r.arrival_s)
    assert [r["output_ids"] for r in cached] == [r["output_ids"] for r in uncached] \
        == [r.output_ids.tolist() for r in ordered]
    assert all(r["finish_reason"] == "length" for r in cached)
    # The retry restores from the checkpoint the planner kept inside its first prefill,
    # at the last prompt token but one: a request end lies past the prompt.
    retried = cached[-1]
    assert retried["restored_tokens"] == retried["prompt_tokens"] - 1
    assert all(r["cached_tokens"] == 0 for r in uncached)
    # SGLang's cached_tokens is the restored depth: a hybrid model's KV hit is only usable
    # as far as a recurrent state exists.
    assert all(r["cached_tokens"] == r["restored_tokens"] for r in cached)

    results = json.loads((tmp_path / "semantic" / "results.json").read_text())
    assert results["backend"] == "server" and results["budget_slots"] == CHECKPOINT_SLOTS
    row = results["policies"]["semantic"]
    assert row["requests"] == len(trace.requests)
    assert row["recomputed_tokens"] < row["prompt_tokens"]
    server = results["server"]
    assert server["metrics"]["counters"]["checkpoints_restored"] > 0
    assert server["metrics"]["counters"]["tokens_restored"] == row["cached_tokens"]
    _assert_no_leaks(server)
    _assert_sim_agrees(server["sim_comparison"])

    plain = json.loads((tmp_path / "none" / "results.json").read_text())
    assert list(plain["policies"]) == ["none"] and plain["server"]["metrics"] is None
    assert plain["policies"]["none"]["cached_tokens"] == 0
    for out in ("semantic", "none"):
        assert (tmp_path / out / "ttft_cdf.png").stat().st_size > 0
        assert "Server replay" in (tmp_path / out / "report.md").read_text()


@server_test
@needs_cpu_host
def test_replay_survives_a_request_aborted_mid_generation(servers, recorded, tmp_path):
    semantic, _ = servers
    _, trace = recorded
    aborted_turn = ("long", 1)
    results = server_replay(trace, server_url=semantic.base_url, out_dir=tmp_path, trace_name="abort",
                            profile="n/a", abort_after_tokens={aborted_turn: ABORT_AFTER})

    served = _served_requests(tmp_path)
    reference = {(r.session, r.turn): r.output_ids.tolist() for r in trace.requests}
    for request in served:
        expected = reference[request["session"], request["turn"]]
        if (request["session"], request["turn"]) == aborted_turn:
            assert request["finish_reason"] == "abort"
            assert ABORT_AFTER <= len(request["output_ids"]) < LONG_OUTPUT
            assert request["output_ids"] == expected[:len(request["output_ids"])]
        else:
            assert request["finish_reason"] == "length"
            assert request["output_ids"] == expected
    server = results["server"]
    assert server["aborted_requests"] == 1
    assert server["metrics"]["counters"]["checkpoints_restored"] > 0
    _assert_no_leaks(server)
    _assert_sim_agrees(server["sim_comparison"])

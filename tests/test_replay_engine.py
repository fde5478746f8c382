"""`--backend engine`: the semantic policy replayed through a real tiny hybrid model on CPU.

A hand-built two-session trace (shared system prompt, an append-only turn, an edit inside the
history) is served cached and uncached by ``run_replay(..., backend="engine")``. results.json
must follow DESIGN.md with the engine's exactness fields, the cached run must restore real
state (continuation after the end checkpoint) and match the uncached logits; a restored state
that is perturbed must show up in those same fields.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from sglang_hybrid.engine.state_bridge import HybridStateBridge
from sglang_hybrid.replay import cli_replay
from sglang_hybrid.engine.tiny_models import TINY_MODELS
from sglang_hybrid.replay.sim import run_replay
from sglang_hybrid.replay.trace import Request, Trace, write_trace

LOGIT_TOLERANCE = 1e-5
STANDARD_FIELDS = {"requests", "prompt_tokens", "cached_tokens", "recomputed_tokens", "hit_rate",
                   "checkpoints_taken", "checkpoint_slots_peak", "ttft_s"}
OUTPUT_LEN = 3


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(151936) for _ in range(n)]


def _request(session: str, turn: int, prompt: list[int], output: list[int]) -> Request:
    return Request(session=session, turn=turn, arrival_s=float(turn) + (0.5 if session == "b" else 0.0),
                   input_ids=np.asarray(prompt, dtype=np.int32), output_ids=np.asarray(output, dtype=np.int32))


@pytest.fixture(scope="module")
def trace() -> Trace:
    rng = random.Random(3)
    system, user_a1, user_a2, edited, user_b1 = (_ids(rng, n) for n in (40, 20, 15, 12, 18))
    out = [_ids(rng, OUTPUT_LEN) for _ in range(4)]
    a0 = system + user_a1
    a1 = a0 + out[0] + user_a2  # append-only: continues from a0's end state
    a2 = system + user_a1[:8] + edited  # an edit inside the first user message
    return Trace([
        _request("a", 0, a0, out[0]),
        _request("b", 0, system + user_b1, out[1]),
        _request("a", 1, a1, out[2]),
        _request("a", 2, a2, out[3]),
    ])


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_engine_replay_is_exact_and_follows_the_schema(trace, model, tmp_path):
    results = run_replay(trace, ["semantic"], backend="engine", model=model, budget_slots=8,
                         out_dir=tmp_path, progress=False)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (results["backend"], results["budget_slots"]) == ("engine", 8)
    row = results["policies"]["semantic"]
    assert STANDARD_FIELDS | {"exactness", "wall_s", "engine"} == set(row)
    assert set(row["ttft_s"]) == {"mean", "p50", "p95", "p99"}
    assert row["exactness"]["requests_checked"] == len(trace.requests) == row["requests"]
    assert row["exactness"]["max_abs_logit_diff"] <= LOGIT_TOLERANCE
    assert row["exactness"]["greedy_mismatches"] == 0
    assert row["cached_tokens"] + row["recomputed_tokens"] == row["prompt_tokens"] == trace.prompt_tokens
    assert row["wall_s"] > 0 and row["engine"]["model"] == model

    per_request = json.loads((tmp_path / "engine_requests.json").read_text())
    restored = {(r["session"], r["turn"]): r["restored_tokens"] for r in per_request}
    first = trace.requests[0]
    # The engine feeds every output token, so a's end checkpoint covers prompt + output.
    assert restored[("a", 1)] == len(first.input_ids) + len(first.output_ids)
    assert restored[("a", 0)] == 0
    assert 0 < row["checkpoints_taken"] and 0 < row["checkpoint_slots_peak"] <= 8


def test_a_perturbed_restore_shows_in_the_exactness_fields(trace, tmp_path, monkeypatch):
    load_cache = HybridStateBridge.load_cache

    def perturbed(self, *args, **kwargs):
        cache = load_cache(self, *args, **kwargs)
        for layer_id in self.linear_layer_ids:
            cache.layers[layer_id].recurrent_states[0] += 0.5
        return cache

    monkeypatch.setattr(HybridStateBridge, "load_cache", perturbed)
    results = run_replay(trace, ["semantic"], backend="engine", model="qwen3-next", budget_slots=8,
                         out_dir=tmp_path, progress=False)
    row = results["policies"]["semantic"]
    assert row["cached_tokens"] > 0
    assert row["exactness"]["max_abs_logit_diff"] > LOGIT_TOLERANCE


def test_engine_backend_rejects_what_it_cannot_serve(trace, tmp_path):
    with pytest.raises(ValueError, match="semantic only"):
        run_replay(trace, ["semantic", "marconi"], backend="engine", out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="unknown model"):
        run_replay(trace, ["semantic"], backend="engine", model="mamba-7b", out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="only served by backend 'engine'"):
        run_replay(trace, ["oracle"], backend="sim", model="qwen3-next", out_dir=tmp_path, progress=False)


def test_replay_cli_engine_backend_prints_the_counted_figures(trace, tmp_path, capsys):
    path = write_trace(tmp_path / "trace.jsonl", trace.requests)
    out = tmp_path / "out"
    # No --policies: the engine backend defaults to the one policy it serves.
    assert cli_replay.replay_main([str(path), "--backend", "engine", "--model", "nemotron-h",
                                   "--budget-slots", "8", "--out", str(out)]) == 0
    row = json.loads((out / "results.json").read_text())["policies"]["semantic"]
    printed = capsys.readouterr().out
    assert f"semantic on tiny nemotron-h: {len(trace.requests)} requests checked" in printed
    assert f"{row['cached_tokens']:,} tokens restored, {row['recomputed_tokens']:,} recomputed" in printed
    assert "greedy mismatches 0" in printed and "vs token ratio" in printed

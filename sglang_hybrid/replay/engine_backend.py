"""Replay backend `engine`: the `semantic` policy served by a real (tiny) hybrid model on CPU.

The simulator counts the tokens a policy would reuse; this backend runs them. Every request
of the trace, in arrival order, is served by ``CpuHybridEngine`` twice, back to back: through
the semantic cache (the ``CheckpointPlanner`` choosing the checkpoint depths, exactly as the
`semantic` policy does in the simulator) and as a plain full prefill. Both runs are fed the
trace's recorded output tokens (teacher forcing), so they see the same sequences and the next
turn's prompt continues what the tree holds. Serving the two runs interleaved, request by
request, keeps a change of CPU load (other jobs on the machine) from favouring either.

Reported per policy, besides DESIGN.md's standard fields: ``exactness`` (the cached run's
logits at the last prompt position against the uncached run's, and how many greedy tokens
differ) and ``wall_s``; TTFT is the measured time from admission to the last prompt
position's logits. The ``engine`` block adds the uncached run's timings and the two ratios the
backend exists to compare: prefill time saved (uncached / cached TTFT) against prompt tokens
saved (prompt / recomputed tokens).

Trace token ids are kept by the cache as they are and folded into the tiny model's vocabulary
at its input (``CpuHybridEngine``), so matching works on the real ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from ..engine.engine import CpuHybridEngine, EngineRequest, EngineResult
from ..engine.tiny_models import DEFAULT_TINY_MODEL, TINY_MODELS
from .results import distribution, policy_row, results_envelope, write_json, write_results
from .trace import Request, Trace

# The peer policies and bounds are token-count models of other systems, not caches this
# engine can run; `semantic` is the one policy with a real cache behind it.
ENGINE_POLICIES = ("semantic",)


@dataclass(frozen=True)
class ServedPair:
    """One trace request served with and without the cache."""

    request: Request
    cached: EngineResult
    uncached: EngineResult

    @property
    def logit_diff(self) -> float:
        return float((self.cached.prompt_logits - self.uncached.prompt_logits).abs().max())

    @property
    def greedy_mismatches(self) -> int:
        return sum(a != b for a, b in zip(self.cached.greedy_ids, self.uncached.greedy_ids))

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.request.session,
            "turn": self.request.turn,
            "prompt_tokens": len(self.request.input_ids),
            "output_tokens": len(self.request.output_ids),
            "restored_tokens": self.cached.restored_tokens,
            "checkpoint_depths": [depth for depth, _ in self.cached.checkpoints],
            "ttft_s": self.cached.ttft_s,
            "ttft_s_uncached": self.uncached.ttft_s,
            "wall_s": self.cached.wall_s,
            "wall_s_uncached": self.uncached.wall_s,
            "max_abs_logit_diff": self.logit_diff,
            "greedy_mismatches": self.greedy_mismatches,
        }


def engine_request(request: Request) -> EngineRequest:
    return EngineRequest(
        prompt=tuple(request.input_ids.tolist()),
        forced_output=tuple(request.output_ids.tolist()),
        session=request.session,
        checkpoint_positions=tuple(request.anchors or ()),
    )


def serve_trace(trace: Trace, *, budget_slots: int, model: str = DEFAULT_TINY_MODEL,
                progress: bool = True) -> tuple[list[ServedPair], int, int]:
    """Serve every request of ``trace`` cached and uncached; returns the pairs, checkpoints
    taken and the peak of checkpoint slots in use."""
    if model not in TINY_MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(TINY_MODELS)}")
    requests = sorted(trace.requests, key=lambda r: r.arrival_s)
    sequence_lengths = [len(r.input_ids) + len(r.output_ids) for r in requests]
    # KV for every token of the trace, so the cache never evicts KV: the replay's reuse then
    # depends on the checkpoint budget alone, as in the simulator.
    engine = CpuHybridEngine(
        TINY_MODELS[model](),
        checkpoint_slots=budget_slots,
        kv_size=sum(sequence_lengths) + 1,
        max_num_reqs=2,
        max_context_len=max(sequence_lengths) + 1,
        # The planner's budget is the cache's checkpoint pool (its free slots at each admission).
        checkpoint_planner="adaptive",
    )
    pairs, slots_peak = [], 0
    for request in tqdm(requests, unit="req", desc=f"engine {model}", disable=not progress):
        served = engine_request(request)
        cached = engine.serve_cached(served)
        slots_peak = max(slots_peak, engine.cache.checkpoint_pool.used_size())
        pairs.append(ServedPair(request, cached, engine.serve_uncached(served)))
    return pairs, engine.cache.stats.taken, slots_peak


def summarize(pairs: Sequence[ServedPair], checkpoints_taken: int, slots_peak: int, model: str) -> dict[str, Any]:
    """The `semantic` policy's entry of results.json."""
    prompt_tokens = sum(len(p.request.input_ids) for p in pairs)
    recomputed_tokens = sum(p.cached.computed_prompt_tokens for p in pairs)
    ttft = sum(p.cached.ttft_s for p in pairs)
    ttft_uncached = sum(p.uncached.ttft_s for p in pairs)
    return policy_row(
        requests=len(pairs),
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(p.cached.restored_tokens for p in pairs),
        recomputed_tokens=recomputed_tokens,
        checkpoints_taken=checkpoints_taken,
        checkpoint_slots_peak=slots_peak,
        ttft_s=[p.cached.ttft_s for p in pairs],
        exactness={
            "requests_checked": len(pairs),
            "max_abs_logit_diff": max(p.logit_diff for p in pairs),
            "greedy_mismatches": sum(p.greedy_mismatches for p in pairs),
        },
        wall_s=sum(p.cached.wall_s for p in pairs),
        engine={
            "model": model,
            "wall_s_uncached": sum(p.uncached.wall_s for p in pairs),
            "ttft_s_uncached": distribution([p.uncached.ttft_s for p in pairs]),
            "prefill_s": ttft,
            "prefill_s_uncached": ttft_uncached,
            # Prefill time saved vs prompt tokens saved: with a cost linear in recomputed
            # tokens they would be equal.
            "prefill_speedup": ttft_uncached / ttft if ttft else float("inf"),
            "token_ratio": prompt_tokens / recomputed_tokens if recomputed_tokens else float("inf"),
        },
    )


def summary_lines(name: str, row: dict[str, Any]) -> list[str]:
    """The counted figures of one policy, for the console."""
    exact, engine = row["exactness"], row["engine"]
    return [
        f"{name} on tiny {engine['model']}: {exact['requests_checked']} requests checked, "
        f"{row['cached_tokens']:,} tokens restored, {row['recomputed_tokens']:,} recomputed "
        f"of {row['prompt_tokens']:,}",
        f"  max abs logit diff {exact['max_abs_logit_diff']:.3g}, greedy mismatches {exact['greedy_mismatches']}",
        f"  wall {row['wall_s']:.2f} s cached / {engine['wall_s_uncached']:.2f} s uncached; prefill "
        f"{engine['prefill_s']:.2f} s / {engine['prefill_s_uncached']:.2f} s = {engine['prefill_speedup']:.2f}x "
        f"vs token ratio {engine['token_ratio']:.2f}x",
    ]


def _plot_ttft(path: Path, pairs: Sequence[ServedPair]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = np.arange(len(pairs))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(index, [p.uncached.ttft_s * 1e3 for p in pairs], marker=".", label="uncached")
    ax.plot(index, [p.cached.ttft_s * 1e3 for p in pairs], marker=".", label="semantic cache")
    ax.set_xlabel("request (arrival order)")
    ax.set_ylabel("measured TTFT (ms, CPU)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def engine_replay(trace: Trace, policies: Sequence[str], *, budget_slots: int, out_dir: str | Path,
                  trace_name: str, profile: str, model: str = DEFAULT_TINY_MODEL,
                  progress: bool = True) -> dict[str, Any]:
    """Serve ``trace`` through the engine and write results.json, engine_requests.json (per
    request), report.md and ttft_engine.png into ``out_dir``; returns the results."""
    unsupported = [name for name in policies if name not in ENGINE_POLICIES]
    if unsupported:
        raise ValueError(f"backend 'engine' serves {', '.join(ENGINE_POLICIES)} only, not {', '.join(unsupported)}")
    pairs, taken, slots_peak = serve_trace(trace, budget_slots=budget_slots, model=model, progress=progress)
    row = summarize(pairs, taken, slots_peak, model)
    results = results_envelope(
        trace=trace_name, backend="engine", profile=profile, budget_slots=budget_slots,
        policies={name: row for name in policies},
    )
    out = write_results(out_dir, results)
    write_json(out / "engine_requests.json", [p.to_json() for p in pairs], indent=1)
    _plot_ttft(out / "ttft_engine.png", pairs)
    report = [f"# Engine replay: {trace_name}", "",
              f"budget {budget_slots} checkpoint slots; cost profile `{profile}` unused (times are measured).", ""]
    for name in policies:
        report += [f"- {line.strip()}" for line in summary_lines(name, row)]
    report += ["", "![measured TTFT](ttft_engine.png)", ""]
    (out / "report.md").write_text("\n".join(report))
    return results

"""Trace replay driver: serve a trace under several policies and budgets, write results.json.

Backend `sim` replays against the shared token tree of policies/base.py: every policy and every
budget in one pass over the trace (policies only differ in checkpoint bookkeeping), TTFT from
the cost model. results.json follows DESIGN.md ("Interfaces") exactly; the hit-rate sweep over
SWEEP_BUDGETS that the report plots goes to budget_sweep.json beside it. Backend `engine`
(engine_backend.py) serves the `semantic` policy with a tiny hybrid model on CPU instead, cached
and uncached, and adds measured times and exactness.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from .cost_model import DEFAULT_PROFILE, CostProfile, get_profile
from .policies import POLICIES, Policy, ServeOutcome, drive, make_policy
from .trace import Trace, load_trace

SWEEP_BUDGETS = (16, 64, 256)
BACKENDS = ("sim", "engine")
PROGRESS_MIN_REQUESTS = 200


@dataclass
class PolicyStats:
    policy: Policy
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    checkpoints_taken: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def add(self, outcome: ServeOutcome, ttft_s: float) -> None:
        self.prompt_tokens += outcome.prompt_tokens
        self.cached_tokens += outcome.cached_tokens
        self.recomputed_tokens += outcome.recomputed_tokens
        self.checkpoints_taken += outcome.checkpoints_taken
        self.ttft_s.append(ttft_s)

    def summary(self) -> dict[str, Any]:
        ttft = np.asarray(self.ttft_s)
        return {
            "requests": len(self.ttft_s),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "checkpoints_taken": self.checkpoints_taken,
            "checkpoint_slots_peak": self.policy.slots_peak,
            "ttft_s": {
                "mean": float(ttft.mean()),
                "p50": float(np.percentile(ttft, 50)),
                "p95": float(np.percentile(ttft, 95)),
                "p99": float(np.percentile(ttft, 99)),
            },
        }


def simulate(trace: Trace, policy_names: Sequence[str], budgets: Sequence[int], profile: CostProfile,
             progress: bool = True) -> dict[int, dict[str, PolicyStats]]:
    """Replay `trace` once for every (budget, policy); returns stats[budget][policy]."""
    for name in policy_names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    stats = {budget: {name: PolicyStats(make_policy(name, budget, profile)) for name in policy_names}
             for budget in budgets}
    flat = [entry for by_name in stats.values() for entry in by_name.values()]
    requests = sorted(trace.requests, key=lambda r: r.arrival_s)
    bar = tqdm(total=len(requests), unit="req", desc="replay",
               disable=not progress or len(requests) < PROGRESS_MIN_REQUESTS)
    for _, outcomes in drive(requests, [entry.policy for entry in flat]):
        for entry, outcome in zip(flat, outcomes):
            entry.add(outcome, profile.ttft_s(outcome.restored_depth, outcome.recomputed_tokens))
        bar.update()
    bar.close()
    return stats


def resolve_budget(profile: CostProfile, budget_slots: int | None, budget_gib: float | None) -> int:
    if budget_slots is not None and budget_gib is not None:
        raise ValueError("give either budget_slots or budget_gib, not both")
    if budget_gib is not None:
        return profile.slots_for_gib(budget_gib)
    return 64 if budget_slots is None else budget_slots


def run_replay(
    trace: str | Path | Trace,
    policies: Sequence[str],
    *,
    budget_slots: int | None = None,
    budget_gib: float | None = None,
    backend: str = "sim",
    profile: str = DEFAULT_PROFILE,
    out_dir: str | Path,
    sweep_budgets: Sequence[int] = SWEEP_BUDGETS,
    progress: bool = True,
    model: str | None = None,
) -> dict[str, Any]:
    """Replay a trace (path or Trace) and write results.json, budget_sweep.json, report.md and plots.

    ``model`` names the tiny model of backend `engine` (engine_backend.MODELS).
    """
    from .report import write_report

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not available in this build; available: {', '.join(BACKENDS)}")
    cost = get_profile(profile)
    budget = resolve_budget(cost, budget_slots, budget_gib)
    loaded = trace if isinstance(trace, Trace) else load_trace(trace)
    trace_name = loaded.meta.get("name") or (str(trace) if not isinstance(trace, Trace) else "in-memory trace")
    if backend == "engine":
        from .engine_backend import DEFAULT_MODEL, engine_replay

        return engine_replay(loaded, policies, budget_slots=budget, out_dir=out_dir, trace_name=trace_name,
                             profile=cost.name, model=model or DEFAULT_MODEL, progress=progress)
    if model is not None:
        raise ValueError("a model is only served by backend 'engine'")
    budgets = sorted({budget, *sweep_budgets})
    stats = simulate(loaded, policies, budgets, cost, progress)
    results = {
        "trace": trace_name,
        "backend": backend,
        "profile": cost.name,
        "budget_slots": budget,
        "policies": {name: stats[budget][name].summary() for name in policies},
    }
    sweep = {str(b): {name: stats[b][name].summary() for name in policies} for b in budgets}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "budget_sweep.json").write_text(json.dumps(sweep, indent=2) + "\n")
    write_report(out, results, sweep, {name: stats[budget][name].ttft_s for name in policies}, cost, loaded.meta)
    return results

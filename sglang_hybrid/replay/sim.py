"""Trace replay driver: serve a trace under several policies and budgets, write results.json.

Backend `sim` replays against the shared token tree of policies/base.py: every policy and every
budget in one pass over the trace (policies only differ in checkpoint bookkeeping), TTFT from
the cost model. results.json follows DESIGN.md ("Interfaces") exactly; the hit-rate sweep over
SWEEP_BUDGETS that the report plots goes to budget_sweep.json beside it. Backend `engine`
(engine_backend.py) serves the `semantic` policy with a tiny hybrid model on CPU instead, cached
and uncached, and adds measured times and exactness. Backend `server` (server_backend.py)
replays the trace against a running SGLang server and reports what its cache did.

A host-memory checkpoint tier (`host_slots`) exists in the real cache the `semantic` policy
drives, so only that policy gets one; the peers are replayed as they ship, device pool only.
With a host tier, results.json (and budget_sweep.json) add to DESIGN.md's schema the host budget
(`host_slots`) and, per policy, the requests restored from the host tier (`host_restores`),
whose TTFT carries the PCIe copy; without one they are exactly DESIGN.md's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from ..config import DEFAULT_CHECKPOINT_SLOTS
from ..engine.tiny_models import DEFAULT_TINY_MODEL
from .cost_model import DEFAULT_PROFILE, CostProfile, get_profile
from .policies import POLICIES, Policy, ServeOutcome, drive, make_policy
from .policies.bounds import ClairvoyantPolicy
from .policies.semantic import SemanticPolicy, SessionClosingSemanticPolicy
from .results import policy_row, results_envelope, write_json, write_results
from .trace import Request, Trace, load_trace

SWEEP_BUDGETS = (16, 64, 256)
BACKENDS = ("sim", "engine", "server")
PROGRESS_MIN_REQUESTS = 200


@dataclass
class PolicyStats:
    policy: Policy
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    checkpoints_taken: int = 0
    host_restores: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def add(self, outcome: ServeOutcome, ttft_s: float) -> None:
        self.prompt_tokens += outcome.prompt_tokens
        self.cached_tokens += outcome.cached_tokens
        self.recomputed_tokens += outcome.recomputed_tokens
        self.checkpoints_taken += outcome.checkpoints_taken
        self.host_restores += outcome.restored_from_host
        self.ttft_s.append(ttft_s)

    def summary(self, host_tier: bool = False) -> dict[str, Any]:
        """The policy's row of results.json; `host_tier` adds `host_restores`."""
        return policy_row(
            requests=len(self.ttft_s),
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            recomputed_tokens=self.recomputed_tokens,
            checkpoints_taken=self.checkpoints_taken,
            checkpoint_slots_peak=self.policy.slots_peak,
            ttft_s=self.ttft_s,
            **({"host_restores": self.host_restores} if host_tier else {}),
        )


# Policies built with the trace's requests: the offline `clairvoyant` reference knows them
# ahead, `semantic-closing`'s client knows which request ends each session.
TRACE_POLICIES = (ClairvoyantPolicy.name, SessionClosingSemanticPolicy.name)


def build_policy(name: str, budget_slots: int, profile: CostProfile, host_slots: int = 0,
                 requests: Sequence[Request] = ()) -> Policy:
    """`name` under a device budget; `host_slots` sizes the semantic policies' host tier, the
    other policies have none and ignore it; `requests` (in arrival order) are what the
    ``TRACE_POLICIES`` are built with."""
    if name == SemanticPolicy.name:
        return SemanticPolicy(budget_slots, profile, host_slots=host_slots)
    if name == ClairvoyantPolicy.name:
        return ClairvoyantPolicy(budget_slots, profile, requests)
    if name == SessionClosingSemanticPolicy.name:
        return SessionClosingSemanticPolicy(budget_slots, profile, requests, host_slots=host_slots)
    return make_policy(name, budget_slots, profile)


def simulate(trace: Trace, policy_names: Sequence[str], budgets: Sequence[int], profile: CostProfile,
             progress: bool = True, host_slots: int = 0) -> dict[int, dict[str, PolicyStats]]:
    """Replay `trace` once for every (budget, policy); returns stats[budget][policy].

    `host_slots`: the semantic policy's host tier at every budget (see build_policy).
    """
    for name in policy_names:
        if name not in POLICIES and name not in TRACE_POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join([*POLICIES, *TRACE_POLICIES])}")
    if host_slots < 0:
        raise ValueError(f"host_slots must be >= 0, got {host_slots}")
    requests = sorted(trace.requests, key=lambda r: r.arrival_s)
    stats = {budget: {name: PolicyStats(build_policy(name, budget, profile, host_slots, requests))
                      for name in policy_names}
             for budget in budgets}
    flat = [entry for by_name in stats.values() for entry in by_name.values()]
    bar = tqdm(total=len(requests), unit="req", desc="replay",
               disable=not progress or len(requests) < PROGRESS_MIN_REQUESTS)
    for _, outcomes in drive(requests, [entry.policy for entry in flat]):
        for entry, outcome in zip(flat, outcomes):
            entry.add(outcome, profile.ttft_s(outcome.restored_depth, outcome.recomputed_tokens,
                                              outcome.restored_from_host))
        bar.update()
    bar.close()
    return stats


def resolve_budget(profile: CostProfile, budget_slots: int | None, budget_gib: float | None) -> int:
    if budget_slots is not None and budget_gib is not None:
        raise ValueError("give either budget_slots or budget_gib, not both")
    if budget_gib is not None:
        return profile.slots_for_gib(budget_gib)
    return DEFAULT_CHECKPOINT_SLOTS if budget_slots is None else budget_slots


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
    host_slots: int = 0,
    server_url: str | None = None,
    concurrency: int = 1,
) -> dict[str, Any]:
    """Replay a trace (path or Trace) and write results.json, budget_sweep.json, report.md and plots.

    ``model`` names the tiny model of backend `engine` (engine.tiny_models.TINY_MODELS). ``host_slots``
    sizes the host checkpoint tier of the `semantic` policy (backend `sim` only). Backend
    `server` replays against the SGLang server at ``server_url`` with up to ``concurrency``
    requests in flight (server_backend.py).
    """
    from .report import write_report

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not available in this build; available: {', '.join(BACKENDS)}")
    if (server_url is not None) != (backend == "server"):
        raise ValueError("backend 'server' needs a server_url, and only it takes one")
    if host_slots and backend != "sim":
        raise ValueError(f"a host checkpoint tier is replayed by backend 'sim' only, not {backend!r}")
    cost = get_profile(profile)
    budget = resolve_budget(cost, budget_slots, budget_gib)
    loaded = trace if isinstance(trace, Trace) else load_trace(trace)
    trace_name = loaded.meta.get("name") or (str(trace) if not isinstance(trace, Trace) else "in-memory trace")
    if backend == "server":
        from .server_backend import server_replay

        return server_replay(loaded, server_url=server_url, out_dir=out_dir, trace_name=trace_name,
                             profile=cost.name, concurrency=concurrency, progress=progress)
    if backend == "engine":
        from .engine_backend import engine_replay

        return engine_replay(loaded, policies, budget_slots=budget, out_dir=out_dir, trace_name=trace_name,
                             profile=cost.name, model=model or DEFAULT_TINY_MODEL, progress=progress)
    if model is not None:
        raise ValueError("a model is only served by backend 'engine'")
    budgets = sorted({budget, *sweep_budgets})
    stats = simulate(loaded, policies, budgets, cost, progress, host_slots)
    results = results_envelope(
        trace=trace_name, backend=backend, profile=cost.name, budget_slots=budget, host_slots=host_slots,
        policies={name: stats[budget][name].summary(host_tier=bool(host_slots)) for name in policies},
    )
    sweep = {str(b): {name: stats[b][name].summary(host_tier=bool(host_slots)) for name in policies} for b in budgets}
    out = write_results(out_dir, results)
    write_json(out / "budget_sweep.json", sweep)
    write_report(out, results, sweep, {name: stats[budget][name].ttft_s for name in policies}, cost, loaded.meta)
    return results

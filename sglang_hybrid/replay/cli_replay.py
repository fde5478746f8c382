"""`sglang-hybrid replay [TRACE] --policies P1,... --out DIR`."""

from __future__ import annotations

import argparse
from typing import Sequence

from .cost_model import DEFAULT_PROFILE, PROFILES
from .policies import POLICIES
from .sim import BACKENDS, run_replay


def replay_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-hybrid replay",
                                     description="Replay a canonical trace under checkpoint policies.")
    parser.add_argument("trace", nargs="?",
                        help="canonical trace (.jsonl); default: the project's seeded synthetic agent sessions")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, from: {', '.join(POLICIES)}")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-slots", type=int)
    budget.add_argument("--budget-gib", type=float)
    parser.add_argument("--backend", default="sim", choices=BACKENDS)
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        parser.error(f"unknown policies: {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    if args.trace is None:
        from .synthetic import synthetic_agent_trace

        trace = synthetic_agent_trace()
    else:
        trace = args.trace
    results = run_replay(trace, names, budget_slots=args.budget_slots, budget_gib=args.budget_gib,
                         backend=args.backend, profile=args.profile, out_dir=args.out)
    for name, row in results["policies"].items():
        print(f"{name:22s} hit {row['hit_rate']:.3f}  recomputed {row['recomputed_tokens']:>12,}  "
              f"TTFT p95 {row['ttft_s']['p95'] * 1e3:8.1f} ms")
    print(f"wrote {args.out}/results.json, report.md, plots")
    return 0

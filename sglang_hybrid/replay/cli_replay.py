"""`sglang-hybrid replay [TRACE] --policies P1,... --out DIR`."""

from __future__ import annotations

import argparse
from typing import Sequence

from ..engine.tiny_models import DEFAULT_TINY_MODEL, TINY_MODELS
from .cost_model import DEFAULT_PROFILE, PROFILES
from .policies import POLICIES
from .sim import BACKENDS, run_replay


def replay_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-hybrid replay",
                                     description="Replay a canonical trace under checkpoint policies.")
    parser.add_argument("trace", nargs="?",
                        help="canonical trace (.jsonl); default: the project's seeded synthetic agent sessions")
    parser.add_argument("--policies",
                        help=f"comma-separated, from: {', '.join(POLICIES)}; default: all of them "
                             "(backend sim), semantic (backend engine)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-slots", type=int)
    budget.add_argument("--budget-gib", type=float)
    parser.add_argument("--host-slots", type=int, default=0,
                        help="host-memory checkpoint slots below the device budget (backend sim); only the "
                             "semantic policy has a host tier, the other policies ignore it (default 0: none)")
    parser.add_argument("--backend", default="sim", choices=BACKENDS)
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    parser.add_argument("--model", choices=list(TINY_MODELS),
                        help=f"tiny model served by --backend engine (default {DEFAULT_TINY_MODEL})")
    parser.add_argument("--server-url",
                        help="SGLang server replayed against by --backend server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--concurrency", type=int,
                        help="requests in flight at once (backend server; default 1: one at a time, in "
                             "arrival order, as the simulator serves them)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.backend == "server":
        if args.server_url is None:
            parser.error("--backend server needs --server-url")
        if args.policies or args.budget_slots is not None or args.budget_gib is not None:
            parser.error("--backend server measures the server's own cache: no --policies or budget")
        if args.concurrency is not None and args.concurrency < 1:
            parser.error(f"--concurrency must be >= 1, got {args.concurrency}")
    elif args.server_url is not None or args.concurrency is not None:
        parser.error("--server-url and --concurrency apply to --backend server only")
    policies = args.policies or {"engine": "semantic", "server": ""}.get(args.backend, ",".join(POLICIES))
    names = [name.strip() for name in policies.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        parser.error(f"unknown policies: {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    if args.model is not None and args.backend != "engine":
        parser.error("--model applies to --backend engine only")
    if args.host_slots < 0:
        parser.error(f"--host-slots must be >= 0, got {args.host_slots}")
    if args.host_slots and args.backend != "sim":
        parser.error("--host-slots applies to --backend sim only")
    if args.trace is None:
        from .synthetic import synthetic_agent_trace

        trace = synthetic_agent_trace()
    else:
        trace = args.trace
    results = run_replay(trace, names, budget_slots=args.budget_slots, budget_gib=args.budget_gib,
                         backend=args.backend, profile=args.profile, out_dir=args.out, model=args.model,
                         host_slots=args.host_slots, server_url=args.server_url,
                         concurrency=args.concurrency or 1)
    if args.backend == "server":
        from .server_backend import summary_lines

        for name, row in results["policies"].items():
            print("\n".join(summary_lines(name, row, results["server"])))
        print(f"wrote {args.out}/results.json, server_requests.json, report.md, ttft_cdf.png")
        return 0
    if args.backend == "engine":
        from .engine_backend import summary_lines

        for name, row in results["policies"].items():
            print("\n".join(summary_lines(name, row)))
        print(f"wrote {args.out}/results.json, engine_requests.json, report.md, ttft_engine.png")
        return 0
    for name, row in results["policies"].items():
        print(f"{name:22s} hit {row['hit_rate']:.3f}  recomputed {row['recomputed_tokens']:>12,}  "
              f"TTFT p95 {row['ttft_s']['p95'] * 1e3:8.1f} ms")
    print(f"wrote {args.out}/results.json, report.md, plots")
    return 0

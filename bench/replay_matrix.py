"""Recomputed tokens of every checkpoint policy, on a tuning or a test trace set, per edit
pattern, number of sessions active at once, and budget.

The two sets (``sglang_hybrid.replay.trace_sets``) hold the same edit patterns -- reasoning
kept or stripped, observation masking, condensation, a rewritten memory block, repo-map
rewrites on tau-bench airline sessions, and (test set only) the SWE-agent trajectory -- drawn
from disjoint seeds and disjoint tau-bench tasks. Tune policies on `--set tuning`; report
`--set test`. Each trace is replayed once by the sim backend for every policy at every budget.

Per trace and budget it reports `semantic`'s recomputed prompt tokens as a ratio to the oracle
(a checkpoint at every position, unbounded), to the best peer (the peer that recomputes
least there, named), and to the clairvoyant reference (``policies/bounds.py``: same budget,
knows the future); beside it, `semantic-closing`'s ratio to the oracle: the same cache with a
client that closes each session after its last request (``/close_session``), what knowing a
session's end is worth. Flags: `MISS` where `semantic` exceeds the target ratio to the oracle at a
target budget; `PEER WIN` where a peer recomputes fewer tokens than `semantic`.

Converted traces are cached under --cache-dir. Writes results/bench/replay_matrix_<set>.json
and .png (ratio to the oracle per trace at each target budget); the last line printed is
`semantic_worst_ratio_at_16: <value>` over the set.

    python bench/replay_matrix.py --set test [--quick] [--patterns memory-block repo-map]
        [--concurrency 2 6 10 20] [--budgets 8 16 32 64 256] [--tasks 8]
`--quick` (a few minutes on 2 cores): 10 sessions active, budgets 16 64 256, 4 tasks.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sglang_hybrid.replay.cost_model import DEFAULT_PROFILE, get_profile
from sglang_hybrid.replay.policies import PEER_POLICIES
from sglang_hybrid.replay.policies.bounds import ClairvoyantPolicy
from sglang_hybrid.replay.policies.semantic import SessionClosingSemanticPolicy
from sglang_hybrid.replay.shared_data import REPO_ROOT
from sglang_hybrid.replay.sim import simulate
from sglang_hybrid.replay.trace import Trace, load_trace, write_trace
from sglang_hybrid.replay.trace_sets import (
    CONCURRENCY_LEVELS, DEFAULT_CONCURRENCY, SWE_AGENT, TRACE_SETS, build_trace, mean_active_sessions,
)

DEFAULT_CACHE_DIR = Path("/tmp") / "sglang-hybrid-replay-matrix"
OURS = "semantic"
CLAIRVOYANT = ClairvoyantPolicy.name
CLOSING = SessionClosingSemanticPolicy.name
PEERS = tuple(name for name in PEER_POLICIES if name not in ("oracle", "none"))
BUDGETS = (8, 16, 32, 64, 256)
QUICK_BUDGETS = (16, 64, 256)
DEFAULT_TASKS = 8
QUICK_TASKS = 4
# Budget -> the most recomputed tokens, as a multiple of the oracle's, that meets the target.
TARGETS = {16: 1.8, 64: 1.03}
HEADLINE_BUDGET = 16


def load_or_build(set_name: str, pattern: str, concurrency: int, tasks: int, cache_dir: Path) -> Trace:
    key = f"{set_name}-{pattern}" if pattern == SWE_AGENT else f"{set_name}-{pattern}-c{concurrency}-t{tasks}"
    path = cache_dir / f"{key}.jsonl"
    if path.exists():
        return load_trace(path)
    trace = build_trace(TRACE_SETS[set_name], pattern, concurrency, tasks)
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_trace(path, trace.requests, trace.meta)
    return trace


def measure(trace: Trace, budgets: list[int]) -> dict[str, dict]:
    """budget -> recomputed tokens per policy and semantic's ratios."""
    stats = simulate(trace, ["oracle", OURS, CLOSING, CLAIRVOYANT, *PEERS], budgets, get_profile(DEFAULT_PROFILE),
                     progress=False)
    rows = {}
    for budget in budgets:
        tokens = {name: entry.recomputed_tokens for name, entry in stats[budget].items()}
        best_peer = min(PEERS, key=lambda name: (tokens[name], name))
        ours = tokens[OURS]
        rows[str(budget)] = {
            "recomputed_tokens": tokens,
            "best_peer": best_peer,
            "ratio_to_oracle": ours / tokens["oracle"],
            "ratio_to_best_peer": ours / max(tokens[best_peer], 1),
            "ratio_to_clairvoyant": ours / max(tokens[CLAIRVOYANT], 1),
            "closing_ratio_to_oracle": tokens[CLOSING] / tokens["oracle"],
        }
    return rows


def flags(name: str, rows: dict[str, dict]) -> list[str]:
    found = []
    for budget, limit in TARGETS.items():
        row = rows.get(str(budget))
        if row is not None and row["ratio_to_oracle"] > limit:
            found.append(f"MISS {name}: {OURS} {row['ratio_to_oracle']:.3f}x oracle at {budget} slots (target {limit})")
    for budget, row in rows.items():
        if row["ratio_to_best_peer"] > 1.0:
            found.append(f"PEER WIN {name} @ {budget}: {row['best_peer']} recomputes "
                         f"{1 / row['ratio_to_best_peer']:.3f}x of {OURS}'s")
    return found


def print_table(results: dict[str, dict], budgets: list[int]) -> None:
    width = max(len(name) for name in results) + 2
    header = (f"{'trace':{width}s}{'slots':>6s}{'/oracle':>10s}{'/best peer':>12s}{'best peer':>21s}"
              f"{'/clairvoyant':>14s}{'clairv/oracle':>15s}{'closing/oracle':>16s}")
    print(header)
    print("-" * len(header))
    for name, entry in results.items():
        for budget in budgets:
            row = entry["budgets"][str(budget)]
            tokens = row["recomputed_tokens"]
            print(f"{name:{width}s}{budget:>6d}{row['ratio_to_oracle']:>9.3f}x{row['ratio_to_best_peer']:>11.3f}x"
                  f"{row['best_peer']:>21s}{row['ratio_to_clairvoyant']:>13.3f}x"
                  f"{tokens[CLAIRVOYANT] / tokens['oracle']:>14.3f}x{row['closing_ratio_to_oracle']:>15.3f}x")


def plot(results: dict[str, dict], budgets: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shown = [b for b in budgets if b in TARGETS]
    names = list(results)
    x = np.arange(len(names))
    width = 0.8 / max(len(shown), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * len(names)), 5.0))
    for i, budget in enumerate(shown):
        ratios = [results[name]["budgets"][str(budget)]["ratio_to_oracle"] for name in names]
        ax.bar(x + (i - (len(shown) - 1) / 2) * width, ratios, width, label=f"{budget} slots")
    ax.set_xticks(x, names, rotation=40, ha="right", fontsize=7)
    ax.set_ylabel(f"{OURS} recomputed tokens / oracle's")
    ax.set_title(f"{OURS} relative to the oracle")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(TRACE_SETS), default="test")
    parser.add_argument("--patterns", nargs="+", default=None, help="default: every pattern of the set")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None,
                        help=f"sessions active at once (default {' '.join(map(str, CONCURRENCY_LEVELS))})")
    parser.add_argument("--budgets", type=int, nargs="+", default=None,
                        help=f"checkpoint slots (default {' '.join(map(str, BUDGETS))})")
    parser.add_argument("--tasks", type=int, default=None, help=f"tau-bench tasks per trace (default {DEFAULT_TASKS})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{DEFAULT_CONCURRENCY} sessions active, budgets {QUICK_BUDGETS}, {QUICK_TASKS} tasks")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="built traces (reused)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench")
    args = parser.parse_args()
    trace_set = TRACE_SETS[args.set]
    patterns = args.patterns or trace_set.patterns()
    unknown = sorted(set(patterns) - set(trace_set.patterns()))
    if unknown:
        parser.error(f"unknown patterns {unknown} for set {args.set}; known: {' '.join(trace_set.patterns())}")
    concurrency = args.concurrency or ([DEFAULT_CONCURRENCY] if args.quick else list(CONCURRENCY_LEVELS))
    budgets = sorted(set(args.budgets or (QUICK_BUDGETS if args.quick else BUDGETS)))
    tasks = args.tasks or (QUICK_TASKS if args.quick else DEFAULT_TASKS)

    results: dict[str, dict] = {}
    for pattern in patterns:
        for active in ([DEFAULT_CONCURRENCY] if pattern == SWE_AGENT else concurrency):
            name = pattern if pattern == SWE_AGENT else f"{pattern}@{active}"
            trace = load_or_build(args.set, pattern, active, tasks, args.cache_dir)
            start = time.perf_counter()
            rows = measure(trace, budgets)
            results[name] = {"requests": len(trace.requests), "prompt_tokens": trace.prompt_tokens,
                             "active_sessions": mean_active_sessions(trace), "budgets": rows}
            print(f"{name}: {len(trace.requests)} requests, {trace.prompt_tokens:,} prompt tokens, "
                  f"{results[name]['active_sessions']:.1f} sessions active "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)

    print()
    print_table(results, budgets)
    found = [flag for name, entry in results.items() for flag in flags(name, entry["budgets"])]
    print()
    print("\n".join(found) if found else "no target miss, no peer win")
    headline = HEADLINE_BUDGET if HEADLINE_BUDGET in budgets else budgets[0]
    worst = max(entry["budgets"][str(headline)]["ratio_to_oracle"] for entry in results.values())
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"replay_matrix_{args.set}"
    (args.out / f"{stem}.json").write_text(json.dumps({
        "set": args.set, "tasks": tasks, "profile": DEFAULT_PROFILE, "budgets": budgets, "targets": TARGETS,
        "peers": list(PEERS), "traces": results, "flags": found, f"{OURS}_worst_ratio_at_{headline}": worst,
    }, indent=2) + "\n")
    plot(results, budgets, args.out / f"{stem}.png")
    print(f"{OURS}_worst_ratio_at_{headline}: {worst:.4f}")


if __name__ == "__main__":
    main()

"""Recomputed tokens of every checkpoint policy relative to the oracle, per edit pattern and budget.

Traces: the SWE-agent .traj (its recorded, already-masked prompts) and the tau-bench airline
trajectories, append-only and under each framework edit emulator of
`sglang_hybrid.replay.emulators.EMULATORS` (default seed and parameters, as `sglang-hybrid
trace edit` applies them), all rendered with the Qwen3 template. The compaction emulators'
defaults (a view over 120 events; 83.5 % / 90 % of a 200k / 272k window) never fire on
tau-bench sessions (10-60 messages, 2-7k tokens), so those traces equal the append-only one;
the `NAME:KEY=VALUE` variants scale their thresholds to the sessions, as `trace edit --param`
does, so each session is summarized or compacted once or more. Each trace is replayed once by
the sim backend for every policy at every budget. The ratio is a policy's recomputed prompt
tokens over the oracle's (a checkpoint at every position, unbounded).

Flags: `MISS` where `semantic` exceeds the target ratio at the target budget; `PEER WIN` where
a peer policy recomputes fewer tokens than `semantic` on a trace at a budget. Converted traces
are cached (conversion tokenizes every call) under --cache-dir. Writes
results/bench/replay_matrix.json and replay_matrix.png (ratio at the target budget per trace
and policy); the last line printed is `semantic_worst_ratio_at_64: <value>`.

    python bench/replay_matrix.py [--budgets 16 64 256] [--traces aider openhands-recent]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sglang_hybrid.replay.cli_trace import calls_from_trace
from sglang_hybrid.replay.converters import RenderConfig, calls_to_trace, convert
from sglang_hybrid.replay.cost_model import DEFAULT_PROFILE, get_profile
from sglang_hybrid.config import DEFAULT_CHECKPOINT_SLOTS
from sglang_hybrid.replay.emulators import EMULATORS, make_emulator, parse_emulator_params
from sglang_hybrid.replay.policies import PEER_POLICIES
from sglang_hybrid.replay.shared_data import QWEN3_TEMPLATE, REPO_ROOT, SWE_AGENT_TRAJ, TAU_BENCH_AIRLINE
from sglang_hybrid.replay.sim import SWEEP_BUDGETS, simulate
from sglang_hybrid.replay.trace import Trace, load_trace, write_trace

DEFAULT_CACHE_DIR = Path("/tmp") / "sglang-hybrid-replay-matrix"

OURS = "semantic"
PEERS = tuple(name for name in PEER_POLICIES if name != "oracle")
TARGET_BUDGET = DEFAULT_CHECKPOINT_SLOTS
TARGET_RATIO = 1.05
SWE_AGENT = "swe-agent"
TAU = "tau-bench"
# Emulator parameters scaled to tau-bench sessions (see the docstring).
SCALED = {
    "openhands-summarize": "max_size=16",
    "claude-code-compact": "context_tokens=3600",
    "codex-compact": "context_tokens=3600",
}


def trace_names() -> list[str]:
    emulated = [*EMULATORS, *(f"{name}:{params}" for name, params in SCALED.items())]
    return [SWE_AGENT, TAU, *(f"{TAU}+{name}" for name in emulated)]


def _build(name: str, cache_dir: Path) -> Trace:
    template = str(QWEN3_TEMPLATE)
    if name == SWE_AGENT:
        return convert("swe-agent", SWE_AGENT_TRAJ, template_path=template)
    if name == TAU:
        return convert("tau-bench", TAU_BENCH_AIRLINE, template_path=template)
    emulator, _, assignments = name.removeprefix(f"{TAU}+").partition(":")
    if emulator not in EMULATORS:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(trace_names())}")
    params = parse_emulator_params(emulator, assignments.split(",") if assignments else [])
    source = load_or_convert(TAU, cache_dir)
    # What `sglang-hybrid trace edit [--param ...]` does with its default seed and arrival model.
    return calls_to_trace(calls_from_trace(source), source=str(TAU_BENCH_AIRLINE), converter="edit",
                          emulator=make_emulator(emulator, **params), render=RenderConfig(template))


def load_or_convert(name: str, cache_dir: Path) -> Trace:
    path = cache_dir / f"{name}.jsonl"
    if path.exists():
        return load_trace(path)
    trace = _build(name, cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_trace(path, trace.requests, trace.meta)
    return trace


def measure(trace: Trace, budgets: list[int]) -> dict[str, dict[str, dict[str, float]]]:
    """budget -> policy -> recomputed tokens and ratio to the oracle's."""
    profile = get_profile(DEFAULT_PROFILE)
    stats = simulate(trace, ["oracle", OURS, *PEERS], budgets, profile, progress=False)
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for budget in budgets:
        oracle = stats[budget]["oracle"].recomputed_tokens
        rows[str(budget)] = {
            name: {"recomputed_tokens": entry.recomputed_tokens, "ratio": entry.recomputed_tokens / oracle}
            for name, entry in stats[budget].items() if name != "oracle"
        }
        rows[str(budget)]["oracle"] = {"recomputed_tokens": oracle, "ratio": 1.0}
    return rows


def flags(name: str, rows: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    found = []
    target = rows.get(str(TARGET_BUDGET))
    if target is not None and target[OURS]["ratio"] > TARGET_RATIO:
        found.append(f"MISS {name}: {OURS} {target[OURS]['ratio']:.3f}x oracle at {TARGET_BUDGET} slots "
                     f"(target {TARGET_RATIO})")
    for budget, by_policy in rows.items():
        ours = by_policy[OURS]["recomputed_tokens"]
        for peer in PEERS:
            if by_policy[peer]["recomputed_tokens"] < ours:
                found.append(f"PEER WIN {name} @ {budget}: {peer} {by_policy[peer]['ratio']:.3f}x < "
                             f"{OURS} {by_policy[OURS]['ratio']:.3f}x")
    return found


def print_table(results: dict[str, dict], budgets: list[int]) -> None:
    policies = [OURS, *PEERS]
    width = max(len(name) for name in results) + 2
    header = f"{'trace':{width}s}{'slots':>6s}" + "".join(f"{p:>20s}" for p in policies)
    print(header)
    print("-" * len(header))
    for name, rows in results.items():
        for budget in budgets:
            row = rows[str(budget)]
            print(f"{name:{width}s}{budget:>6d}" + "".join(f"{row[p]['ratio']:>19.3f}x" for p in policies))


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    policies = [OURS, *PEERS]
    names = list(results)
    x = np.arange(len(names))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(names)), 5.0))
    for i, policy in enumerate(policies):
        ratios = [results[name][str(TARGET_BUDGET)][policy]["ratio"] for name in names]
        ax.bar(x + (i - (len(policies) - 1) / 2) * width, ratios, width, label=policy)
    ax.axhline(TARGET_RATIO, color="black", linestyle="--", linewidth=0.8, label=f"target {TARGET_RATIO}x")
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("recomputed tokens / oracle's (log)")
    ax.set_title(f"Recomputed tokens relative to the oracle at {TARGET_BUDGET} checkpoint slots")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=list(SWEEP_BUDGETS))
    parser.add_argument("--traces", nargs="+", default=trace_names(),
                        help=f"subset of: {' '.join(trace_names())} (an emulator name alone means tau-bench+NAME)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="converted traces (reused)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench")
    args = parser.parse_args()
    if TARGET_BUDGET not in args.budgets:
        parser.error(f"--budgets must include the target budget {TARGET_BUDGET}")
    names = [name if name in (SWE_AGENT, TAU) or name.startswith(f"{TAU}+") else f"{TAU}+{name}"
             for name in args.traces]
    unknown = sorted(set(names) - set(trace_names()))
    if unknown:
        parser.error(f"unknown traces {unknown}; known: {' '.join(trace_names())}")
    budgets = sorted(set(args.budgets))

    results: dict[str, dict] = {}
    for name in names:
        trace = load_or_convert(name, args.cache_dir)
        start = time.perf_counter()
        results[name] = measure(trace, budgets)
        ours = results[name][str(TARGET_BUDGET)][OURS]["ratio"]
        print(f"{name}: {len(trace.requests)} requests, {trace.prompt_tokens:,} prompt tokens, "
              f"{OURS} {ours:.3f}x at {TARGET_BUDGET} ({time.perf_counter() - start:.0f} s)", flush=True)

    print()
    print_table(results, budgets)
    found = [flag for name, rows in results.items() for flag in flags(name, rows)]
    print()
    print("\n".join(found) if found else "no target miss, no peer win")
    worst = max(rows[str(TARGET_BUDGET)][OURS]["ratio"] for rows in results.values())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_matrix.json").write_text(json.dumps({
        "profile": DEFAULT_PROFILE, "budgets": budgets, "target": {"budget": TARGET_BUDGET, "ratio": TARGET_RATIO},
        "policies": [OURS, *PEERS], "traces": results, "flags": found,
        f"{OURS}_worst_ratio_at_{TARGET_BUDGET}": worst,
    }, indent=2) + "\n")
    plot(results, args.out / "replay_matrix.png")
    print(f"{OURS}_worst_ratio_at_{TARGET_BUDGET}: {worst:.4f}")


if __name__ == "__main__":
    main()

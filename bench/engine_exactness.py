"""Exactness and measured prefill savings of the semantic cache on real agent traces (CPU engine).

Each trace is replayed with `--backend engine` on every tiny model: each request served through
the semantic cache and as a plain full prefill (same recorded output tokens fed to both). Per
(trace, model) it checks the two criteria of issue 3:

* exact: max abs logit difference at the last prompt position <= 1e-5 and no greedy token
  differs, over every request;
* fast: prefill time saved (uncached / cached TTFT, measured) >= 0.8 x prompt tokens saved
  (prompt / recomputed tokens).

Traces: the SWE-agent trajectory (13 requests) and the first 3 tau-bench airline sessions
(31 requests) as converted, under three agent edit patterns: openhands-masking,
claude-code-clear (seed 1: at seed 0 no clearing fires in these 3 sessions) and
qwen3-reasoning. Torch runs on one thread so the timings do not depend on how many cores other
jobs leave free. Writes results/bench/engine_exactness.json and .png, the replay outputs under
results/bench/engine_exactness/; the last line printed is
`engine_exactness_max_abs_logit_diff: <value>` (over all runs).

    python bench/engine_exactness.py [--models qwen3-next,nemotron-h] [--traces swe-agent,tau-masking]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sglang_hybrid.replay.cli_trace import convert_main, edit_main
from sglang_hybrid.engine.tiny_models import TINY_MODELS
from sglang_hybrid.replay.shared_data import QWEN3_TEMPLATE, REPO_ROOT, SWE_AGENT_TRAJ, TAU_BENCH_AIRLINE
from sglang_hybrid.replay.sim import run_replay

OUT = REPO_ROOT / "results" / "bench"
LOGIT_TOLERANCE = 1e-5
SPEEDUP_FRACTION = 0.8  # of the token ratio
TAU_SESSIONS = 3
# Trace name -> (emulator, seed) applied to the tau-bench sessions; None = SWE-agent as converted.
TRACES = {
    "swe-agent": None,
    "tau-masking": ("openhands-masking", 0),
    "tau-claude-clear": ("claude-code-clear", 1),
    "tau-reasoning": ("qwen3-reasoning", 0),
}


def prepare_traces(names: list[str], folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    template = ["--template", str(QWEN3_TEMPLATE)]
    paths = {}
    tau = folder / "tau-bench.jsonl"
    if any(TRACES[name] is not None for name in names):
        convert_main(["tau-bench", str(TAU_BENCH_AIRLINE),
                      "--limit", str(TAU_SESSIONS), "--out", str(tau), *template])
    for name in names:
        paths[name] = folder / f"{name}.jsonl"
        if TRACES[name] is None:
            convert_main(["swe-agent", str(SWE_AGENT_TRAJ),
                          "--out", str(paths[name]), *template])
        else:
            emulator, seed = TRACES[name]
            edit_main([str(tau), "--emulator", emulator, "--seed", str(seed), "--out", str(paths[name]), *template])
    return paths


def measure(trace: Path, model: str, out: Path) -> dict:
    started = time.perf_counter()
    results = run_replay(trace, ["semantic"], backend="engine", model=model, out_dir=out, progress=False)
    row = results["policies"]["semantic"]
    exact, engine = row["exactness"], row["engine"]
    return {
        "requests": row["requests"],
        "prompt_tokens": row["prompt_tokens"],
        "restored_tokens": row["cached_tokens"],
        "recomputed_tokens": row["recomputed_tokens"],
        "checkpoints_taken": row["checkpoints_taken"],
        "max_abs_logit_diff": exact["max_abs_logit_diff"],
        "greedy_mismatches": exact["greedy_mismatches"],
        "prefill_s": engine["prefill_s"],
        "prefill_s_uncached": engine["prefill_s_uncached"],
        "wall_s": row["wall_s"],
        "wall_s_uncached": engine["wall_s_uncached"],
        "prefill_speedup": engine["prefill_speedup"],
        "token_ratio": engine["token_ratio"],
        "exact": exact["max_abs_logit_diff"] <= LOGIT_TOLERANCE and exact["greedy_mismatches"] == 0,
        "fast": engine["prefill_speedup"] >= SPEEDUP_FRACTION * engine["token_ratio"],
        "run_s": time.perf_counter() - started,
    }


def plot(path: Path, rows: dict[str, dict[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for model in sorted({m for by_model in rows.values() for m in by_model}):
        points = [(by_model[model]["token_ratio"], by_model[model]["prefill_speedup"])
                  for by_model in rows.values() if model in by_model]
        ax.scatter(*zip(*points), label=model)
    top = max(max(r["token_ratio"], r["prefill_speedup"]) for by_model in rows.values() for r in by_model.values())
    ax.plot([1, top], [1, top], color="grey", lw=0.8, label="speedup = token ratio")
    ax.plot([1, top], [SPEEDUP_FRACTION, SPEEDUP_FRACTION * top], color="grey", lw=0.8, ls="--",
            label=f"{SPEEDUP_FRACTION} x token ratio")
    ax.set_xlabel("prompt tokens / recomputed tokens")
    ax.set_ylabel("measured prefill time uncached / cached")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(TINY_MODELS))
    parser.add_argument("--traces", default=",".join(TRACES))
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    names = [t for t in args.traces.split(",") if t]
    for name in names:
        if name not in TRACES:
            parser.error(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
    torch.set_num_threads(1)
    folder = OUT / "engine_exactness"
    traces = prepare_traces(names, folder / "traces")
    rows: dict[str, dict[str, dict]] = {}
    print(f"{'trace':18s} {'model':19s} {'req':>4s} {'prompt':>7s} {'restored':>8s} {'recomp':>7s} "
          f"{'max|dlogit|':>11s} {'greedy!=':>8s} {'prefill s':>9s} {'uncached':>8s} {'speedup':>7s} "
          f"{'tok ratio':>9s} exact fast")
    for name in names:
        for model in models:
            row = rows.setdefault(name, {})[model] = measure(traces[name], model, folder / f"{name}_{model}")
            print(f"{name:18s} {model:19s} {row['requests']:4d} {row['prompt_tokens']:7d} "
                  f"{row['restored_tokens']:8d} {row['recomputed_tokens']:7d} {row['max_abs_logit_diff']:11.3g} "
                  f"{row['greedy_mismatches']:8d} {row['prefill_s']:9.2f} {row['prefill_s_uncached']:8.2f} "
                  f"{row['prefill_speedup']:7.2f} {row['token_ratio']:9.2f} {row['exact']!s:5s} {row['fast']!s:5s}",
                  flush=True)
    all_rows = [r for by_model in rows.values() for r in by_model.values()]
    summary = {
        "logit_tolerance": LOGIT_TOLERANCE,
        "speedup_fraction_of_token_ratio": SPEEDUP_FRACTION,
        "torch_threads": 1,
        "all_exact": all(r["exact"] for r in all_rows),
        "all_fast": all(r["fast"] for r in all_rows),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in all_rows),
        "runs": rows,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "engine_exactness.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(OUT / "engine_exactness.png", rows)
    print(f"all exact: {summary['all_exact']}, all fast: {summary['all_fast']}")
    print(f"engine_exactness_max_abs_logit_diff: {summary['max_abs_logit_diff']:.3g}")


if __name__ == "__main__":
    main()

"""Prompt tokens per second the `sim` replay backend sustains on the shared agent traces.

One pass serves every peer policy (PEER_POLICIES) at one budget (64 slots) against the shared token tree;
trace conversion (rendering, tokenization) is not timed. Writes results/bench/sim_throughput.json;
the last line printed is `sim_mtok_s: <value>` (million prompt tokens per second, all traces).

    python bench/sim_throughput.py [--mooncake-lines 3000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sglang_hybrid.replay.converters import convert
from sglang_hybrid.replay.cost_model import DEFAULT_PROFILE, get_profile
from sglang_hybrid.replay.policies import PEER_POLICIES
from sglang_hybrid.replay.sim import simulate

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / ".." / "shared" / "data" / "traces"
QWEN3_TEMPLATE = ROOT / ".." / "shared" / "data" / "qwen3.jinja"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mooncake-lines", type=int, default=3000)
    parser.add_argument("--budget-slots", type=int, default=64)
    args = parser.parse_args()
    profile = get_profile(DEFAULT_PROFILE)
    traces = {
        "sweagent-marshmallow-1867": convert("swe-agent", TRACES / "sweagent_marshmallow-1867_fc_last_n_observations.traj",
                                             template_path=str(QWEN3_TEMPLATE)),
        "tau-bench-airline": convert("tau-bench", TRACES / "tau-bench_gpt-4o-airline.json",
                                     template_path=str(QWEN3_TEMPLATE)),
        f"mooncake-conversation-first{args.mooncake_lines}": convert(
            "mooncake", TRACES / "mooncake_fast25_conversation_trace.jsonl", limit=args.mooncake_lines),
    }
    rows = {}
    total_tokens, total_s = 0, 0.0
    for name, trace in traces.items():
        start = time.perf_counter()
        simulate(trace, list(PEER_POLICIES), [args.budget_slots], profile, progress=False)
        seconds = time.perf_counter() - start
        rows[name] = {"requests": len(trace.requests), "prompt_tokens": trace.prompt_tokens, "seconds": seconds,
                      "mtok_s": trace.prompt_tokens / seconds / 1e6}
        total_tokens += trace.prompt_tokens
        total_s += seconds
        print(f"{name:40s} {len(trace.requests):6d} req {trace.prompt_tokens:>12,} tok "
              f"{seconds:7.2f} s  {rows[name]['mtok_s']:.2f} Mtok/s")
    result = {"policies": list(PEER_POLICIES), "budget_slots": args.budget_slots, "profile": profile.name,
              "traces": rows, "sim_mtok_s": total_tokens / total_s / 1e6}
    out = ROOT / "results" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"sim_mtok_s: {result['sim_mtok_s']:.2f}")


if __name__ == "__main__":
    main()

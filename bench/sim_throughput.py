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

from sglang_hybrid.config import DEFAULT_CHECKPOINT_SLOTS
from sglang_hybrid.replay.converters import convert
from sglang_hybrid.replay.cost_model import DEFAULT_PROFILE, get_profile
from sglang_hybrid.replay.policies import PEER_POLICIES
from sglang_hybrid.replay.shared_data import MOONCAKE_CONVERSATIONS, QWEN3_TEMPLATE, REPO_ROOT, SWE_AGENT_TRAJ, TAU_BENCH_AIRLINE
from sglang_hybrid.replay.sim import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mooncake-lines", type=int, default=3000)
    parser.add_argument("--budget-slots", type=int, default=DEFAULT_CHECKPOINT_SLOTS)
    args = parser.parse_args()
    profile = get_profile(DEFAULT_PROFILE)
    traces = {
        "sweagent-marshmallow-1867": convert("swe-agent", SWE_AGENT_TRAJ, template_path=str(QWEN3_TEMPLATE)),
        "tau-bench-airline": convert("tau-bench", TAU_BENCH_AIRLINE, template_path=str(QWEN3_TEMPLATE)),
        f"mooncake-conversation-first{args.mooncake_lines}": convert(
            "mooncake", MOONCAKE_CONVERSATIONS, limit=args.mooncake_lines),
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
    out = REPO_ROOT / "results" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"sim_mtok_s: {result['sim_mtok_s']:.2f}")


if __name__ == "__main__":
    main()

"""What a host-memory checkpoint tier buys the semantic policy when device memory is scarce.

The edit-pattern mix: the first N tau-bench airline sessions under every agent-framework edit
emulator (emulators.EMULATORS, each stream with its own arrival seed, sessions named
`<emulator>/<session>`), plus the SWE-agent trajectory as recorded, rendered with the Qwen3
template and interleaved by arrival time. The semantic policy replays it through the real cache
(sim backend) in three configurations:

  (a) 8 device slots + 256 host slots   (a consumer GPU with a host tier)
  (b) 264 device slots                  (the same number of checkpoints, all in VRAM)
  (c) 8 device slots, no host tier

Per configuration: recomputed prompt tokens, token hit rate, restores from the host tier,
modeled TTFT p50/p99 on `qwen3.5-35b-a3b@rtx4090` (a host restore pays its PCIe copy). Targets
(issue 10): recomputed(a) / recomputed(b) <= 1.2 and TTFT p99(a) < 5 s. Writes
results/bench/host_tier.json and host_tier_ttft_cdf.png; the last line printed is
`host_tier_recompute_ratio: <recomputed(a) / recomputed(b)>`.

    python bench/host_tier.py [--tau-sessions 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from sglang_hybrid.replay.converters import ArrivalModel, convert
from sglang_hybrid.replay.cost_model import get_profile
from sglang_hybrid.replay.emulators import EMULATORS, make_emulator
from sglang_hybrid.replay.report import plot_ttft_cdf
from sglang_hybrid.replay.shared_data import QWEN3_TEMPLATE, REPO_ROOT, SWE_AGENT_TRAJ, TAU_BENCH_AIRLINE
from sglang_hybrid.replay.sim import simulate
from sglang_hybrid.replay.trace import Request, Trace

OUT = REPO_ROOT / "results" / "bench"
PROFILE = "qwen3.5-35b-a3b@rtx4090"
# Label -> (device slots, host slots).
CONFIGS = {
    "8 device + 256 host": (8, 256),
    "264 device": (264, 0),
    "8 device": (8, 0),
}
TIERED, ALL_DEVICE = "8 device + 256 host", "264 device"
RATIO_TARGET = 1.2
P99_TARGET_S = 5.0


def edit_pattern_mix(tau_sessions: int) -> Trace:
    requests: list[Request] = []
    for seed, name in enumerate(EMULATORS):
        trace = convert("tau-bench", TAU_BENCH_AIRLINE, emulator=make_emulator(name), template_path=str(QWEN3_TEMPLATE),
                        limit=tau_sessions, arrival_model=ArrivalModel(seed=seed))
        requests += [dataclasses.replace(r, session=f"{name}/{r.session}") for r in trace.requests]
    requests += convert("swe-agent", SWE_AGENT_TRAJ, template_path=str(QWEN3_TEMPLATE)).requests
    requests.sort(key=lambda r: (r.arrival_s, r.session, r.turn))
    meta = {"tau_bench_sessions_per_emulator": tau_sessions, "emulators": list(EMULATORS),
            "swe_agent": SWE_AGENT_TRAJ.name, "template": QWEN3_TEMPLATE.name}
    return Trace(requests, meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tau-sessions", type=int, default=10, help="tau-bench sessions per emulator")
    args = parser.parse_args()
    if args.tau_sessions < 1:
        parser.error("--tau-sessions must be >= 1")
    profile = get_profile(PROFILE)
    trace = edit_pattern_mix(args.tau_sessions)
    print(f"edit-pattern mix: {len(trace.requests):,} requests, {trace.prompt_tokens:,} prompt tokens; "
          f"profile {profile.name}, host restore {profile.host_restore_s() * 1e3:.2f} ms per checkpoint")
    rows, ttft = {}, {}
    for label, (device, host) in CONFIGS.items():
        started = time.perf_counter()
        stats = simulate(trace, ["semantic"], [device], profile, progress=False, host_slots=host)[device]["semantic"]
        counters = stats.policy.cache.stats
        rows[label] = {
            "device_slots": device,
            "host_slots": host,
            **stats.summary(host_tier=True),
            "demoted": counters.demoted,
            "host_evicted": counters.host_evicted,
            "evicted": counters.evicted,
            "replay_s": time.perf_counter() - started,
        }
        ttft[label] = stats.ttft_s
    base = rows[ALL_DEVICE]["recomputed_tokens"]
    print(f"{'config':22s} {'recomputed tok':>15s} {'vs 264 dev':>10s} {'hit rate':>9s} {'host restores':>14s} "
          f"{'TTFT p50 ms':>12s} {'p99 ms':>9s}")
    for label, row in rows.items():
        row["recomputed_vs_all_device"] = row["recomputed_tokens"] / base
        print(f"{label:22s} {row['recomputed_tokens']:>15,} {row['recomputed_vs_all_device']:>10.3f} "
              f"{row['hit_rate']:>9.3f} {row['host_restores']:>14,} {row['ttft_s']['p50'] * 1e3:>12.1f} "
              f"{row['ttft_s']['p99'] * 1e3:>9.1f}")
    ratio = rows[TIERED]["recomputed_vs_all_device"]
    p99 = rows[TIERED]["ttft_s"]["p99"]
    targets = {"recompute_ratio_max": RATIO_TARGET, "recompute_ratio_met": ratio <= RATIO_TARGET,
               "ttft_p99_s_max": P99_TARGET_S, "ttft_p99_met": p99 < P99_TARGET_S}
    print(f"targets: recompute ratio {ratio:.3f} (<= {RATIO_TARGET}: {'met' if targets['recompute_ratio_met'] else 'MISSED'}), "
          f"TTFT p99 {p99:.3f} s (< {P99_TARGET_S} s: {'met' if targets['ttft_p99_met'] else 'MISSED'})")
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"profile": profile.name, "host_restore_s": profile.host_restore_s(), "trace": trace.meta,
              "requests": len(trace.requests), "prompt_tokens": trace.prompt_tokens, "configs": rows,
              "targets": targets, "host_tier_recompute_ratio": ratio}
    (OUT / "host_tier.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_ttft_cdf(OUT / "host_tier_ttft_cdf.png", ttft)
    print(f"host_tier_recompute_ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()

"""Cost per cache operation: SemanticStateCache vs stock UnifiedRadixCache, side by side.

One recorded operation sequence (admission match with copy-on-write, insert of the finished
request, and a KV eviction every few requests) from real agent traces rendered with the
Qwen3 template: the SWE-agent trajectory and tau-bench sessions, each session's requests in
order. Both caches use the Python tree core and the same pools; each operation is timed on
both, in alternation, so machine noise hits both alike. Requests go through the server's lifecycle
(``RequestLifecycle``); no checkpoints are planned (planner ``none``, no hints), so the two
caches run the same operations; the semantic snapshot is a copy where stock donates a slot.

Writes results/bench/cache_ops.json and cache_ops.png; last line `cache_ops_ratio: <x>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_hybrid.config import DEFAULT_CHECKPOINT_SLOTS, SemanticCacheConfig
from sglang_hybrid.harness.lifecycle import RequestLifecycle
from sglang_hybrid.harness.pools import build_tree_cache, hybrid_pool_spec
from sglang_hybrid.replay.rendering import qwen3_encode, render_chat
from sglang_hybrid.replay.shared_data import QWEN3_TEMPLATE, REPO_ROOT, SWE_AGENT_TRAJ, TAU_BENCH_AIRLINE

OPS = ("match", "insert", "evict")


def recorded_requests(num_tau_sessions: int) -> list[tuple[list[int], list[int]]]:
    requests = []
    traj = json.loads(SWE_AGENT_TRAJ.read_text())
    for step in traj["trajectory"]:
        requests.append(
            (qwen3_encode(render_chat(step["messages"], template_path=QWEN3_TEMPLATE)),
             qwen3_encode(step["response"])[:64])
        )
    runs = json.loads(TAU_BENCH_AIRLINE.read_text())
    for run in runs[:num_tau_sessions]:
        history = run["traj"]
        for i, message in enumerate(history):
            if message["role"] != "assistant" or i == 0:
                continue
            prompt = qwen3_encode(render_chat(history[:i], template_path=QWEN3_TEMPLATE))
            output = qwen3_encode(message.get("content") or "")[:64] or [0]
            requests.append((prompt, output))
    return requests


def lifecycle(backend) -> RequestLifecycle:
    """Six small recurrent layers beside two attention layers, room for every trace token."""
    spec = hybrid_pool_spec(
        recurrent_layers=[0, 1, 2, 4, 5, 6], attention_layers=[3, 7],
        intermediate_size=32, num_heads=2, head_dim=8, state_size=8, conv_kernel=4,
        kv_head_dim=4, kv_size=1 << 19, max_num_reqs=8, max_context_len=1 << 16,
    )  # fmt: skip
    config = SemanticCacheConfig(state_checkpoint_slots=DEFAULT_CHECKPOINT_SLOTS, checkpoint_planner="none")
    return RequestLifecycle(build_tree_cache(backend, spec, config=config))


def run(requests, evict_every: int, repeats: int) -> dict:
    times = {backend: {op: [] for op in OPS} for backend in ("stock", "semantic")}
    for _ in range(repeats):
        drivers = {"stock": lifecycle(None), "semantic": lifecycle("semantic")}
        for n, (prompt, output) in enumerate(requests):
            for backend, driver in drivers.items():
                req = driver.new_request(prompt, output)
                start = time.perf_counter()
                driver.admit(req)
                driver.start([req])
                times[backend]["match"].append(time.perf_counter() - start)
                start = time.perf_counter()
                driver.finish(req)
                times[backend]["insert"].append(time.perf_counter() - start)
                if n % evict_every == evict_every - 1:
                    start = time.perf_counter()
                    driver.cache.evict(EvictParams(num_tokens=len(prompt)))
                    times[backend]["evict"].append(time.perf_counter() - start)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tau-sessions", type=int, default=20)
    parser.add_argument("--evict-every", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench")
    args = parser.parse_args(argv)

    requests = recorded_requests(args.tau_sessions)
    times = run(requests, args.evict_every, args.repeats)
    summary = {"requests": len(requests), "prompt_tokens": sum(len(p) for p, _ in requests)}
    ratios = {}
    for op in OPS:
        stock_us = statistics.mean(times["stock"][op]) * 1e6
        semantic_us = statistics.mean(times["semantic"][op]) * 1e6
        ratios[op] = semantic_us / stock_us
        summary[op] = {"count": len(times["stock"][op]), "stock_us": stock_us,
                       "semantic_us": semantic_us, "ratio": ratios[op]}
        print(f"{op:7s} n={len(times['stock'][op]):5d}  stock {stock_us:9.1f} us  "
              f"semantic {semantic_us:9.1f} us  ratio {ratios[op]:.3f}")
    total_stock = sum(sum(times["stock"][op]) for op in OPS)
    total_semantic = sum(sum(times["semantic"][op]) for op in OPS)
    summary["cache_ops_ratio"] = total_semantic / total_stock
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_ops.json").write_text(json.dumps(summary, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(OPS))
    ax.bar([x - 0.2 for x in xs], [summary[op]["stock_us"] for op in OPS], 0.4, label="stock")
    ax.bar([x + 0.2 for x in xs], [summary[op]["semantic_us"] for op in OPS], 0.4, label="semantic")
    ax.set_xticks(list(xs), OPS)
    ax.set_ylabel("mean time per operation (us)")
    ax.set_title(f"cache operations, {len(requests)} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "cache_ops.png", dpi=120)
    print(f"cache_ops_ratio: {summary['cache_ops_ratio']:.3f}")


if __name__ == "__main__":
    main()

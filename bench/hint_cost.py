"""What client checkpoint hints cost a request on the CPU server.

The documented CPU server (`sglang-hybrid launch --tiny-model qwen3-next`) serves the same
kind of request with and without `checkpoint_hints`, alternating, one at a time: a fresh
100-token prompt each time (its first token differs, so nothing is restored and every
request prefills all of it) and one new token. With hints the request lists 64 positions
spread over the prompt; the planner keeps those at least MIN_CAPTURE_SPACING apart and the
prefill forward writes each kept one into a checkpoint slot. The ratio is the median
end-to-end latency with hints over the median without (target: at most 2). Writes
results/bench/hint_cost.json and hint_cost.png; the last line printed is
`hint_cost_ratio: <ratio>`.

    python bench/hint_cost.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import requests

from cpu_server import tiny_cpu_server
from sglang_hybrid.replay.prometheus import parse_cache_metrics
from sglang_hybrid.replay.shared_data import REPO_ROOT

OUT = REPO_ROOT / "results" / "bench"
PROMPT_TOKENS = 100
HINT_POSITIONS = 64
# The tiny model's vocabulary is 512 ids; stay clear of its special tokens at the top.
TOKEN_RANGE = (1, 400)


def hint_positions(prompt_len: int, count: int) -> list[int]:
    """``count`` distinct positions in [1, prompt_len], spread evenly, ending at the prompt end."""
    return sorted({round(prompt_len * (i + 1) / count) for i in range(count)})


def timed_request(base_url: str, prompt: list[int], hints) -> float:
    params = {"max_new_tokens": 1, "temperature": 0}
    if hints is not None:
        params["custom_params"] = {"checkpoint_hints": hints}
    started = time.perf_counter()
    response = requests.post(f"{base_url}/generate", json={"input_ids": prompt, "sampling_params": params}, timeout=600)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    assert response.json()["meta_info"]["cached_tokens"] == 0, "the prompt was meant to be new"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    positions = hint_positions(PROMPT_TOKENS, HINT_POSITIONS)
    assert len(positions) == HINT_POSITIONS
    latencies: dict[str, list[float]] = {"no hints": [], "64 hints": []}
    with tiny_cpu_server(OUT / "hint_cost_server.log", ["--enable-metrics"]) as (base_url, _):
        for round_index in range(args.rounds + 1):
            for label, hints in (("no hints", None), ("64 hints", positions)):
                prompt = [rng.randint(*TOKEN_RANGE) for _ in range(PROMPT_TOKENS)]
                elapsed = timed_request(base_url, prompt, hints)
                if round_index > 0:  # the first round warms the server up
                    latencies[label].append(elapsed)
        metrics = requests.get(f"{base_url}/metrics", timeout=60).text

    medians = {label: statistics.median(values) for label, values in latencies.items()}
    ratio = medians["64 hints"] / medians["no hints"]
    taken = parse_cache_metrics(metrics)["checkpoints_taken_total"]
    for label, median in medians.items():
        print(f"{label:>9}: median {median * 1000:.0f} ms over {len(latencies[label])} requests")
    print(f"checkpoints taken over the run: {taken:.0f}")
    OUT.mkdir(parents=True, exist_ok=True)
    result = {
        "prompt_tokens": PROMPT_TOKENS,
        "hint_positions": HINT_POSITIONS,
        "rounds": args.rounds,
        "latency_s": latencies,
        "median_s": medians,
        "checkpoints_taken": taken,
        "hint_cost_ratio": ratio,
    }
    (OUT / "hint_cost.json").write_text(json.dumps(result, indent=2))
    plot(latencies, OUT / "hint_cost.png")
    print(f"hint_cost_ratio: {ratio:.3f}")


def plot(latencies: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.boxplot([[1000 * v for v in values] for values in latencies.values()])
    ax.set_xticks(range(1, len(latencies) + 1), list(latencies))
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_title(f"{PROMPT_TOKENS}-token prompt, 1 new token, CPU server")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""Soak: many multi-turn agent requests against the CPU server, watching for leaks.

The documented CPU server (`sglang-hybrid launch --tiny-model qwen3-next`, 64 checkpoint
slots by default) serves `--requests` requests from `--sessions` concurrent agent sessions.
Each session is a seeded loop of calls: the prompt is the previous prompt, the server's reply
and a new tool output; every few turns the session edits its history (masks an old tool
output, as observation-masking agents do) and after `--max-turns` it starts over with a new
system prompt, so the tree keeps growing, branching and evicting. Every 100 requests the
resident memory of each of the server's processes (and their sum) is sampled with the
cache's counters.

Checks, reported (the run fails if one does not hold): 0 request errors; once idle, no live
request-state slot held and no checkpoint slot outside the tree (the server replay's own
accounting, `replay.prometheus.metrics_summary`); the slope of resident memory over the
requests after warm-up (`--warmup`), by least squares, in MiB per 1,000 requests, beside the
spread of the samples around that line. Writes results/bench/soak.json and soak_rss.png;
the last line printed is `soak_rss_slope_mib_per_1k: <slope>`.

    python bench/soak.py [--requests 2000] [--sessions 16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from cpu_server import process_group_rss_mib, tiny_cpu_server
from sglang_hybrid.replay.prometheus import metrics_summary, scrape_cache_metrics
from sglang_hybrid.replay.shared_data import REPO_ROOT

OUT = REPO_ROOT / "results" / "bench"
TOKEN_RANGE = (1, 400)  # clear of the tiny model's special tokens at the top of its 512 ids
SAMPLE_EVERY = 100


class Session:
    """One agent: a token history grown by replies and tool outputs, edited now and then."""

    def __init__(self, name: str, seed: int, max_turns: int):
        self.name = name
        self.rng = random.Random(seed)
        self.max_turns = max_turns
        self.restart()

    def restart(self) -> None:
        self.turn = 0
        self.segments = [self.tokens(self.rng.randint(40, 120))]  # system prompt + task

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randint(*TOKEN_RANGE) for _ in range(n)]

    def prompt(self) -> list[int]:
        return [t for segment in self.segments for t in segment]

    def advance(self, reply: list[int]) -> None:
        self.turn += 1
        if self.turn >= self.max_turns:
            self.restart()
            return
        self.segments += [reply, self.tokens(self.rng.randint(10, 60))]
        if self.turn % 3 == 0 and len(self.segments) > 3:
            # Mask an old tool output: the prompt diverges in its middle.
            masked = self.rng.randrange(2, len(self.segments), 2)
            self.segments[masked] = self.segments[masked][:4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=500, help="requests before the slope is fitted")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sessions = [Session(f"agent-{i}", args.seed * 1000 + i, args.max_turns) for i in range(args.sessions)]
    lock = threading.Lock()
    # sent: requests handed to a session; done: answered (or failed), what samples count.
    counts = {"sent": 0, "done": 0, "errors": 0}
    samples: list[dict] = []
    started = time.monotonic()

    with tiny_cpu_server(OUT / "soak_server.log", ["--enable-metrics"]) as (base_url, process):
        before = scrape_cache_metrics(base_url)

        def run_session(session: Session) -> None:
            while True:
                with lock:
                    if counts["sent"] >= args.requests:
                        return
                    counts["sent"] += 1
                params = {
                    "max_new_tokens": args.new_tokens,
                    "temperature": 0,
                    "custom_params": {"checkpoint_session": session.name},
                }
                try:
                    response = requests.post(
                        f"{base_url}/generate",
                        json={"input_ids": session.prompt(), "sampling_params": params},
                        timeout=600,
                    )
                    response.raise_for_status()
                    reply = response.json()["output_ids"]
                except (requests.RequestException, KeyError, ValueError) as exc:
                    reply = []
                    with lock:
                        counts["errors"] += 1
                    print(f"error in {session.name}: {exc}")
                session.advance(reply)
                with lock:
                    counts["done"] += 1
                    done = counts["done"]
                    if done % SAMPLE_EVERY == 0:
                        rss_by_process = process_group_rss_mib(process)
                        samples.append({
                            "requests": done,
                            "elapsed_s": time.monotonic() - started,
                            "rss_mib": sum(rss_by_process.values()),
                            "rss_mib_by_process": rss_by_process,
                            **scrape_cache_metrics(base_url),
                        })  # fmt: skip
                        print(f"{done:>6} requests  {samples[-1]['elapsed_s']:7.0f} s  rss {samples[-1]['rss_mib']:8.1f} MiB")

        with ThreadPoolExecutor(args.sessions) as pool:
            list(pool.map(run_session, sessions))
        time.sleep(2.0)  # let the last releases reach the gauges
        idle = scrape_cache_metrics(base_url)
        idle_rss = sum(process_group_rss_mib(process).values())

    fitted = [s for s in samples if s["requests"] > args.warmup]
    slope, residual = fit_slope([s["requests"] for s in fitted], [s["rss_mib"] for s in fitted])
    summary = metrics_summary(before, idle)
    checks = {
        "no request errors": counts["errors"] == 0,
        "no live state slot held when idle": summary["leaked_live_slots"] == 0,
        "checkpoint slots in use = checkpoints in the tree": summary["leaked_checkpoint_slots"] == 0,
    }
    result = {
        "requests": counts["sent"],
        "sessions": args.sessions,
        "errors": counts["errors"],
        "wall_s": time.monotonic() - started,
        "samples": samples,
        "idle_metrics": idle,
        "metrics_summary": summary,
        "idle_rss_mib": idle_rss,
        "rss_slope_mib_per_1k_requests": slope,
        "rss_residual_std_mib": residual,
        "checks": checks,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "soak.json").write_text(json.dumps(result, indent=2))
    plot(samples, args.warmup, OUT / "soak_rss.png")
    for name, passed in checks.items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}")
    print(f"requests {counts['sent']}, errors {counts['errors']}, wall {result['wall_s']:.0f} s")
    print(f"checkpoints taken {idle['checkpoints_taken_total']:.0f}, restored {idle['checkpoints_restored_total']:.0f}, "
          f"evicted {idle['checkpoints_evicted_total']:.0f}; token hit rate {idle['token_hit_rate']:.3f}")
    print(f"rss after warm-up: slope {slope:.2f} MiB per 1k requests, residual std {residual:.2f} MiB")
    print(f"soak_rss_slope_mib_per_1k: {slope:.2f}")
    if not all(checks.values()):
        raise SystemExit(1)


def fit_slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys over xs (per 1,000 x) and the std of the residuals."""
    if len(xs) < 2:
        return float("nan"), float("nan")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    residuals = [y - (mean_y + slope * (x - mean_x)) for x, y in zip(xs, ys)]
    return slope * 1000, statistics.pstdev(residuals)


def plot(samples: list[dict], warmup: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["requests"] for s in samples], [s["rss_mib"] for s in samples], marker="o")
    ax.axvline(warmup, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("requests served")
    ax.set_ylabel("server resident memory (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

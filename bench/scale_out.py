"""Scale-out on CPU: a multi-session agent workload through two replicas, with and without
session affinity, behind sglang-router and inside one server with --dp-size 2.

Four configurations of the documented CPU server (`sglang-hybrid launch --tiny-model
qwen3-next`, its default checkpoint pool per replica):

* `router-manual`: two single-rank workers behind `sglang-router --policy manual`; every
  request carries its session as `X-SMG-Routing-Key` (what the replay's server backend and
  the examples send), so the router keeps a session on one worker;
* `router-round-robin`: the same workers behind `--policy round_robin`;
* `dp-session`: one server with `--dp-size 2`; requests name their `checkpoint_session` and no
  rank, so `session_routing.py` sends each session to its replica;
* `dp-round-robin`: the same server with the same requests, each naming its rank in turn
  (`routed_dp_rank`, which wins over the session), as SGLang's default `round_robin` would
  balance them: the planner sees the same sessions, only the routing differs.

The workload is soak.py's agent sessions (`--sessions`, default 8, `--turns` each): every turn
re-sends the history with the server's reply and a new tool output, and every third turn
masks an old tool output (a history edit). Turns go one at a time; each round of turns visits
the sessions in a new seeded order, so a round-robin balancer does not keep a session on one
replica by chance. The two configurations sharing servers run one after the other with a
`/flush_cache` between them and their own session names, the one without affinity second.

Per configuration: prompt tokens, recomputed prompt tokens (after the restored checkpoint),
cached tokens, the turns after a session's first that restored nothing, and each session's
replicas (the data-parallel rank SGLang reports; behind the router a worker is seen only
through its metrics); per replica, the cache's counters over the run by `dp_rank` label (per
worker URL behind the router). Writes results/bench/scale_out.json and .png; fails if a
configuration with affinity moved a session or missed a restore, or the replicas of
`--dp-size 2` do not report their series apart; the last line printed is
`scale_out_recompute_ratio_without_affinity: <value>`, the smaller of the two ratios of
recomputed tokens without affinity to with it.

    python bench/scale_out.py [--sessions 8] [--turns 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import requests

from cpu_server import STARTUP_TIMEOUT_S, tiny_cpu_server
from soak import Session
from sglang_hybrid.anchors.hints import checkpoint_params, session_routing_headers
from sglang_hybrid.harness.server_process import ServerProcess, free_local_port
from sglang_hybrid.metrics import REQUEST_INFO_KEY
from sglang_hybrid.replay.prometheus import cache_metrics_per_label
from sglang_hybrid.replay.shared_data import REPO_ROOT

OUT = REPO_ROOT / "results" / "bench"
REPLICAS = 2
REQUEST_TIMEOUT_S = 600
COUNTERS = ("tokens_restored_total", "tokens_recomputed_total", "checkpoints_restored_total",
            "checkpoints_taken_total", "checkpoints_evicted_total")


def rank_metrics(urls: list[str]) -> dict[str, dict[str, float]]:
    """The cache's counters per replica: per `dp_rank` label of each URL's /metrics, keyed
    `<url> dp_rank=<r>`."""
    found = {}
    for url in urls:
        response = requests.get(f"{url}/metrics", timeout=60)
        response.raise_for_status()
        for rank, values in sorted(cache_metrics_per_label(response.text, "dp_rank").items()):
            found[f"{url} dp_rank={rank}"] = {name: values.get(name, 0.0) for name in COUNTERS}
    return found


def run_sessions(base_url: str, config: str, args, *, headers: bool, name_rank: bool) -> list[dict]:
    """Every turn of every session, one request at a time; returns one record per request."""
    sessions = [Session(f"{config}-agent-{i}", args.seed * 1000 + i, args.turns + 1) for i in range(args.sessions)]
    order = random.Random(args.seed)
    records = []
    for turn in range(args.turns):
        for session in order.sample(sessions, len(sessions)):
            prompt = session.prompt()
            params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True,
                      "custom_params": checkpoint_params(session=session.name)}
            payload = {"input_ids": prompt, "sampling_params": params}
            if name_rank:
                payload["routed_dp_rank"] = len(records) % REPLICAS
            response = requests.post(f"{base_url}/generate", json=payload, timeout=REQUEST_TIMEOUT_S,
                                     headers=session_routing_headers(session.name) if headers else None)
            response.raise_for_status()
            reply = response.json()
            meta = reply["meta_info"]
            report = (meta.get(REQUEST_INFO_KEY) or [{}])[0]
            restored = int(report.get("restored_tokens") or 0)
            records.append({"session": session.name, "turn": turn, "prompt_tokens": len(prompt),
                            "cached_tokens": int(meta.get("cached_tokens", 0)), "restored_tokens": restored,
                            "dp_rank": meta.get("dp_rank")})
            session.advance(reply["output_ids"])
    return records


def summarize(records: list[dict], before: dict, after: dict) -> dict:
    later = [r for r in records if r["turn"] > 0]
    replicas: dict[str, set] = {}
    for r in records:
        replicas.setdefault(r["session"], set()).add(r["dp_rank"])
    return {
        "requests": len(records),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "recomputed_tokens": sum(r["prompt_tokens"] - r["restored_tokens"] for r in records),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "later_turns_without_restore": sum(r["restored_tokens"] == 0 for r in later),
        "later_turns": len(later),
        "replicas_per_session": {s: sorted(map(str, ranks)) for s, ranks in replicas.items()},
        "per_replica": {key: {name: after[key][name] - before.get(key, {}).get(name, 0.0) for name in COUNTERS}
                        for key in after},
        "requests_detail": records,
    }


def measure(config: str, base_url: str, metric_urls: list[str], args, *, headers: bool = False,
            name_rank: bool = False) -> dict:
    for url in metric_urls:
        requests.post(f"{url}/flush_cache", timeout=60).raise_for_status()
    before = rank_metrics(metric_urls)
    started = time.monotonic()
    records = run_sessions(base_url, config, args, headers=headers, name_rank=name_rank)
    time.sleep(2.0)  # the last release reaches the counters
    result = summarize(records, before, rank_metrics(metric_urls))
    result["wall_s"] = time.monotonic() - started
    print(f"{config:>20}: recomputed {result['recomputed_tokens']:,} of {result['prompt_tokens']:,} prompt tokens, "
          f"{result['later_turns_without_restore']}/{result['later_turns']} later turns restored nothing "
          f"({result['wall_s']:.0f} s)", flush=True)
    return result


@contextlib.contextmanager
def router(worker_urls: list[str], policy: str, log_path: Path) -> Iterator[str]:
    port = free_local_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *worker_urls, "--policy", policy]
    process = ServerProcess(command, f"http://127.0.0.1:{port}", log_path=log_path)
    try:
        process.wait_ready(STARTUP_TIMEOUT_S)
        yield process.base_url
    finally:
        process.stop()


def router_configs(args) -> dict[str, dict]:
    results = {}
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(tiny_cpu_server(OUT / f"scale_out_worker{i}.log", ["--enable-metrics"]))[0]
                   for i in range(REPLICAS)]
        for config, policy in (("router-manual", "manual"), ("router-round-robin", "round_robin")):
            with router(workers, policy, OUT / f"scale_out_{config}.log") as url:
                results[config] = measure(config, url, workers, args, headers=True)
    return results


def dp_configs(args) -> dict[str, dict]:
    results = {}
    with tiny_cpu_server(OUT / "scale_out_dp.log", ["--enable-metrics", "--dp-size", str(REPLICAS)]) as (url, _):
        results["dp-session"] = measure("dp-session", url, [url], args)
        results["dp-round-robin"] = measure("dp-round-robin", url, [url], args, name_rank=True)
    return results


def affinity_checks(results: dict[str, dict]) -> dict[str, bool]:
    checks = {}
    for config in ("router-manual", "dp-session"):
        row = results[config]
        checks[f"{config}: every later turn restored"] = row["later_turns_without_restore"] == 0
    checks["dp-session: every session on one replica"] = all(
        len(ranks) == 1 for ranks in results["dp-session"]["replicas_per_session"].values())
    checks["dp-session: metrics per replica"] = len(results["dp-session"]["per_replica"]) == REPLICAS
    return checks


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [results[n]["recomputed_tokens"] for n in names], color=["C0", "C3", "C0", "C3"])
    ax.set_ylabel("recomputed prompt tokens")
    ax.set_title("two replicas: with (blue) and without (red) session affinity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.sessions < 2 or args.turns < 2:
        parser.error("--sessions and --turns must be at least 2")

    OUT.mkdir(parents=True, exist_ok=True)
    results = {**router_configs(args), **dp_configs(args)}
    checks = affinity_checks(results)
    ratios = {
        "router": results["router-round-robin"]["recomputed_tokens"] / results["router-manual"]["recomputed_tokens"],
        "dp": results["dp-round-robin"]["recomputed_tokens"] / results["dp-session"]["recomputed_tokens"],
    }
    (OUT / "scale_out.json").write_text(json.dumps(
        {"sessions": args.sessions, "turns": args.turns, "new_tokens": args.new_tokens, "seed": args.seed,
         "configurations": results, "recompute_ratio_without_affinity": ratios, "checks": checks}, indent=1))
    plot(results, OUT / "scale_out.png")
    for name, passed in checks.items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}")
    print(f"recomputed without / with affinity: router {ratios['router']:.2f}x, dp {ratios['dp']:.2f}x")
    print(f"scale_out_recompute_ratio_without_affinity: {min(ratios.values()):.2f}")
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

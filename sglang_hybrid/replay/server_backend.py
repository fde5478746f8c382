"""Replay backend `server`: a canonical trace against a running SGLang server.

The `sim` and `engine` backends model a cache; this one measures a real one. Every request of
the trace goes to the server at ``--server-url`` (``server_client.py``: order, API, TTFT), and
the report is what the server did: the prefix SGLang reused, the depth our semantic cache
restored from, the first-token and end-to-end times, and the cache's Prometheus series
(``prometheus.py``).

The server generates its own greedy output, so its tree holds prompt + that output, not the
trace's; the next turn's prompt continues it only if the trace was recorded from the same
model. ``compare_with_sim`` therefore runs the simulator's `semantic` policy on the prompts
the server saw with the outputs it generated, in the order it served them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .cost_model import DEFAULT_PROFILE, get_profile
from .policies import drive, make_policy
from .prometheus import metrics_summary, scrape_cache_metrics
from .results import distribution, policy_row, results_envelope, write_json, write_results
from .server_client import ServedRequest, ServerClient, ServerInfo, serve_trace, wait_until_idle
from .trace import Trace

MISMATCHES_IN_REPORT = 50


# ---- against the simulator ----


def _prefix_digest(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int32).tobytes(), digest_size=16).digest()


def compare_with_sim(served: Sequence[ServedRequest], budget_slots: int) -> dict[str, Any]:
    """What the simulator's `semantic` policy predicts for the run the server made.

    The policy replays the prompts the server saw, each with the output the server generated
    (what the server's tree holds), in the order they were sent, under the server's
    checkpoint budget. Where both take the same checkpoints (the server's cache keeps the
    state at request ends and prefill-chunk ends; the policy at request ends and at the
    planner's anchors, prefill chunks of up to 8k tokens aside) every restore depth agrees;
    each disagreement names where the deeper checkpoint came from: a request end, or inside
    a prefill (the planner's anchors, the server's chunk ends). Exact at concurrency 1; with
    more, the server may admit requests in another order than they were sent.
    """
    substituted = [replace(s.request, output_ids=np.asarray(s.output_ids, dtype=np.int32)) for s in served]
    policy = make_policy("semantic", budget_slots, get_profile(DEFAULT_PROFILE))
    request_ends: set[bytes] = set()

    def source(prompt: np.ndarray, depth: int) -> str:
        if depth == 0:
            return "none"
        return "request end" if _prefix_digest(prompt[:depth]) in request_ends else "inside a prefill"

    rows = []
    for (step, (outcome,)), run in zip(drive(substituted, [policy]), served):
        prompt = step.request.input_ids
        server_depth = run.restored_tokens if run.restored_tokens is not None else run.cached_tokens
        rows.append({
            "session": run.request.session,
            "turn": run.request.turn,
            "prompt_tokens": len(prompt),
            "server_restored": server_depth,
            "sim_restored": outcome.restored_depth,
            "server_source": source(prompt, server_depth),
            "sim_source": source(prompt, outcome.restored_depth),
        })
        request_ends.add(_prefix_digest(step.sequence[:step.final_state_depth]))
    mismatches = [row for row in rows if row["server_restored"] != row["sim_restored"]]
    causes: dict[str, int] = {}
    for row in mismatches:
        deeper = "sim" if row["sim_restored"] > row["server_restored"] else "server"
        cause = f"{deeper} restores deeper, from {row[f'{deeper}_source']}"
        causes[cause] = causes.get(cause, 0) + 1
    prompt_tokens = sum(row["prompt_tokens"] for row in rows)
    return {
        "budget_slots": budget_slots,
        "requests": len(rows),
        "requests_agreeing": len(rows) - len(mismatches),
        "server_recomputed_tokens": prompt_tokens - sum(row["server_restored"] for row in rows),
        "sim_recomputed_tokens": prompt_tokens - sum(row["sim_restored"] for row in rows),
        "mismatch_causes": dict(sorted(causes.items())),
        "mismatches": mismatches,
    }


# ---- results ----


def summarize(served: Sequence[ServedRequest], metrics: Optional[dict[str, Any]],
              slots_in_use_before: Optional[float]) -> dict[str, Any]:
    """The server's row of results.json (DESIGN.md's per-policy fields)."""
    prompt_tokens = sum(s.prompt_tokens for s in served)
    cached_tokens = sum(s.cached_tokens for s in served)
    if metrics is None:
        taken = slots_peak = None
    else:
        taken = metrics["counters"]["checkpoints_taken"]
        # The server exports no peak; the pool only shrinks when KV eviction drops
        # checkpoints, so the larger of the two readings is the peak short of that.
        slots_peak = max(int(slots_in_use_before), metrics["idle"]["checkpoint_slots_in_use"])
    return policy_row(
        requests=len(served),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        recomputed_tokens=prompt_tokens - cached_tokens,
        checkpoints_taken=taken,
        checkpoint_slots_peak=slots_peak,
        ttft_s=[s.ttft_s for s in served if s.ttft_s is not None],
    )


def summary_lines(name: str, row: dict[str, Any], server: dict[str, Any]) -> list[str]:
    """The measured figures, for the console and report.md."""
    ttft = row["ttft_s"]
    lines = [
        f"{name} at {server['url']}: {row['requests']} requests ({server['aborted_requests']} aborted), "
        f"{row['cached_tokens']:,} prompt tokens cached, {row['recomputed_tokens']:,} recomputed "
        f"of {row['prompt_tokens']:,} (hit rate {row['hit_rate']:.3f})",
        "  TTFT " + (f"mean {ttft['mean'] * 1e3:.1f} ms, p50 {ttft['p50'] * 1e3:.1f}, p95 {ttft['p95'] * 1e3:.1f}"
                     if ttft else "n/a (no request produced a token)")
        + f"; wall {server['wall_s']:.1f} s at concurrency {server['concurrency']}",
    ]
    metrics = server["metrics"]
    if metrics is not None:
        counters, idle = metrics["counters"], metrics["idle"]
        lines.append(
            f"  checkpoints taken {counters['checkpoints_taken']}, restored {counters['checkpoints_restored']}, "
            f"evicted {counters['checkpoints_evicted']}; idle: live slots {idle['live_state_slots_in_use']}/"
            f"{idle['live_state_slots_capacity']} in use, checkpoint slots {idle['checkpoint_slots_in_use']}/"
            f"{idle['checkpoint_slots_capacity']} (tree holds {metrics['tree_checkpoints']})"
        )
    comparison = server["sim_comparison"]
    if comparison is not None:
        lines.append(
            f"  sim `semantic` on the served outputs: recomputes {comparison['sim_recomputed_tokens']:,} "
            f"vs server {comparison['server_recomputed_tokens']:,}; {comparison['requests_agreeing']}/"
            f"{comparison['requests']} requests restore at the same depth"
        )
    return lines


def _report(trace_name: str, name: str, row: dict[str, Any], server: dict[str, Any]) -> str:
    lines = [f"# Server replay: {trace_name}", "",
             f"Measured on the server (cache backend `{name}`); the cost profile is unused.", ""]
    lines += [f"- {line.strip()}" for line in summary_lines(name, row, server)]
    comparison = server["sim_comparison"]
    if comparison is not None:
        lines += [
            "", "## Against the simulator", "",
            f"The `semantic` policy replayed on the prompts the server saw, with the outputs it generated, "
            f"in its order, under its budget of {comparison['budget_slots']} checkpoint slots. Where both "
            "take the same checkpoints the depths agree; each disagreement below names where the deeper "
            "side's checkpoint was taken.", "",
        ]
        if not comparison["mismatches"]:
            lines.append(f"All {comparison['requests']} requests restore at the same depth on both.")
        lines += [f"- {cause}: {count} requests" for cause, count in comparison["mismatch_causes"].items()]
        shown = comparison["mismatches"][:MISMATCHES_IN_REPORT]
        if shown:
            lines += ["", "| session | turn | prompt tok | server restored | from | sim restored | from |",
                      "|---|---:|---:|---:|---|---:|---|"]
            lines += [f"| {r['session']} | {r['turn']} | {r['prompt_tokens']} | {r['server_restored']} | "
                      f"{r['server_source']} | {r['sim_restored']} | {r['sim_source']} |" for r in shown]
    lines += ["", "![measured TTFT CDF](ttft_cdf.png)", ""]
    return "\n".join(lines)


def server_replay(trace: Trace, *, server_url: str, out_dir: str | Path, trace_name: str, profile: str,
                  concurrency: int = 1, progress: bool = True, rid_prefix: Optional[str] = None,
                  abort_after_tokens: Optional[Mapping[tuple[str, int], int]] = None) -> dict[str, Any]:
    """Replay ``trace`` against the server at ``server_url``; write results.json,
    server_requests.json (per request), report.md and ttft_cdf.png into ``out_dir``.

    ``abort_after_tokens``: (session, turn) -> output tokens after which the replay aborts
    that request through the server's /abort_request (fault injection).
    """
    from .report import plot_ttft_cdf

    url = server_url.rstrip("/")
    info = ServerInfo.fetch(url)
    before = scrape_cache_metrics(url)
    started = time.monotonic()
    served = serve_trace(trace, ServerClient(info, rid_prefix, abort_after_tokens),
                         concurrency=concurrency, progress=progress)
    wall_s = time.monotonic() - started
    wait_until_idle(url)
    idle = scrape_cache_metrics(url) if before is not None else None
    metrics = metrics_summary(before, idle) if idle is not None else None
    comparison = None
    if info.cache_backend == "semantic" and metrics is not None:
        comparison = compare_with_sim(served, metrics["idle"]["checkpoint_slots_capacity"])
    row = summarize(served, metrics, before["checkpoint_slots_in_use"] if before else None)
    server = {
        "url": url,
        "cache_backend": info.cache_backend,
        "concurrency": concurrency,
        "wall_s": wall_s,
        "aborted_requests": sum(s.aborted for s in served),
        "output_tokens": sum(len(s.output_ids) for s in served),
        "e2e_s": distribution([s.e2e_s for s in served]),
        "metrics": metrics,
        "sim_comparison": comparison,
    }
    results = results_envelope(
        trace=trace_name, backend="server", profile=profile,
        budget_slots=metrics["idle"]["checkpoint_slots_capacity"] if metrics else None,
        policies={info.cache_backend: row}, server=server,
    )
    out = write_results(out_dir, results)
    write_json(out / "server_requests.json", [s.to_json() for s in served], indent=1)
    plot_ttft_cdf(out / "ttft_cdf.png", {info.cache_backend: [s.ttft_s for s in served if s.ttft_s is not None]},
                  xlabel="TTFT (ms, measured)")
    (out / "report.md").write_text(_report(trace_name, info.cache_backend, row, server))
    return results

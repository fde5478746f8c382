"""Replay backend `server`: a canonical trace against a running SGLang server.

The `sim` and `engine` backends model a cache; this one measures a real one. Every request of
the trace goes to the server at ``--server-url``, and the report is what the server did: the
prefix SGLang reused, the depth our semantic cache restored from, the first-token and
end-to-end times, and the cache's Prometheus series.

API: the native ``POST /generate`` with ``input_ids`` and ``stream``. Only the native response
carries ``meta_info``, where SGLang reports ``cached_tokens`` and the semantic cache its
restore (``meta_info["semantic_cache"]``, see ``metrics.record_request_restore``). The
OpenAI-compatible ``/v1/completions`` takes token-id prompts, but its response reduces
``meta_info`` to usage counts (our report is lost), and under ``--skip-tokenizer-init`` (a
model served without a tokenizer, as the tests' tiny one) SGLang 0.5.23 answers it with HTTP
500 (``'text'``: it builds the response from detokenized text). Sampling is greedy
(temperature 0) with ``ignore_eos``, for as many tokens as the trace's output (at least one).

Order: requests are sent in arrival order; a request waits for its session's previous one
(an agent sends its next turn once it has the answer) and at most ``concurrency`` are in
flight. With concurrency 1 that is the simulator's order, one request at a time. Arrival
times are not waited out: the replay measures the cache and the TTFT of a request on a
server otherwise idle (as the cost model prices it), not queueing.

TTFT is the time to the first streamed chunk that carries an output token (SGLang streams
each token as it is sampled; the first one ends the prefill). A request that comes back
aborted (``/abort_request``, a server-side limit) is recorded with what it produced, and the
replay goes on.

The server generates its own greedy output, so its tree holds prompt + that output, not the
trace's; the next turn's prompt continues it only if the trace was recorded from the same
model. ``compare_with_sim`` therefore runs the simulator's `semantic` policy on the prompts
the server saw with the outputs it generated, in the order it served them.

Server metrics (``--enable-metrics``): the cache's series are read before and after the run.
results.json carries the counters' increments over the run and, once the server is idle, its
gauges: live state slots in use (0 unless a request leaked its slot) and checkpoint slots in
use, which must equal the checkpoints the tree holds (taken - evicted - dropped with their KV,
counted since the server started, so a ``/flush_cache`` in between breaks it; without a host
tier, whose demotions move checkpoints off the device pool).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import requests
from tqdm import tqdm

from ..metrics import COUNTERS, METRIC_PREFIX, REQUEST_INFO_KEY
from ..anchors.hints import checkpoint_params
from .cost_model import DEFAULT_PROFILE, get_profile
from .policies import drive, make_policy
from .report import distribution
from .trace import Request, Trace

CONNECT_TIMEOUT_S = 10.0
# Between two streamed chunks; a CPU server under load can take long over a prefill.
READ_TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 60.0
PROGRESS_MIN_REQUESTS = 50
MISMATCHES_IN_REPORT = 50

# Gauges of metrics.CheckpointMetricsCollector, by their series name without the prefix.
GAUGES = (
    "checkpoint_slots_in_use",
    "checkpoint_slots_capacity",
    "live_state_slots_in_use",
    "live_state_slots_capacity",
)


class ServerReplayError(RuntimeError):
    """The server refused a request or broke off its stream (an abort is not an error)."""


@dataclass(frozen=True)
class ServerInfo:
    url: str
    # The row name: --radix-cache-backend; SGLang's own cache named as the simulator's policy
    # for it (sglang-no-buffer, sglang-extra-buffer); "none" with --disable-radix-cache.
    cache_backend: str
    incremental_output: bool  # streamed output_ids are deltas, not the output so far

    @classmethod
    def fetch(cls, url: str) -> "ServerInfo":
        try:
            response = requests.get(f"{url}/server_info", timeout=(CONNECT_TIMEOUT_S, 60))
            response.raise_for_status()
        except requests.RequestException as error:
            raise ServerReplayError(f"no SGLang server answers at {url}: {error}") from None
        info = response.json()
        if info["disable_radix_cache"]:
            backend = "none"
        elif info["radix_cache_backend"] is None:
            backend = "sglang-" + info["mamba_radix_cache_strategy"].replace("_", "-")
        else:
            backend = info["radix_cache_backend"]
        return cls(url, backend, bool(info["incremental_streaming_output"]))


@dataclass(frozen=True)
class ServedRequest:
    """One trace request as the server answered it."""

    request: Request
    rid: str
    sent_s: float  # since the replay started
    output_ids: tuple[int, ...]
    finish_reason: str  # SGLang's finish_reason type: length, stop, abort
    cached_tokens: int  # SGLang's: prompt tokens whose prefill was skipped
    restored_tokens: Optional[int]  # the semantic cache's restore depth; None from other caches
    kv_hit_tokens: Optional[int]  # prompt tokens the tree's KV held (semantic cache only)
    ttft_s: Optional[float]  # None when no output token came back (aborted before it)
    e2e_s: float

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.input_ids)

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.request.session,
            "turn": self.request.turn,
            "rid": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "restored_tokens": self.restored_tokens,
            "kv_hit_tokens": self.kv_hit_tokens,
            "finish_reason": self.finish_reason,
            "output_ids": list(self.output_ids),
            "sent_s": self.sent_s,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
        }


def _stream_events(response: requests.Response):
    """The JSON objects of an SGLang server-sent-event stream, up to ``[DONE]``."""
    for line in response.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            return
        yield json.loads(data)


class ServerClient:
    """Sends trace requests to one server and reads their streams back."""

    def __init__(self, info: ServerInfo, rid_prefix: Optional[str] = None,
                 abort_after_tokens: Optional[Mapping[tuple[str, int], int]] = None):
        self.info = info
        self.rid_prefix = rid_prefix or f"replay-{uuid.uuid4().hex[:12]}"
        # (session, turn) -> output tokens after which the replay aborts that request itself
        # through /abort_request, to check that a cache survives aborts mid-generation.
        self.abort_after_tokens = dict(abort_after_tokens or {})

    def serve(self, index: int, request: Request, started: float) -> ServedRequest:
        rid = f"{self.rid_prefix}-{index}"
        # The trace's session and anchor hints, as the simulator's `semantic` policy has them.
        payload = {
            "rid": rid,
            "input_ids": request.input_ids.tolist(),
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": max(1, len(request.output_ids)),
                "ignore_eos": True,
                "custom_params": checkpoint_params(list(request.anchors or ()) or None, request.session),
            },
            "stream": True,
        }
        abort_at = self.abort_after_tokens.get((request.session, request.turn))
        where = f"request {index} (session {request.session!r}, turn {request.turn})"
        sent = time.monotonic()
        output: list[int] = []
        ttft_s = None
        last: Optional[dict] = None
        abort_sent = False
        with requests.post(f"{self.info.url}/generate", json=payload, stream=True,
                           timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) as response:
            if response.status_code != 200:
                raise ServerReplayError(f"{where}: HTTP {response.status_code}: {response.text[:500]}")
            for event in _stream_events(response):
                if "error" in event:
                    raise ServerReplayError(f"{where}: the server refused it: {event['error']}")
                chunk = event.get("output_ids") or []
                output = output + chunk if self.info.incremental_output else list(chunk)
                if ttft_s is None and output:
                    ttft_s = time.monotonic() - sent
                if abort_at is not None and not abort_sent and len(output) >= abort_at:
                    requests.post(f"{self.info.url}/abort_request", json={"rid": rid},
                                  timeout=(CONNECT_TIMEOUT_S, 60)).raise_for_status()
                    abort_sent = True
                last = event
        e2e_s = time.monotonic() - sent
        if last is None or not last.get("meta_info", {}).get("finish_reason"):
            raise ServerReplayError(f"{where}: the stream ended before the request finished")
        meta = last["meta_info"]
        # One report per request: the first admission's (metrics.record_request_restore).
        report = (meta.get(REQUEST_INFO_KEY) or [{}])[0]
        return ServedRequest(
            request=request,
            rid=rid,
            sent_s=sent - started,
            output_ids=tuple(output),
            finish_reason=meta["finish_reason"]["type"],
            cached_tokens=int(meta.get("cached_tokens", 0)),
            restored_tokens=report.get("restored_tokens"),
            kv_hit_tokens=report.get("kv_hit_tokens"),
            ttft_s=ttft_s,
            e2e_s=e2e_s,
        )


def serve_trace(trace: Trace, client: ServerClient, *, concurrency: int = 1,
                progress: bool = True) -> list[ServedRequest]:
    """Send every request of ``trace`` (see the module docstring for the order); returns them
    in the order they were sent."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    ordered = sorted(trace.requests, key=lambda r: r.arrival_s)
    started = time.monotonic()
    bar = tqdm(total=len(ordered), unit="req", desc="server replay",
               disable=not progress or len(ordered) < PROGRESS_MIN_REQUESTS)

    def serve_after(previous: Optional[Future], index: int, request: Request) -> ServedRequest:
        if previous is not None:
            previous.result()
        served = client.serve(index, request, started)
        bar.update()
        return served

    # The executor starts tasks in submission order, so a session's previous request has
    # always started before the request waiting on it: the wait cannot deadlock.
    last_of_session: dict[str, Future] = {}
    futures = []
    with ThreadPoolExecutor(max_workers=concurrency) as executor:
        for index, request in enumerate(ordered):
            future = executor.submit(serve_after, last_of_session.get(request.session), index, request)
            last_of_session[request.session] = future
            futures.append(future)
        try:
            served = [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            bar.close()
    return sorted(served, key=lambda s: s.sent_s)


# ---- server metrics ----


def parse_cache_metrics(text: str) -> dict[str, float]:
    """The semantic cache's series in a Prometheus text exposition, by name without the
    ``sglang:semantic_`` prefix (counters keep ``_total``), each summed over its label sets
    (one per scheduler rank). Empty when the server exports none of them."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(METRIC_PREFIX) and not sample.name.endswith("_created"):
                name = sample.name[len(METRIC_PREFIX):]
                values[name] = values.get(name, 0.0) + sample.value
    return values


def scrape_cache_metrics(url: str) -> Optional[dict[str, float]]:
    """The cache's series from ``url``/metrics; None when the server exports none (started
    without ``--enable-metrics``, or serving another cache)."""
    response = requests.get(f"{url}/metrics", timeout=(CONNECT_TIMEOUT_S, 60))
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return parse_cache_metrics(response.text) or None


def wait_until_idle(url: str, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Block until no request runs or waits on the server (its pools at their idle value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = requests.get(f"{url}/v1/loads", timeout=(CONNECT_TIMEOUT_S, 60)).json()["loads"]
        if all(load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 for load in loads):
            return
        if time.monotonic() > deadline:
            raise ServerReplayError(f"server at {url} still busy {timeout_s:.0f} s after the replay")
        time.sleep(0.2)


def metrics_summary(before: Mapping[str, float], idle: Mapping[str, float]) -> dict[str, Any]:
    """The ``server.metrics`` block: counter increments over the run, the idle gauges, and
    the slot accounting a leak would break."""
    counters = {name: int(idle[f"{name}_total"] - before[f"{name}_total"]) for name, _ in COUNTERS.values()}
    gauges = {name: int(idle[name]) for name in GAUGES}

    def total(stat: str) -> int:
        return int(idle[f"{COUNTERS[stat][0]}_total"])

    # Without a host tier a checkpoint leaves the device pool only by eviction or with its
    # node's KV; demotions (and promotions back) would need device-only drop counts.
    host_tier_used = total("demoted") > 0
    tree_checkpoints = None if host_tier_used else total("taken") - total("evicted") - total("dropped_with_kv")
    return {
        "counters": counters,
        "idle": gauges,
        "tree_checkpoints": tree_checkpoints,
        "leaked_checkpoint_slots": None if tree_checkpoints is None
        else gauges["checkpoint_slots_in_use"] - tree_checkpoints,
        "leaked_live_slots": gauges["live_state_slots_in_use"],
    }


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
    return {
        "requests": len(served),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "recomputed_tokens": prompt_tokens - cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "checkpoints_taken": taken,
        "checkpoint_slots_peak": slots_peak,
        "ttft_s": distribution([s.ttft_s for s in served if s.ttft_s is not None]),
    }


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
    results = {
        "trace": trace_name,
        "backend": "server",
        "profile": profile,
        "budget_slots": metrics["idle"]["checkpoint_slots_capacity"] if metrics else None,
        "policies": {info.cache_backend: row},
        "server": server,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "server_requests.json").write_text(json.dumps([s.to_json() for s in served], indent=1) + "\n")
    plot_ttft_cdf(out / "ttft_cdf.png", {info.cache_backend: [s.ttft_s for s in served if s.ttft_s is not None]},
                  xlabel="TTFT (ms, measured)")
    (out / "report.md").write_text(_report(trace_name, info.cache_backend, row, server))
    return results

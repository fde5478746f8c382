"""The HTTP client of the server replay: trace requests to a running SGLang server.

API: the native ``POST /generate`` with ``input_ids`` and ``stream``. Only the native response
carries ``meta_info``, where SGLang reports ``cached_tokens`` and the semantic cache its
restore (``meta_info["semantic_cache"]``, see ``metrics.record_request_restore``). The
OpenAI-compatible ``/v1/completions`` takes token-id prompts, but its response reduces
``meta_info`` to usage counts (our report is lost), and under ``--skip-tokenizer-init`` (a
model served without a tokenizer, as the tests' tiny one) SGLang 0.5.23 answers it with HTTP
500 (``'text'``: it builds the response from detokenized text). Sampling is greedy
(temperature 0) with ``ignore_eos``, for as many tokens as the trace's output (at least one);
the trace's session and anchor hints travel as a client sends them (``checkpoint_params``),
and the session also as ``X-SMG-Routing-Key``, so that ``sglang-router --policy manual``
in front of several workers keeps it on one (``session_routing_headers``).

Order: requests are sent in arrival order; a request waits for its session's previous one
(an agent sends its next turn once it has the answer) and at most ``concurrency`` are in
flight. With concurrency 1 that is the simulator's order, one request at a time. Arrival
times are not waited out: the replay measures the cache and the TTFT of a request on a
server otherwise idle (as the cost model prices it), not queueing.

TTFT is the time to the first streamed chunk that carries an output token (SGLang streams
each token as it is sampled; the first one ends the prefill). A request that comes back
aborted (``/abort_request``, a server-side limit) is recorded with what it produced, and the
replay goes on.
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import requests
from tqdm import tqdm

from ..anchors.hints import checkpoint_params, session_routing_headers
from ..metrics import REQUEST_INFO_KEY
from .trace import Request, Trace

CONNECT_TIMEOUT_S = 10.0
# Between two streamed chunks; a CPU server under load can take long over a prefill.
READ_TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 60.0
PROGRESS_MIN_REQUESTS = 50


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
                           headers=session_routing_headers(request.session),
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

"""Prometheus series of the semantic state cache, on SGLang's own ``/metrics`` endpoint.

SGLang runs prometheus_client in multiprocess mode: the HTTP process sets
``PROMETHEUS_MULTIPROC_DIR`` before any scheduler starts, each scheduler process writes its
series into that directory, and ``/metrics`` aggregates the files. Collectors built inside
a scheduler therefore appear on the endpoint with no wiring of their own, which is how
SGLang's ``RadixCacheMetricsCollector`` reaches it; ours is built the same way, next to
that collector, with the same labels (``cache_type``, ``tp_rank``, ``pp_rank``,
``dp_rank`` and ``--extra-metric-labels``), so every rank reports its own pool.

The cache keeps cumulative ``CheckpointStats`` counters; ``observe`` turns them into
Prometheus increments (the difference since the previous call) and sets the slot gauges,
so it may be called as often as convenient.

Per request, the response's ``meta_info`` carries ``semantic_cache`` beside SGLang's
``cached_tokens``. It travels on SGLang's own channel for per-request extras,
``Req.customized_info``: ``RequestRestoreReport`` writes it when the cache matches the request
for admission (``record_request_restore``), and ``SemanticOutputStreamer`` tells SGLang's
output path to send it once per request rather than sliced per output token.

Both subscribe to the cache (``subscribe_metrics``, called by the backend factory); the cache
knows nothing of them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
from sglang.srt.observability.metrics_collector import _StatLoggerDIMixin
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_hybrid.cache.stats import CheckpointObserver

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

    from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool
    from sglang_hybrid.cache.semantic_cache import SemanticStateCache
    from sglang_hybrid.cache.stats import CheckpointStats

logger = logging.getLogger(__name__)

METRIC_PREFIX = "sglang:semantic_"

# CheckpointStats counter -> (series name without prefix and _total, documentation).
COUNTERS: dict[str, tuple[str, str]] = {
    "taken": (
        "checkpoints_taken",
        "Recurrent-state checkpoints attached to the radix tree.",
    ),
    "restored": (
        "checkpoints_restored",
        "Requests whose prefill started from a cached checkpoint.",
    ),
    "evicted": (
        "checkpoints_evicted",
        "Device checkpoints evicted with no host copy kept (their KV stays cached).",
    ),
    "dropped_with_kv": (
        "checkpoints_dropped_with_kv",
        "Checkpoints dropped because the KV of their tree node was evicted.",
    ),
    "demoted": (
        "checkpoints_demoted",
        "Device checkpoints moved to the host tier instead of being dropped.",
    ),
    "promoted": (
        "checkpoints_promoted",
        "Host-tier checkpoints copied back to the device pool for a restore.",
    ),
    "host_evicted": (
        "host_checkpoints_evicted",
        "Host-tier checkpoints dropped to make room in the host tier.",
    ),
    "restored_from_host": (
        "checkpoints_restored_from_host",
        "Restores whose checkpoint came from the host tier.",
    ),
    "exhausted": (
        "checkpoints_skipped_pool_full",
        "Checkpoints not taken because every slot was held by a request in flight.",
    ),
    "tokens_restored": (
        "tokens_restored",
        "Prompt tokens whose prefill a checkpoint restore skipped.",
    ),
    "tokens_recomputed": (
        "tokens_recomputed",
        "Prompt tokens admitted requests had to prefill after their restore point.",
    ),
}


def replica_labels(radix_cache_labels: dict[str, object]) -> dict[str, object]:
    """The labels of SGLang's radix-cache collector, with this scheduler's data-parallel
    replica as ``dp_rank``: SGLang labels its radix-cache series ``dp_rank=0`` on every
    replica unless DP attention is on (``radix_cache_metric_labels``), so ``/metrics`` would
    sum the replicas' pools, and each replica's pool is its own."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    labels = dict(radix_cache_labels)
    replica = get_parallel().dp_rank
    if replica is not None and not is_dp_attention_enabled():
        labels["dp_rank"] = replica
    return labels


class CheckpointMetricsCollector(CheckpointObserver, _StatLoggerDIMixin):
    """Counters and slot gauges of one scheduler rank's ``SemanticStateCache``.

    Like SGLang's collectors it honours the ``_counter_cls`` / ``_gauge_cls`` overrides of
    ``_StatLoggerDIMixin`` (Ray-backed metrics), and registers in prometheus_client's
    default registry unless given one.
    """

    def __init__(
        self,
        labels: dict[str, object],
        registry: Optional["CollectorRegistry"] = None,
        live_allocator: Optional["MambaSlotAllocator"] = None,
    ):
        # Imported here, as SGLang does, so PROMETHEUS_MULTIPROC_DIR is set by then.
        from prometheus_client import Counter as _PromCounter
        from prometheus_client import Gauge as _PromGauge

        Counter = self._counter_cls or _PromCounter
        Gauge = self._gauge_cls or _PromGauge
        placement = {} if registry is None else {"registry": registry}

        self.labels = dict(labels)
        # SGLang's allocator of live (per-request) state slots, req_to_token_pool's
        # mamba_allocator; without it the live-slot gauges stay at 0.
        self.live_allocator = live_allocator
        label_names = list(self.labels)
        self.counters = {
            stat: Counter(
                name=f"{METRIC_PREFIX}{name}_total",
                documentation=documentation,
                labelnames=label_names,
                **placement,
            )
            for stat, (name, documentation) in COUNTERS.items()
        }
        def gauge(name: str, documentation: str) -> "Gauge":
            # "mostrecent": a gauge is one rank's current value, not to be summed across the
            # processes that ever wrote it.
            return Gauge(
                name=f"{METRIC_PREFIX}{name}",
                documentation=documentation,
                labelnames=label_names,
                multiprocess_mode="mostrecent",
                **placement,
            )

        self.slots_in_use = gauge(
            "checkpoint_slots_in_use",
            "Checkpoint slots holding a state (in the tree or staged by a request in flight).",
        )
        self.slots_capacity = gauge(
            "checkpoint_slots_capacity",
            "Checkpoint slots in the pool (--state-checkpoint-slots or "
            "--state-checkpoint-memory-gib).",
        )
        # The live (per-request) state slots beside the checkpoint slots: a request holds
        # one while it runs, so on an idle server the count in use is 0 unless one leaked.
        self.live_slots_in_use = gauge(
            "live_state_slots_in_use",
            "Live recurrent-state slots held by requests (SGLang's req_to_token_pool mamba "
            "pool); 0 on an idle server.",
        )
        self.live_slots_capacity = gauge(
            "live_state_slots_capacity",
            "Live recurrent-state slots in SGLang's request pool (--max-mamba-cache-size).",
        )
        # SGLang's sglang:cache_hit_rate is the hit rate of the last prefill batch it logged
        # and holds that value until the next one; this one covers every request so far.
        self.token_hit_rate = gauge(
            "token_hit_rate",
            "Fraction of all admitted prompt tokens whose prefill a checkpoint restore "
            "skipped, since the server started (tokens_restored / (tokens_restored + "
            "tokens_recomputed)); updated at every admission.",
        )
        self._reported = {stat: 0 for stat in COUNTERS}
        # Create each labelled series now, so a rank exports its zeros from the first
        # scrape: rate() and absent() then see the series before its first event.
        for metric in (
            *self.counters.values(),
            self.slots_in_use,
            self.slots_capacity,
            self.live_slots_in_use,
            self.live_slots_capacity,
            self.token_hit_rate,
        ):
            metric.labels(**self.labels)

    @classmethod
    def for_cache(cls, cache: "SemanticStateCache") -> Optional["CheckpointMetricsCollector"]:
        """A collector labelled like ``cache``'s own radix-cache collector, reading the
        live slots of ``cache``'s request pool; None when the server runs without
        ``--enable-metrics`` (SGLang then builds none either)."""
        if cache.metrics_collector is None:
            return None
        return cls(
            labels=replica_labels(cache.metrics_collector.labels),
            live_allocator=cache.req_to_token_pool.mamba_allocator,
        )

    def observe(self, stats: "CheckpointStats", pool: "StateCheckpointPool") -> None:
        """Publish ``stats`` (cumulative), the checkpoint pool's occupancy and the live
        slots in use.

        The gauges hold the value of the last call: the cache calls this on every match,
        insert, release and eviction, and SGLang frees a finished request's live slot
        inside the release, so after the last request the live gauge reads the idle pool.
        """
        for stat, counter in self.counters.items():
            value = getattr(stats, stat)
            previous = self._reported[stat]
            # A value below the last one reported means the stats were started afresh;
            # Prometheus counters only grow, so all of the new count is an increment.
            increment = value - previous if value >= previous else value
            if increment > 0:
                counter.labels(**self.labels).inc(increment)
            self._reported[stat] = value
        admitted = stats.tokens_restored + stats.tokens_recomputed
        if admitted:
            self.token_hit_rate.labels(**self.labels).set(stats.tokens_restored / admitted)
        self.slots_in_use.labels(**self.labels).set(pool.used_size())
        self.slots_capacity.labels(**self.labels).set(pool.num_slots)
        if self.live_allocator is not None:
            live = self.live_allocator
            self.live_slots_in_use.labels(**self.labels).set(live.size - live.available_size())
            self.live_slots_capacity.labels(**self.labels).set(live.size)

    def cache_changed(self, stats: "CheckpointStats", pool: "StateCheckpointPool") -> None:
        self.observe(stats, pool)


# ---- per-request restore report in meta_info ----

REQUEST_INFO_KEY = "semantic_cache"
OUTPUT_STREAMER_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class"


def record_request_restore(req: "Req", restored_tokens: int, kv_hit_tokens: int) -> None:
    """Note what the admission match of ``req`` found, for its response's meta_info.

    ``restored_tokens``: depth of the checkpoint the request starts from (0: none), the
    prompt tokens it skips; ``kv_hit_tokens``: how much of its prompt the tree's KV held.
    The difference is prefill spent only because no checkpoint sat deeper. The first
    admission is the one reported: a retracted request re-admitted later recomputes, but
    SGLang's ``cached_tokens`` keeps its first value too.
    """
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info.setdefault(
        REQUEST_INFO_KEY,
        [{"restored_tokens": int(restored_tokens), "kv_hit_tokens": int(kv_hit_tokens)}],
    )


class RequestRestoreReport(CheckpointObserver):
    """Writes each admitted request's restore into its meta_info report."""

    def request_matched(self, req: "Req", restored_tokens: int, kv_hit_tokens: int) -> None:
        record_request_restore(req, restored_tokens, kv_hit_tokens)


def subscribe_metrics(cache: "SemanticStateCache") -> None:
    """Subscribe the per-request report and, with ``--enable-metrics``, the Prometheus
    collector to ``cache``."""
    cache.subscribe(RequestRestoreReport())
    collector = CheckpointMetricsCollector.for_cache(cache)
    if collector is not None:
        cache.subscribe(collector)


class SemanticOutputStreamer(SchedulerOutputStreamer):
    """SGLang's output streamer, sending our per-request report once per request."""

    __slots__ = ()

    def is_request_level_customized_info_key(self, key: str) -> bool:
        return key == REQUEST_INFO_KEY or super().is_request_level_customized_info_key(key)


def _output_streamer_class(original, scheduler: "Scheduler") -> type:
    streamer_class = original(scheduler)
    if streamer_class is SchedulerOutputStreamer:
        return SemanticOutputStreamer
    # Another extension chose its own streamer; replacing it would drop that extension's
    # behaviour. The report then follows SGLang's per-output-token slicing, which can leave
    # it out of some streamed chunks.
    logger.warning(
        "output streamer %s is not SGLang's default; meta_info[%r] may be incomplete",
        streamer_class.__name__,
        REQUEST_INFO_KEY,
    )
    return streamer_class


def install_request_info_hook() -> None:
    """Register, in this process, the hook that makes schedulers use
    ``SemanticOutputStreamer``; effective once SGLang's ``load_plugins`` applies hooks."""
    HookRegistry.register(OUTPUT_STREAMER_TARGET, _output_streamer_class, HookType.AROUND)

"""The semantic cache's Prometheus series and per-request meta_info report.

Stats come from the real ``SemanticStateCache`` serving requests through SGLang's request
path (``cache_fixtures``); series are read back from prometheus_client, and in
multiprocess mode through SGLang's own ``/metrics`` route (``add_prometheus_middleware``).
"""

from __future__ import annotations

import pkgutil
from dataclasses import fields

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, values
from starlette.testclient import TestClient

from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
from sglang.srt.utils.common import add_prometheus_middleware

from cache_fixtures import build, serve
from sglang_hybrid.cache.stats import CheckpointStats
from sglang_hybrid.metrics import (
    COUNTERS,
    OUTPUT_STREAMER_TARGET,
    REQUEST_INFO_KEY,
    CheckpointMetricsCollector,
    SemanticOutputStreamer,
    _output_streamer_class,
    record_request_restore,
    replica_labels,
)

# The labels SGLang's radix-cache collector carries on a single-rank server.
LABELS = {"cache_type": "SemanticStateCache", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
SERIES_LABELS = {k: str(v) for k, v in LABELS.items()}
PROMPT = list(range(100, 140))


def sample(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, SERIES_LABELS)


SLOTS = 4
# The last of the turns served_driver serves, with its output: its checkpoint is the most
# recent, so a continuation of it restores.
LAST_TURN = PROMPT + [500 + SLOTS + 1] * 5 + [7, 8]


def served_driver():
    """A cache that has taken, restored and evicted checkpoints."""
    driver = build("semantic", checkpoint_slots=SLOTS)
    for turn in range(SLOTS + 2):
        serve(driver, PROMPT + [500 + turn] * 5, output=[7, 8])
    serve(driver, LAST_TURN + [9, 10])
    stats = driver.cache.stats
    assert stats.taken > 0 and stats.restored > 0 and stats.evicted > 0
    return driver


def test_every_counter_is_a_checkpoint_stat():
    assert set(COUNTERS) <= {f.name for f in fields(CheckpointStats)}


def test_observe_publishes_the_cache_counters_and_pool_occupancy():
    driver = served_driver()
    cache = driver.cache
    registry = CollectorRegistry()
    collector = CheckpointMetricsCollector(LABELS, registry=registry)
    collector.observe(cache.stats, cache.checkpoint_pool)

    for stat, (name, _) in COUNTERS.items():
        assert sample(registry, f"sglang:semantic_{name}_total") == getattr(cache.stats, stat), stat
    assert sample(registry, "sglang:semantic_checkpoint_slots_in_use") == cache.checkpoint_pool.used_size()
    assert sample(registry, "sglang:semantic_checkpoint_slots_capacity") == SLOTS
    admitted = cache.stats.tokens_restored + cache.stats.tokens_recomputed
    assert sample(registry, "sglang:semantic_token_hit_rate") == cache.stats.tokens_restored / admitted


def test_repeated_observe_counts_each_event_once():
    driver = served_driver()
    cache = driver.cache
    registry = CollectorRegistry()
    collector = CheckpointMetricsCollector(LABELS, registry=registry)
    collector.observe(cache.stats, cache.checkpoint_pool)
    collector.observe(cache.stats, cache.checkpoint_pool)
    restored_before = cache.stats.restored
    assert sample(registry, "sglang:semantic_checkpoints_restored_total") == restored_before

    hit_rate_before = sample(registry, "sglang:semantic_token_hit_rate")
    serve(driver, LAST_TURN + [3, 4])  # one more restore
    collector.observe(cache.stats, cache.checkpoint_pool)
    assert cache.stats.restored == restored_before + 1
    assert sample(registry, "sglang:semantic_checkpoints_restored_total") == restored_before + 1
    # The gauge moves with this request, not with a batch logged some time ago.
    admitted = cache.stats.tokens_restored + cache.stats.tokens_recomputed
    assert sample(registry, "sglang:semantic_token_hit_rate") == cache.stats.tokens_restored / admitted
    assert sample(registry, "sglang:semantic_token_hit_rate") != hit_rate_before


def test_counters_keep_growing_when_the_stats_start_afresh():
    driver = served_driver()
    cache = driver.cache
    registry = CollectorRegistry()
    collector = CheckpointMetricsCollector(LABELS, registry=registry)
    collector.observe(cache.stats, cache.checkpoint_pool)
    taken = cache.stats.taken
    collector.observe(CheckpointStats(taken=2), cache.checkpoint_pool)
    assert sample(registry, "sglang:semantic_checkpoints_taken_total") == taken + 2


def test_live_slot_gauges_follow_requests_in_flight():
    driver = build("semantic", checkpoint_slots=SLOTS)
    cache = driver.cache
    live = cache.req_to_token_pool.mamba_allocator
    registry = CollectorRegistry()
    collector = CheckpointMetricsCollector(LABELS, registry=registry, live_allocator=live)

    running = driver.new_request(PROMPT, [7, 8])
    driver.admit(running)
    collector.observe(cache.stats, cache.checkpoint_pool)
    assert sample(registry, "sglang:semantic_live_state_slots_in_use") == 1
    assert sample(registry, "sglang:semantic_live_state_slots_capacity") == live.size

    driver.finish(running)
    collector.observe(cache.stats, cache.checkpoint_pool)
    assert sample(registry, "sglang:semantic_live_state_slots_in_use") == 0
    assert sample(registry, "sglang:semantic_checkpoint_slots_in_use") == cache.checkpoint_pool.used_size() > 0


def test_no_collector_without_enable_metrics():
    driver = build("semantic")
    assert driver.cache.metrics_collector is None
    assert CheckpointMetricsCollector.for_cache(driver.cache) is None


def test_each_data_parallel_replica_labels_its_own_series():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(dp_rank=None):  # a server without a DP controller
        assert replica_labels(LABELS) == LABELS
    # A replica of `--dp-size 2`: SGLang's own radix-cache labels say dp_rank 0 on both.
    with get_parallel().override(dp_rank=1):
        assert replica_labels(LABELS) == {**LABELS, "dp_rank": 1}


def test_series_reach_sglangs_metrics_route_in_multiprocess_mode(tmp_path, monkeypatch):
    # What SGLang's HTTP process sets up before it starts schedulers; prometheus_client
    # chose its value class at import, so the multiprocess one is installed explicitly.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    driver = served_driver()
    cache = driver.cache
    collector = CheckpointMetricsCollector(LABELS, registry=CollectorRegistry())
    collector.observe(cache.stats, cache.checkpoint_pool)

    app = FastAPI()
    add_prometheus_middleware(app)
    text = TestClient(app).get("/metrics").text
    rank = 'cache_type="SemanticStateCache",dp_rank="0",pp_rank="0",tp_rank="0"'
    assert f"sglang:semantic_checkpoints_taken_total{{{rank}}} {float(cache.stats.taken)}" in text
    assert f"sglang:semantic_tokens_restored_total{{{rank}}} {float(cache.stats.tokens_restored)}" in text
    used = float(cache.checkpoint_pool.used_size())
    assert f"sglang:semantic_checkpoint_slots_in_use{{{rank}}} {used}" in text
    assert f"sglang:semantic_checkpoint_slots_capacity{{{rank}}} {float(SLOTS)}" in text


# ---- per-request report ----


def test_request_report_keeps_the_first_admission():
    driver = build("semantic")
    req = driver.new_request(PROMPT)
    record_request_restore(req, restored_tokens=32, kv_hit_tokens=39)
    record_request_restore(req, restored_tokens=0, kv_hit_tokens=0)  # re-admission
    assert req.customized_info[REQUEST_INFO_KEY] == [{"restored_tokens": 32, "kv_hit_tokens": 39}]


def test_request_report_leaves_other_customized_info_alone():
    driver = build("semantic")
    req = driver.new_request(PROMPT)
    req.customized_info = {"logit_stats": [0.5]}
    record_request_restore(req, restored_tokens=0, kv_hit_tokens=12)
    assert req.customized_info == {
        "logit_stats": [0.5],
        REQUEST_INFO_KEY: [{"restored_tokens": 0, "kv_hit_tokens": 12}],
    }


def test_streamer_sends_the_report_once_per_request():
    streamer = object.__new__(SemanticOutputStreamer)
    assert streamer.is_request_level_customized_info_key(REQUEST_INFO_KEY)
    assert not streamer.is_request_level_customized_info_key("logit_stats")


def test_hook_swaps_only_sglangs_default_streamer():
    assert callable(pkgutil.resolve_name(OUTPUT_STREAMER_TARGET))
    assert _output_streamer_class(lambda scheduler: SchedulerOutputStreamer, None) is SemanticOutputStreamer

    class OtherStreamer(SchedulerOutputStreamer):
        __slots__ = ()

    assert _output_streamer_class(lambda scheduler: OtherStreamer, None) is OtherStreamer


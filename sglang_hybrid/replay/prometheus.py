"""The semantic cache's Prometheus series as the server replay reads them from ``/metrics``.

The cache's series are read before and after the run (``--enable-metrics``). results.json
carries the counters' increments over the run and, once the server is idle, its gauges: live
state slots in use (0 unless a request leaked its slot) and checkpoint slots in use, which
must equal the checkpoints the tree holds (taken - evicted - dropped with their KV, counted
since the server started, so a ``/flush_cache`` in between breaks it; without a host tier,
whose demotions move checkpoints off the device pool).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import requests

from ..metrics import COUNTERS, METRIC_PREFIX
from .server_client import CONNECT_TIMEOUT_S

# Gauges of metrics.CheckpointMetricsCollector, by their series name without the prefix.
GAUGES = (
    "checkpoint_slots_in_use",
    "checkpoint_slots_capacity",
    "live_state_slots_in_use",
    "live_state_slots_capacity",
)


def parse_cache_metrics(text: str) -> dict[str, float]:
    """The semantic cache's series in a Prometheus text exposition, by name without the
    ``sglang:semantic_`` prefix (counters keep ``_total``), each summed over its label sets
    (one per scheduler rank). Empty when the server exports none of them."""
    return cache_metrics_per_label(text, None).get(None, {})


def cache_metrics_per_label(text: str, label: Optional[str]) -> dict[Optional[str], dict[str, float]]:
    """The cache's series as ``parse_cache_metrics`` reads them, summed per value of ``label``
    (``dp_rank``: per data-parallel replica, over its tensor-parallel ranks); ``None`` sums
    every label set into one entry, keyed None."""
    from prometheus_client.parser import text_string_to_metric_families

    groups: dict[Optional[str], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(METRIC_PREFIX) and not sample.name.endswith("_created"):
                name = sample.name[len(METRIC_PREFIX):]
                values = groups.setdefault(None if label is None else sample.labels.get(label), {})
                values[name] = values.get(name, 0.0) + sample.value
    return groups


def scrape_cache_metrics(url: str) -> Optional[dict[str, float]]:
    """The cache's series from ``url``/metrics; None when the server exports none (started
    without ``--enable-metrics``, or serving another cache)."""
    response = requests.get(f"{url}/metrics", timeout=(CONNECT_TIMEOUT_S, 60))
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return parse_cache_metrics(response.text) or None


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

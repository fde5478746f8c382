"""The semantic cache's counters, and the observers it tells what it did.

Metrics subscribe to the cache (``SemanticStateCache.subscribe``; the backend factory
subscribes the Prometheus collector and the per-request report of ``metrics.py``): the
cache imports no metrics code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool


@dataclass
class CheckpointStats:
    """Cumulative counters; read them from ``SemanticStateCache.stats``."""

    taken: int = 0  # checkpoints attached to the tree
    restored: int = 0  # requests that started from a checkpoint
    evicted: int = 0  # device checkpoints dropped by eviction with no host copy kept
    dropped_with_kv: int = 0  # checkpoints dropped because their node's KV was evicted
    duplicates: int = 0  # snapshots not attached because the node already had one
    demoted: int = 0  # device checkpoints moved to the host tier instead of dropped
    promoted: int = 0  # host checkpoints copied back to the device pool for a restore
    host_evicted: int = 0  # host checkpoints dropped to make room in the host tier
    restored_from_host: int = 0  # restores whose checkpoint came from the host tier
    exhausted: int = 0  # snapshots skipped because no slot could be had
    tokens_restored: int = 0  # prompt tokens skipped thanks to a restore
    tokens_recomputed: int = 0  # prompt tokens the admitted requests had to prefill
    restored_depths: list[int] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if k != "restored_depths"}


class CheckpointObserver:
    """Told what the cache did; each call does nothing unless an observer overrides it."""

    def request_matched(self, req: "Req", restored_tokens: int, kv_hit_tokens: int) -> None:
        """The admission match of ``req`` restores ``restored_tokens`` prompt tokens (the
        checkpoint's depth, 0 for none) of the ``kv_hit_tokens`` whose KV the tree holds."""

    def cache_changed(self, stats: CheckpointStats, pool: "StateCheckpointPool") -> None:
        """A match, insert, release or eviction changed ``stats`` or the pool's occupancy."""

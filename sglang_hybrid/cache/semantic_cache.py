"""SemanticStateCache: SGLang's unified radix cache with recurrent-state checkpoints at anchors.

What differs from the stock ``UnifiedRadixCache`` (FULL + MAMBA):

* Checkpoints live in a ``StateCheckpointPool`` installed as the request pool's
  ``mamba_ckpt_pool``; a tree node's MAMBA value is a checkpoint slot, never a live
  request's slot. Caching a request snapshots its state (a copy), and the live slot goes
  back to the request pool; a hit restores by copy into the request's own slot (deferred to
  the forward stream by SGLang's copy-on-write path), so a cached checkpoint is only read.
* A request can carry checkpoints taken inside its prefill (at semantic anchors, by the
  runtime capture); ``checkpoint_into_tree`` attaches each one at its depth, splitting the
  node there. The stock cache can hold a state only at the end of what it inserts.
* Checkpoint recency is refreshed only on the node a request actually restores from (a
  ``cow_mamba`` match), not on probe matches the scheduler makes for ordering.
* An exhausted checkpoint pool degrades to "no checkpoint here"; the KV is inserted all the
  same and the request is never failed. Evicting checkpoints cannot give a live request a
  state slot, so eviction requests for live slots never touch the checkpoints.
* With a host tier, a device victim is demoted there and promoted back by the restore that
  needs it. Outside the cache a checkpoint is known by a key: its slot id on the device, its
  ``host_checkpoint_key`` on the host; whoever keys records by checkpoint (the planner)
  follows a move through ``on_checkpoint_moved``, and both tiers evict what the
  ``eviction_scorer`` values least.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import (
    ComponentType,
    EvictLayer,
    LRURefreshPhase,
    get_and_increase_time_counter,
)
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool
from sglang_hybrid.metrics import CheckpointMetricsCollector, record_request_restore

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode

logger = logging.getLogger(__name__)

MAMBA = ComponentType.MAMBA


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


class SemanticMambaComponent(MambaComponent):
    """The MAMBA tree component whose node values are ``StateCheckpointPool`` slots."""

    def __init__(self, cache: "SemanticStateCache", params: "CacheInitParams"):
        super().__init__(cache, params)
        if not isinstance(self.int8_ckpt_pool, StateCheckpointPool):
            raise TypeError(
                "SemanticMambaComponent needs a StateCheckpointPool installed as "
                "req_to_token_pool.mamba_ckpt_pool (the semantic backend factory does this)"
            )
        # True while this component tombstones its own eviction victim; a state dropped
        # at any other time goes with its node's KV.
        self._lru_victim_walk = False
        # Checkpoints demoted to the host tier: node id -> host slot, and their recency.
        self.host_slots: dict[int, torch.Tensor] = {}
        self.host_lru: OrderedDict[int, "UnifiedTreeNode"] = OrderedDict()

    @property
    def checkpoint_pool(self) -> StateCheckpointPool:
        return self.int8_ckpt_pool

    def refresh_lru(self, phase, node, root_node) -> None:
        # Probe matches (scheduling order, cache-aware routing) must not keep a checkpoint
        # alive; the restore in finalize_match_result_in_cache refreshes the one it uses.
        if phase is LRURefreshPhase.MATCH_END:
            return
        super().refresh_lru(phase, node, root_node)

    def finalize_match_result_in_cache(
        self, params: MatchPrefixParams, result: MatchResult
    ) -> MatchResult:
        restoring = params.cow_mamba and params.req is not None
        node = self.tree_core.node_by_id(result.best_match_node)
        from_host = restoring and node.id in self.host_slots
        if from_host:
            self._promote(node)
        result = super().finalize_match_result_in_cache(params, result)
        if not restoring:
            return result
        if node.id in self.host_slots:  # no device slot could be had: restore from host
            self._restore_from_host(node, params.req)
        stats = self.cache.stats
        if node.component_data[MAMBA].value is not None or from_host:
            if node.component_data[MAMBA].value is not None:
                self.tree_core.lru_lists[MAMBA].reset_node_mru(node)
            node.last_access_time = get_and_increase_time_counter()
            stats.restored += 1
            stats.restored_from_host += int(from_host)
            stats.tokens_restored += result.device_prefix_len
            stats.restored_depths.append(result.device_prefix_len)
        stats.tokens_recomputed += max(0, len(params.req.origin_input_ids) - result.device_prefix_len)
        record_request_restore(params.req, result.device_prefix_len, result.full_kv_hit_length)
        self.cache.publish_metrics()
        return result

    # ---- host tier ----

    @property
    def host_tier(self):
        return self.checkpoint_pool.host_tier

    def create_match_validator(self, match_device_only: bool = False):
        host_slots = self.host_slots
        return lambda node: node.component_data[MAMBA].value is not None or node.id in host_slots

    def node_has_component_data(self, node, target=EvictLayer.DEVICE) -> bool:
        # A host-only checkpoint is data of this node: the KV cascade that deletes the node
        # must reach evict_component so the host slot goes with it.
        if target is EvictLayer.DEVICE and node.id in self.host_slots:
            return True
        return super().node_has_component_data(node, target)

    def _demote(self, node: "UnifiedTreeNode", device_slot: torch.Tensor, value: Optional[float]) -> bool:
        """Move a device victim's state to the host tier; False when the tier keeps none.

        ``value`` is the victim's worth to the ``eviction_scorer`` (None without one). A full
        tier makes room by dropping its least valuable checkpoint, unless the victim is worth
        no more than that one: then the victim is the one dropped.
        """
        tier = self.host_tier
        if tier is None or tier.num_slots == 0:
            return False
        host_slot = tier.alloc()
        if host_slot is None:
            if not self._evict_host_checkpoint(value):
                return False
            host_slot = tier.alloc()
        tier.demote(device_slot, host_slot)
        self.host_slots[node.id] = host_slot
        self.host_lru[node.id] = node
        self.cache.stats.demoted += 1
        self.cache.checkpoint_moved(int(device_slot), host_checkpoint_key(host_slot))
        return True

    def _evict_host_checkpoint(self, incoming_value: Optional[float]) -> bool:
        """Drop the host checkpoint the ``eviction_scorer`` values least (ties: the least
        recently demoted or restored), or without a scorer the least recent one; False, dropping
        nothing, when none is worth less than ``incoming_value``."""
        scorer = self.cache.eviction_scorer
        victim = None
        if scorer is None:
            victim = next(iter(self.host_lru.values()))
        else:
            lowest = incoming_value
            for node_id, node in self.host_lru.items():
                value = scorer(host_checkpoint_key(self.host_slots[node_id]), node_depth(node))
                if value < lowest:
                    victim, lowest = node, value
            if victim is None:
                return False
        self._drop_host_copy(victim)
        self.cache.stats.host_evicted += 1
        return True

    def _promote(self, node: "UnifiedTreeNode") -> None:
        # Taken out of the host tier first: making room on the device may demote another
        # checkpoint and evict the host tier's least recent one, which must not be this one.
        host_slot = self.host_slots.pop(node.id)
        del self.host_lru[node.id]
        device_slot = self.cache.alloc_checkpoint_slot()
        if device_slot is None:
            self.host_slots[node.id] = host_slot
            self.host_lru[node.id] = node
            return
        self.host_tier.promote(host_slot, device_slot)
        self.tree_core.set_component_device_value(node.id, MAMBA, device_slot)
        self.cache.stats.promoted += 1
        self.cache.checkpoint_moved(host_checkpoint_key(host_slot), int(device_slot))

    def _restore_from_host(self, node: "UnifiedTreeNode", req: "Req") -> None:
        pool = self.cache.req_to_token_pool
        if not req.kv.holds_mamba:
            live = pool.mamba_allocator.alloc(1)
            if live is None:
                raise RuntimeError("no live state slot for a restore: the scheduler over-admitted")
            req.kv.mamba_pool_idx = live[0]
        self.host_tier.load_to_active(self.host_slots[node.id], pool.mamba_pool, req.kv.mamba_pool_idx)
        self.host_lru.move_to_end(node.id)
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = False

    def _drop_host_copy(self, node: "UnifiedTreeNode") -> None:
        host_slot = self.host_slots.pop(node.id, None)
        if host_slot is not None:
            del self.host_lru[node.id]
            self.host_tier.free(host_slot)

    def _alloc_int8_ckpt_slot(self) -> Optional[torch.Tensor]:
        return self.cache.alloc_checkpoint_slot()

    def _commit_int8_checkpoint(self, active_slots: torch.Tensor) -> Optional[torch.Tensor]:
        slot = self._alloc_int8_ckpt_slot()
        if slot is None:
            return None
        self.checkpoint_pool.store_from_active(
            self.cache.req_to_token_pool.mamba_pool, active_slots.view(-1), slot
        )
        return slot

    def commit_insert_component_data(
        self,
        node: "UnifiedTreeNode",
        is_new_leaf: bool,
        params: InsertParams,
        result: InsertResult,
        cache_actions: list,
    ) -> None:
        if params.mamba_value is None:
            # No slot could be had: the KV goes in without a state, the same as a node
            # whose checkpoint was evicted.
            return
        had_value = node.component_data[MAMBA].value is not None
        super().commit_insert_component_data(
            node, is_new_leaf, params, result, cache_actions
        )
        if had_value:
            self.cache.stats.duplicates += 1
        else:
            self.cache.stats.taken += 1
            self._drop_host_copy(node)

    def evict_component(
        self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE
    ):
        held = node.component_data[MAMBA].value is not None or node.id in self.host_slots
        freed = super().evict_component(node, device_frees, host_frees, cache_actions, target)
        if self._lru_victim_walk:
            return freed
        self._drop_host_copy(node)
        if held:
            self.cache.stats.dropped_with_kv += 1
        return freed

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        """Tombstone one unlocked checkpoint, keeping its KV.

        The stock walk deletes a leaf whole (KV included) when its state is the victim;
        here a checkpoint victim only loses its slot and the KV stays matchable. The victim
        is the least recently restored checkpoint, or, when the cache has an
        ``eviction_scorer``, the one it values least (ties go to the least recent).
        """
        if tracker[MAMBA] >= self._evict_device_request_cnt:
            return None
        victim, value = self._pick_victim()
        if victim is None:
            return None
        device_slot = victim.component_data[MAMBA].value
        self._lru_victim_walk = True
        try:
            self.tree_core._evict_component_and_detach_lru(
                victim,
                self,
                target=EvictLayer.DEVICE,
                tracker=tracker,
                device_frees=device_frees,
                host_frees=host_frees,
                cache_actions=cache_actions,
            )
        finally:
            self._lru_victim_walk = False
        if self._demote(victim, device_slot, value):
            # The tier hands the device slot back once its copy is done, not the drain.
            frees = device_frees[MAMBA]
            del frees[next(i for i, v in enumerate(frees) if v is device_slot)]
        else:
            self.cache.stats.evicted += 1
        self.tree_core._update_evictable_leaf_sets(victim)
        return None

    def _pick_victim(self) -> tuple[Optional["UnifiedTreeNode"], Optional[float]]:
        """The device victim and its value (None without an ``eviction_scorer``)."""
        lru = self.tree_core.lru_lists[MAMBA]
        node = lru.get_lru_no_lock()
        scorer = self.cache.eviction_scorer
        if scorer is None:
            return node, None
        best, best_score = None, None
        while node is not None:
            score = scorer(int(node.component_data[MAMBA].value), node_depth(node))
            if best_score is None or score < best_score:
                best, best_score = node, score
            node = lru.get_prev_no_lock(node)
        return best, best_score


def host_checkpoint_key(host_slot) -> int:
    """How a host-tier checkpoint is known outside the cache: negative, so it never collides
    with a device slot id (host row 0 is reserved, so keys run from -1 down)."""
    return -int(host_slot)


def node_depth(node: "UnifiedTreeNode") -> int:
    """Tokens from the root to the end of ``node``: the position its checkpoint holds."""
    depth = 0
    while node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


class SemanticStateCache(UnifiedRadixCache):
    def __init__(self, params: "CacheInitParams"):
        pool = getattr(params.req_to_token_pool, "mamba_ckpt_pool", None)
        if not isinstance(pool, StateCheckpointPool):
            raise TypeError(
                "SemanticStateCache needs req_to_token_pool.mamba_ckpt_pool to be a "
                "StateCheckpointPool; build it through the 'semantic' radix cache backend"
            )
        self.checkpoint_pool = pool
        self.stats = CheckpointStats()
        # Set while the cache evicts checkpoints for its own slot allocation, so the
        # component can tell an LRU checkpoint eviction from a KV eviction dropping one.
        self.evicting_checkpoints = False
        # Optional (checkpoint key, depth) -> value of keeping that checkpoint; lower is
        # evicted first, from either tier. A planner installs it so eviction follows expected
        # saving rather than recency. A key is a device slot id or a ``host_checkpoint_key``.
        self.eviction_scorer: Optional[Callable[[int, int], float]] = None
        # Optional (old key, new key) listener told when a checkpoint moves between tiers, so
        # records kept by key (the planner's) follow the checkpoint instead of going stale.
        self.on_checkpoint_moved: Optional[Callable[[int, int], None]] = None
        # rid -> [(depth, slot)]: checkpoints captured inside a prefill, not yet in the tree.
        self._staged: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.checkpoint_metrics: Optional[CheckpointMetricsCollector] = None
        super().__init__(params)
        self.checkpoint_metrics = CheckpointMetricsCollector.for_cache(self)

    def publish_metrics(self) -> None:
        """Push the counters and pool occupancy to Prometheus (with --enable-metrics)."""
        if self.checkpoint_metrics is not None:
            self.checkpoint_metrics.observe(self.stats, self.checkpoint_pool)

    # ---- checkpoint slots ----

    def checkpoint_moved(self, old_key: int, new_key: int) -> None:
        if self.on_checkpoint_moved is not None:
            self.on_checkpoint_moved(old_key, new_key)

    def free_checkpoint_keys(self) -> list[int]:
        """Keys of both tiers' free slots: a record kept under one of them is stale."""
        keys = self.checkpoint_pool.free_slot_ids()
        tier = self.checkpoint_pool.host_tier
        if tier is not None:
            keys += [host_checkpoint_key(slot) for slot in tier.free_slot_ids()]
        return keys

    def alloc_checkpoint_slot(self) -> Optional[torch.Tensor]:
        """One free checkpoint slot, evicting the least recently restored one if needed.

        None when every slot is held by a locked node or a staged capture: the caller
        then keeps no checkpoint, it never fails the request.
        """
        if self.checkpoint_pool.host_tier is not None:
            self.checkpoint_pool.host_tier.reclaim_finished()
        slot = self.checkpoint_pool.alloc(1)
        if slot is None and self.checkpoint_pool.num_slots > 0:
            self.evict_checkpoints(1)
            slot = self.checkpoint_pool.alloc(1)
        if slot is None:
            self.stats.exhausted += 1
        return slot

    def evict_checkpoints(self, num: int) -> int:
        """Drop ``num`` unlocked checkpoints in LRU order, keeping their KV."""
        self.evicting_checkpoints = True
        try:
            return super().evict(EvictParams(num_tokens=0, mamba_num=num)).mamba_num_evicted
        finally:
            self.evicting_checkpoints = False

    def evict(self, params: EvictParams) -> EvictResult:
        result = super().evict(self._without_live_state_request(params))
        self.publish_metrics()
        return result

    def evict_for_alloc(self, params: EvictParams, **kwargs) -> EvictResult:
        result = super().evict_for_alloc(self._without_live_state_request(params), **kwargs)
        self.publish_metrics()
        return result

    def _without_live_state_request(self, params: EvictParams) -> EvictParams:
        # Outside evict_checkpoints, mamba_num asks for live request slots; the tree holds
        # none of those, so dropping checkpoints would lose cache and free nothing useful.
        if self.evicting_checkpoints or params.mamba_num == 0:
            return params
        return replace(params, mamba_num=0)

    # ---- checkpoints captured inside a prefill ----

    def stage_checkpoint(self, req: "Req", depth: int, slot: torch.Tensor) -> None:
        """Hand over a checkpoint slot holding ``req``'s state after its first ``depth`` tokens.

        It is attached to the tree when the request's KV up to ``depth`` is inserted
        (``checkpoint_into_tree``); if it never is (abort, truncation), ``on_release``
        frees the slot.
        """
        if depth <= 0:
            self.checkpoint_pool.free(slot)
            raise ValueError(f"checkpoint depth must be positive, got {depth}")
        self._staged.setdefault(req.rid, []).append((depth, slot.view(-1)))

    def checkpoints_on_path(self, tokens) -> tuple[int, list[tuple[int, int]]]:
        """Read-only: the KV prefix the tree holds for ``tokens``, and the (depth, slot) of
        every checkpoint on that prefix, deepest first. Touches no recency."""
        matched, node_id, depth = self.tree_core.match_full_device_prefix(
            RadixKey(array("q", [int(t) for t in tokens]))
        )
        node = self.tree_core.node_by_id(node_id)
        held = []
        while node.parent is not None:
            slot = node.component_data[MAMBA].value
            if slot is not None and depth <= matched:
                held.append((depth, int(slot)))
            depth -= len(node.key)
            node = node.parent
        return matched, held

    def checkpoint_slot_at(self, tokens) -> Optional[int]:
        """Read-only: the slot of the checkpoint holding the state after exactly ``tokens``."""
        _, held = self.checkpoints_on_path(tokens)
        return held[0][1] if held and held[0][0] == len(tokens) else None

    def staged_slots(self) -> int:
        return sum(len(v) for v in self._staged.values())

    def checkpoint_into_tree(self, req: "Req", *, up_to: int, **kwargs) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        self._attach_staged(req)
        self.publish_metrics()

    def _attach_staged(self, req: "Req") -> None:
        staged = self._staged.get(req.rid)
        if not staged or self.disable:
            return
        inserted = req.kv.cache_protected_len
        keep: list[tuple[int, torch.Tensor]] = []
        token_ids = req.full_untruncated_fill_ids
        for depth, slot in sorted(staged, key=lambda item: item[0]):
            if depth > inserted:
                keep.append((depth, slot))
                continue
            self._attach_checkpoint(req, token_ids, depth, slot)
        if keep:
            self._staged[req.rid] = keep
        else:
            del self._staged[req.rid]

    def _attach_checkpoint(self, req: "Req", token_ids, depth: int, slot: torch.Tensor) -> None:
        key = RadixKey(
            token_ids[:depth],
            req.extra_key,
            is_bigram=self.tree_core.is_eagle,
            cache_salt=req.cache_salt,
        )
        values = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :depth].to(
            dtype=torch.int64, copy=True
        )
        # The KV of [0, depth) is already in the tree (this request's row points at the
        # tree's indices), so prev_prefix_len=depth keeps the insert from freeing any of
        # it as duplicates; the walk only splits the node at ``depth`` and attaches.
        result = self.insert(
            InsertParams(
                key=key,
                value=values,
                mamba_value=slot,
                prev_prefix_len=depth,
                inserted_len=depth,
                priority=req.priority or 0,
                session_id=req.session_id,
                rotation_base=req.kv_rotation_base,
            )
        )
        if result.mamba_exist:
            self.checkpoint_pool.free(slot)

    def on_release(self, req: "Req", *, checkpointed: bool) -> None:
        for _, slot in self._staged.pop(req.rid, ()):
            self.checkpoint_pool.free(slot)
        super().on_release(req, checkpointed=checkpointed)
        capture = self.checkpoint_pool.anchor_capture
        if capture is not None:
            session = capture.release(req)
            if checkpointed and session is not None:
                # The insert on finish left prompt + output[:-1] (what the final state covers).
                capture.request_finished(
                    session,
                    req.full_untruncated_fill_ids[: req.kv.cache_protected_len],
                    len(req.origin_input_ids),
                )
        self.publish_metrics()

    def reset(self) -> None:
        super().reset()
        if hasattr(self, "_staged"):
            self._staged.clear()
            self.checkpoint_pool.clear()
            mamba = self.components[MAMBA]
            mamba.host_slots.clear()
            mamba.host_lru.clear()

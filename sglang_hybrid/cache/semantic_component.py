"""SemanticMambaComponent: the MAMBA tree component whose node values are checkpoint slots.

SGLang's ``MambaComponent`` keeps a live request slot per node and evicts a state together with
its node's KV. This one keeps ``StateCheckpointPool`` slots and

* refreshes a checkpoint's recency only when a request restores from it, not on probe matches;
* evicts a checkpoint alone, keeping its KV matchable (a tombstone), choosing the least
  recently restored one (the LRU list's tail) or, when the cache's planning evicts by value,
  the one worth least (ties to the least recent), ranked from its own slot -> node map and
  recency stamps without a walk over the tree or the LRU list;
* with a host tier, demotes a device victim to host memory instead of dropping it, and
  promotes it back in the match that restores from it (or restores straight from the host
  when no device slot can be had). The node keeps no device value meanwhile; its host slot is
  kept here, by node id.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterator, Optional

import numba
import numpy as np
import torch

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, InsertResult, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.unified_cache.components.base import (
    ComponentType,
    EvictLayer,
    LRURefreshPhase,
    get_and_increase_time_counter,
)
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool
from sglang_hybrid.cache.planning import CheckpointId

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode

    from sglang_hybrid.cache.semantic_cache import SemanticStateCache

MAMBA = ComponentType.MAMBA


class SemanticMambaComponent(MambaComponent):
    """The MAMBA tree component whose node values are ``StateCheckpointPool`` slots."""

    def __init__(self, cache: "SemanticStateCache", params: "CacheInitParams"):
        super().__init__(cache, params)
        if not isinstance(self.int8_ckpt_pool, StateCheckpointPool):
            raise TypeError(
                "SemanticMambaComponent needs a StateCheckpointPool installed as "
                "req_to_token_pool.mamba_ckpt_pool (the semantic backend factory does this)"
            )
        # Checkpoints demoted to the host tier: node id -> host slot, and their recency.
        self.host_slots: dict[int, torch.Tensor] = {}
        self.host_lru: OrderedDict[int, "UnifiedTreeNode"] = OrderedDict()
        # Device slot -> the node holding its checkpoint, and when that node was last put at
        # the MRU end of SGLang's MAMBA LRU list (inserted, set or restored): the same order,
        # kept by slot so that victim selection reads arrays instead of walking the list.
        # An entry stays until its slot holds another checkpoint; ``slot_held`` marks the live ones.
        num_slots = self.checkpoint_pool.num_slots + 1  # slots are 1..num_slots
        self.slot_holders: list[Optional["UnifiedTreeNode"]] = [None] * num_slots
        self.slot_held = np.zeros(num_slots, dtype=bool)
        self.slot_recency = np.zeros(num_slots)
        self._recency_clock = 0.0

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
                self._touched(node)
            node.last_access_time = get_and_increase_time_counter()
            stats.restored += 1
            stats.restored_from_host += int(from_host)
            stats.tokens_restored += result.device_prefix_len
            stats.restored_depths.append(result.device_prefix_len)
        stats.tokens_recomputed += max(0, len(params.req.origin_input_ids) - result.device_prefix_len)
        self.cache.request_matched(params.req, result.device_prefix_len, result.full_kv_hit_length)
        return result

    # ---- host tier ----

    @property
    def host_tier(self):
        return self.checkpoint_pool.host_tier

    def create_match_validator(self, match_device_only: bool = False):
        host_slots = self.host_slots
        return lambda node: node.component_data[MAMBA].value is not None or node.id in host_slots

    def reclaimable_value_len(self, node: "UnifiedTreeNode") -> int:
        # A MAMBA value is one slot; SGLang's ledgers ask for it on every lock, unlock and
        # eviction, and reading the length of a tensor costs ~2 us each time.
        return 0 if node.component_data[MAMBA].value is None else 1

    def node_has_component_data(self, node, target=EvictLayer.DEVICE) -> bool:
        # A host-only checkpoint is data of this node: the KV cascade that deletes the node
        # must reach evict_component so the host slot goes with it.
        if target is EvictLayer.DEVICE and node.id in self.host_slots:
            return True
        return super().node_has_component_data(node, target)

    def _demote(self, node: "UnifiedTreeNode", device_slot: int, value: Optional[float]) -> bool:
        """Move a device victim's state (in ``device_slot``) to the host tier; False when the
        tier keeps none.

        ``value`` is the victim's worth (None when eviction follows recency). A full tier
        makes room by dropping its least valuable checkpoint, unless the victim is worth no
        more than that one: then the victim is the one dropped.
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
        self.cache.checkpoint_moved(CheckpointId.device(device_slot), CheckpointId.host(host_slot))
        return True

    def _evict_host_checkpoint(self, incoming_value: Optional[float]) -> bool:
        """Drop the host checkpoint the planning values least (ties: the least recently
        demoted or restored), or when eviction follows recency the least recent one; False,
        dropping nothing, when none is worth less than ``incoming_value``."""
        planning = self.cache.eviction_valuation
        victim = None
        if planning is None:
            victim = next(iter(self.host_lru.values()))
        else:
            lowest = incoming_value
            for node_id, node in self.host_lru.items():
                value = planning.value(CheckpointId.host(self.host_slots[node_id]), node_depth(node))
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
        self._touched(node)
        self.cache.stats.promoted += 1
        self.cache.checkpoint_moved(CheckpointId.host(host_slot), CheckpointId.device(device_slot))

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
        self._touched(node)
        if had_value:
            self.cache.stats.duplicates += 1
        else:
            self.cache.stats.taken += 1
            self._drop_host_copy(node)

    def evict_component(
        self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE
    ):
        device_slot = node.component_data[MAMBA].value
        held = device_slot is not None or node.id in self.host_slots
        freed = super().evict_component(node, device_frees, host_frees, cache_actions, target)
        if device_slot is not None and node.component_data[MAMBA].value is None:
            self.slot_held[int(device_slot)] = False
        self._drop_host_copy(node)
        if held:
            self.cache.stats.dropped_with_kv += 1
        return freed

    def evict_checkpoints(self, num: int) -> int:
        """Tombstone up to ``num`` unlocked checkpoints, keeping their KV matchable; return
        how many went.

        The victims come from ``_victims``. SGLang's generic walk (``UnifiedRadixCache.evict``)
        would delete a leaf whole, KV included, when its state is the victim, and its per-step
        bookkeeping cost more than the tombstoning itself; a tombstone is one node's value,
        its LRU entry and its slot. The freed slots go back to the pool at once at the end.
        """
        victims = self._victims()
        evicted, freed = 0, []
        try:
            while evicted < num:
                victim, slot, value = next(victims, (None, None, None))
                if victim is None:
                    break
                if self._tombstone(victim, slot, value):
                    freed.append(slot)
                evicted += 1
        finally:
            self.checkpoint_pool.slots.free_ids(freed)
        return evicted

    def _tombstone(self, victim: "UnifiedTreeNode", slot: int, value: Optional[float]) -> bool:
        """Take ``victim``'s checkpoint (in device slot ``slot``) off the tree: demoted to the
        host tier, or dropped; return whether its device slot is free now (else the tier hands
        it back once its copy is done)."""
        # The stock tombstoning (sizes, host LRU), not this class's, which drops a host copy.
        MambaComponent.evict_component(self, victim, {MAMBA: []}, {}, [], target=EvictLayer.DEVICE)
        self.slot_held[slot] = False
        lru = self.tree_core.lru_lists[MAMBA]
        if lru.in_list(victim):
            lru.remove_node(victim)
        # SGLang's evictable-leaf sets stay as they are: a leaf is defined by the Full KV and
        # the locks, never by a MAMBA value (its own MAMBA tombstone leaves them alone too).
        if self._demote(victim, slot, value):
            return False
        self.cache.stats.evicted += 1
        self.cache.checkpoint_evicted(CheckpointId.device(slot))
        return True

    def _touched(self, node: "UnifiedTreeNode") -> None:
        """``node``'s checkpoint went to the MRU end of the MAMBA LRU list."""
        slot = int(node.component_data[MAMBA].value)
        self._recency_clock += 1.0
        self.slot_holders[slot] = node
        self.slot_held[slot] = True
        self.slot_recency[slot] = self._recency_clock

    def _victims(self) -> Iterator[tuple["UnifiedTreeNode", int, Optional[float]]]:
        """The unlocked checkpoints in eviction order, each with its device slot and its value
        (None when eviction follows recency), the next one found only once the one before is
        taken: the one the planning values least, ties to the least recently restored. The
        slot comes from the component's arrays: reading it off the node's tensor would wait for
        the device on a GPU.

        The values are read once, at the first victim, and ranked. A victim leaving can only
        raise the values of the checkpoints left (a shallower one of its session becomes the
        deepest for its restore points), so the lowest ranked is asked for again: if it rose
        it is ranked anew by its new value, else none can be worth less now and it is the
        victim. Asking costs a recomputation only when the planning saw a change that can have
        moved that value."""
        planning = self.cache.eviction_valuation
        if planning is None:
            lru = self.tree_core.lru_lists[MAMBA]
            while (node := lru.get_lru_no_lock()) is not None:
                yield node, int(node.component_data[MAMBA].value), None
            return
        # An eviction call takes a few victims: the first ranks are selected, and more only once
        # those are used up, from the same values over the slots held at the start.
        held, recency_by_slot = self.slot_held.copy(), self.slot_recency.copy()
        by_slot = planning.device_values(held.shape[0])
        held_count = int(np.count_nonzero(held))
        values, recency, slots = _lowest(held, by_slot, recency_by_slot, _FIRST_RANKS)
        next_rank, ranks = 0, slots.shape[0]
        risen: list[tuple[float, float, int]] = []  # a heap of (value, recency, slot)
        while next_rank < held_count or risen:
            if next_rank == ranks < held_count:
                values, recency, slots = _lowest(held, by_slot, recency_by_slot, 4 * ranks)
                ranks = slots.shape[0]
            if next_rank < ranks:
                candidate = (values.item(next_rank), recency.item(next_rank), slots.item(next_rank))
            if risen and (next_rank == ranks or risen[0] < candidate):
                value, stamp, slot = heapq.heappop(risen)
            else:
                value, stamp, slot = candidate
                next_rank += 1
            node = self.slot_holders[slot]
            if node.component_data[MAMBA].lock_ref != 0:  # a running request holds it
                continue
            now = planning.value(CheckpointId.device(slot), node_depth(node))
            if now > value:
                heapq.heappush(risen, (now, stamp, slot))
                continue
            yield node, slot, now

    def clear_checkpoints(self) -> None:
        """The cache was reset: no node holds a checkpoint of either tier."""
        self.host_slots.clear()
        self.host_lru.clear()
        self.slot_holders = [None] * len(self.slot_holders)
        self.slot_held[:] = False


# Ranks an eviction call selects first; more are selected only once it has used them up.
_FIRST_RANKS = 8


@numba.njit("Tuple((f8[:], f8[:], i8[:]))(b1[:], f8[:], f8[:], i8)", cache=True)
def _lowest(held, values, recency, count):
    """The first ``count`` held slots (fewer if fewer are held) by value, then recency, then
    slot, in that order, each with its value and recency. Compiled, and a selection (insertion
    into the ``count`` kept so far) rather than a sort: sorting every held slot cost ~35 us at
    1,024 slots on every eviction call, which takes two victims or so."""
    kept_values, kept_recency = np.empty(count), np.empty(count)
    kept_slots = np.empty(count, dtype=np.int64)
    size = 0
    for slot in range(held.shape[0]):
        if not held[slot]:
            continue
        value, stamp = values[slot], recency[slot]
        last = size - 1
        if size == count and not (value < kept_values[last]
                                  or (value == kept_values[last] and stamp < kept_recency[last])):
            continue
        # Slots come in ascending order: one equal in value and recency to a kept one goes after it.
        at = min(size, count - 1)
        while at > 0 and (value < kept_values[at - 1]
                          or (value == kept_values[at - 1] and stamp < kept_recency[at - 1])):
            kept_values[at], kept_recency[at] = kept_values[at - 1], kept_recency[at - 1]
            kept_slots[at] = kept_slots[at - 1]
            at -= 1
        kept_values[at], kept_recency[at], kept_slots[at] = value, stamp, slot
        size = min(size + 1, count)
    return kept_values[:size], kept_recency[:size], kept_slots[:size]


def remember_depth(node: "UnifiedTreeNode", depth: int) -> None:
    """Remember ``node``'s ``depth`` (``node_depth``): the attach knows it, and a node keeps
    its depth for life (a split puts the new node above it)."""
    node.semantic_depth = depth


def node_depth(node: "UnifiedTreeNode") -> int:
    """Tokens from the root to the end of ``node``: the position its checkpoint holds."""
    depth = getattr(node, "semantic_depth", None)
    if depth is None:
        depth = 0
        walk = node
        while walk.parent is not None:
            depth += len(walk.key)
            walk = walk.parent
        remember_depth(node, depth)
    return depth

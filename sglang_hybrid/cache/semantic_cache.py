"""SemanticStateCache: SGLang's unified radix cache with recurrent-state checkpoints at anchors.

What differs from the stock ``UnifiedRadixCache`` (FULL + MAMBA):

* Checkpoints live in a ``StateCheckpointPool`` installed as the request pool's
  ``mamba_ckpt_pool``; a tree node's MAMBA value is a checkpoint slot, never a live
  request's slot (``insert`` refuses any other value). Caching a request snapshots its state
  (a copy), and the live slot goes back to the request pool; a hit restores by copy into the
  request's own slot (deferred to the forward stream by SGLang's copy-on-write path), so a
  cached checkpoint is only read.
* At a request's first prefill forward the cache asks its ``CheckpointPlanning`` (given at
  construction) which depths to checkpoint and stages a slot for each
  (``plan_checkpoints``); the runtime's capture writes the states there during the prefill,
  and ``checkpoint_into_tree`` attaches each one at its depth, splitting the node there. The
  stock cache can hold a state only at the end of what it inserts.
* Checkpoint recency is refreshed only on the node a request actually restores from (a
  ``cow_mamba`` match), not on probe matches the scheduler makes for ordering; eviction
  follows recency, or the planning's ``value`` when it evicts by value
  (``semantic_component.py``).
* An exhausted checkpoint pool degrades to "no checkpoint here"; the KV is inserted all the
  same and the request is never failed. Evicting checkpoints cannot give a live request a
  state slot, so eviction requests for live slots never touch the checkpoints.
* With a host tier, a device victim is demoted there and promoted back by the restore that
  needs it; the planning follows each move (``CheckpointPlanning.moved``).
* When a request leaves (``on_release``), the planning learns what it left in the tree.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, InsertParams, InsertResult
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool
from sglang_hybrid.cache.planning import CheckpointId, CheckpointPlanning, RequestToPlan
from sglang_hybrid.cache.semantic_component import remember_depth
from sglang_hybrid.cache.stats import CheckpointObserver, CheckpointStats
from sglang_hybrid.tokens import common_prefix_length

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode

    from sglang_hybrid.anchors.hints import ValidatedHint

logger = logging.getLogger(__name__)

MAMBA = ComponentType.MAMBA


class SemanticStateCache(UnifiedRadixCache):
    def __init__(self, params: "CacheInitParams", planning: Optional[CheckpointPlanning] = None):
        pool = getattr(params.req_to_token_pool, "mamba_ckpt_pool", None)
        if not isinstance(pool, StateCheckpointPool):
            raise TypeError(
                "SemanticStateCache needs req_to_token_pool.mamba_ckpt_pool to be a "
                "StateCheckpointPool; build it through the 'semantic' radix cache backend"
            )
        self.checkpoint_pool = pool
        # None: no checkpoints inside prefills, eviction by recency.
        self.planning = planning
        self.stats = CheckpointStats()
        self._observers: list[CheckpointObserver] = []
        # Requests whose checkpoints were planned, from their first prefill forward until
        # they leave; rid -> [(depth, slot)] staged for them and not yet in the tree.
        self._planned: set[str] = set()
        self._staged: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._logged_digest: Optional[str] = None
        super().__init__(params)

    def subscribe(self, observer: CheckpointObserver) -> None:
        self._observers.append(observer)

    def request_matched(self, req: "Req", restored_tokens: int, kv_hit_tokens: int) -> None:
        for observer in self._observers:
            observer.request_matched(req, restored_tokens, kv_hit_tokens)
        self._publish()

    def _publish(self) -> None:
        for observer in self._observers:
            observer.cache_changed(self.stats, self.checkpoint_pool)

    # ---- checkpoint slots ----

    @property
    def eviction_valuation(self) -> Optional[CheckpointPlanning]:
        """The planning whose ``value`` orders eviction; None: eviction follows recency."""
        planning = self.planning
        return planning if planning is not None and planning.evicts_by_value else None

    def checkpoint_moved(self, old: CheckpointId, new: CheckpointId) -> None:
        if self.planning is not None:
            self.planning.moved(old, new)

    def checkpoint_evicted(self, checkpoint: CheckpointId) -> None:
        if self.planning is not None:
            self.planning.evicted(checkpoint)

    def free_checkpoints(self) -> list[CheckpointId]:
        """The slots of both tiers that hold no checkpoint."""
        free = [CheckpointId.device(slot) for slot in self.checkpoint_pool.free_slot_ids()]
        tier = self.checkpoint_pool.host_tier
        if tier is not None:
            free += [CheckpointId.host(slot) for slot in tier.free_slot_ids()]
        return free

    def alloc_checkpoint_slot(self) -> Optional[torch.Tensor]:
        """One free checkpoint slot, evicting the least recently restored one if needed.

        None when every slot is held by a locked node or a staged capture: the caller
        then keeps no checkpoint, it never fails the request.
        """
        self._reclaim_demoted_slots()
        slot = self.checkpoint_pool.alloc(1)
        if slot is None and self.checkpoint_pool.num_slots > 0:
            self.evict_checkpoints(1)
            slot = self.checkpoint_pool.alloc(1)
        if slot is None:
            self.stats.exhausted += 1
        return slot

    def _reclaim_demoted_slots(self) -> None:
        """Free the device slots of finished demotions, as many on every tensor-parallel rank.

        Each rank's copies finish at their own time, so each rank counts its finished ones
        and the group frees the least of the counts (SGLang's own rule for its async acks,
        ``UnifiedRadixCache._drain_queue``): a rank that freed more would allocate, evict and
        restore differently from the others. Every rank holds the same pending demotions (the
        same decisions), so all of them skip or join the collective alike.
        """
        tier = self.checkpoint_pool.host_tier
        if tier is None or not tier.pending_device_slots():
            return
        agreed = torch.tensor([tier.finished_demotions()], dtype=torch.int64)
        self._all_reduce(agreed, torch.distributed.ReduceOp.MIN)
        tier.reclaim(int(agreed.item()))

    def evict_checkpoints(self, num: int) -> int:
        """Drop up to ``num`` unlocked checkpoints (``SemanticMambaComponent.evict_checkpoints``),
        keeping their KV; return how many went."""
        return self.components[MAMBA].evict_checkpoints(num)

    def evict(self, params: EvictParams) -> EvictResult:
        result = super().evict(self._without_live_state_request(params))
        self._publish()
        return result

    def evict_for_alloc(self, params: EvictParams, **kwargs) -> EvictResult:
        result = super().evict_for_alloc(self._without_live_state_request(params), **kwargs)
        self._publish()
        return result

    def _without_live_state_request(self, params: EvictParams) -> EvictParams:
        # mamba_num asks for live request slots; the tree holds none of those, so dropping
        # checkpoints would lose cache and free nothing useful (``evict_checkpoints`` drops
        # them when a checkpoint needs a slot).
        if params.mamba_num == 0:
            return params
        return replace(params, mamba_num=0)

    def insert(self, params: InsertParams) -> InsertResult:
        value = params.mamba_value
        if value is not None and not self.checkpoint_pool.is_allocated(value):
            raise ValueError(
                f"insert got mamba_value {value.view(-1).tolist()}, which is not a slot taken "
                "from the checkpoint pool (a live request slot?): the semantic cache's tree "
                "holds checkpoint slots only; take one with alloc_checkpoint_slot() and copy "
                "the state into it (StateCheckpointPool.store_from_active)"
            )
        return super().insert(params)

    # ---- planning and staging a request's checkpoints ----

    @staticmethod
    def restore_source(req: "Req") -> Optional[CheckpointId]:
        """The checkpoint ``req``'s admission match restores from (None: none, or straight
        from the host tier). SGLang forgets it once the copy is queued, in
        ``prepare_for_extend``: read it before."""
        source = req.kv.mamba_cow_src_index
        return None if source is None else CheckpointId.device(source)

    def has_planned(self, req: "Req") -> bool:
        return req.rid in self._planned

    def plan_checkpoints(
        self,
        req: "Req",
        *,
        restored: Optional[CheckpointId],
        hint: Optional["ValidatedHint"],
        session: Optional[str],
    ) -> list[tuple[int, CheckpointId]]:
        """Ask the planning which depths ``req``'s prefill checkpoints and stage a slot for
        each; return their (depth, checkpoint), by depth.

        Called once per request, at its first prefill forward: what a server knows then is
        its prompt and the tree, not its output. Slots run out quietly: a request is never
        failed for want of a checkpoint.
        """
        self._planned.add(req.rid)
        if self.planning is None:
            return []
        # A copy: the planning keeps the prompt (the session's latest sequence), and SGLang's
        # streaming sessions extend a turn's ids in place for the next turn, which a view of
        # them kept past the request (aborted: no finish replaces it) would forbid.
        prompt = np.array(req.origin_input_ids, dtype=np.int64)
        tree_lcp, held = self.checkpoints_on_path(req.origin_input_ids, req.extra_key, req.cache_salt)
        depths = self.planning.plan(RequestToPlan(
            rid=req.rid,
            prompt=prompt,
            session=session,
            hint=hint,
            restored_depth=int(req.prefix_len),
            restored=restored,
            tree_lcp=tree_lcp,
            held_depths=tuple(depth for depth, _ in held),
            free_slots=self.checkpoint_pool.available_size(),
            pool_slots=self.checkpoint_pool.num_slots,
            namespace=_namespace(req),
        ))  # fmt: skip
        # Every slot is taken (and staged, so that ``abandon_checkpoints`` frees it if the
        # planning fails) before the planning hears of any: the evictions that make room are
        # judged on the values the plan was made with, in one eviction call. It also makes room
        # for the generation-end state the request's finish keeps: valuing the pool for that
        # slot on its own cost a second eviction call per request, on the finish path.
        missing = len(depths) + 1 - self.checkpoint_pool.available_size()
        if missing > 0 and self.checkpoint_pool.num_slots > 0:
            self.evict_checkpoints(missing)
        staged = []
        for depth in depths:
            slot = self.alloc_checkpoint_slot()
            if slot is None:
                break
            self.stage_checkpoint(req, depth, slot)
            staged.append((depth, CheckpointId.device(slot)))
        for depth, checkpoint in staged:
            self.planning.staged(req.rid, depth, checkpoint)
        return staged

    def abandon_checkpoints(self, req: "Req") -> None:
        """Serve ``req`` without in-prefill checkpoints: its staged slots are freed and it is
        not planned again (what a request whose planning failed falls back to)."""
        self._planned.add(req.rid)
        for _, slot in self._staged.pop(req.rid, ()):
            self.checkpoint_pool.free(slot)

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

    def staged_checkpoints(self, req: "Req") -> list[tuple[int, CheckpointId]]:
        """(depth, checkpoint) staged for ``req`` and not yet in the tree."""
        return [(depth, CheckpointId.device(slot)) for depth, slot in self._staged.get(req.rid, ())]

    def staged_slots(self) -> int:
        return sum(len(v) for v in self._staged.values())

    # ---- reading the tree ----

    def checkpoints_on_path(
        self, tokens, extra_key: Optional[str] = None, cache_salt: Optional[str] = None
    ) -> tuple[int, list[tuple[int, CheckpointId]]]:
        """Read-only: the KV prefix the tree holds for ``tokens`` in the namespace of
        ``extra_key`` and ``cache_salt`` (a request's LoRA adapter and salt: SGLang keys its
        path by them), and the (depth, checkpoint) of every device checkpoint on that prefix,
        deepest first. Touches no recency.

        One walk that compares each node's key in place (``_key_match``): SGLang's read-only
        match (``match_full_device_prefix``) copies the rest of the key at every node, and
        converting the tokens one Python int at a time cost ~1 ms per 8k-token prompt, twice
        per request.
        """
        tree = self.tree_core
        ids, tokens = _key_ids(tokens)
        key = RadixKey(ids, extra_key, is_bigram=tree.is_eagle, cache_salt=cache_salt)
        page, length = self.page_size, len(key)
        node, matched, held = tree.root_node, 0, []
        while length - matched >= page:
            child = node.children.get(key.child_key_at(matched, page))
            if child is None or child.component_data[ComponentType.FULL].value is None:
                break
            prefix = _key_match(child.key, key, tokens, matched, page)
            matched += prefix
            if prefix < len(child.key):
                break
            slot = child.component_data[MAMBA].value
            if slot is not None:
                held.append((matched, CheckpointId.device(slot)))
            node = child
        held.reverse()
        return matched, held

    def checkpoint_at(
        self, tokens, extra_key: Optional[str] = None, cache_salt: Optional[str] = None
    ) -> Optional[CheckpointId]:
        """Read-only: the device checkpoint holding the state after exactly ``tokens`` (in the
        namespace of ``extra_key`` and ``cache_salt``)."""
        _, held = self.checkpoints_on_path(tokens, extra_key, cache_salt)
        return held[0][1] if held and held[0][0] == len(tokens) else None

    def state_digest(self) -> str:
        """A hash of the tree's keys, each node's device and host checkpoint slot, the free
        slots of both tiers and the device slots of demotions in flight: equal on every
        tensor-parallel rank while the ranks agree.

        Read-only and a walk over the whole tree: for checks (``sanity_check``, tests), not
        for the serving path.
        """
        host_slots = self.components[MAMBA].host_slots
        digest = hashlib.blake2b(digest_size=8)
        stack = [(self.tree_core.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            if node.parent is not None:
                device = node.component_data[MAMBA].value
                host = host_slots.get(node.id)
                digest.update(repr((
                    depth, tuple(node.key.token_ids),
                    None if device is None else int(device), None if host is None else int(host),
                )).encode())  # fmt: skip
            children = sorted(node.children.values(), key=lambda child: tuple(child.key.token_ids))
            stack.extend((child, depth + 1) for child in reversed(children))
        # In allocation order: the order decides which slot the next checkpoint gets.
        digest.update(repr([(int(c.tier), c.slot) for c in self.free_checkpoints()]).encode())
        tier = self.checkpoint_pool.host_tier
        digest.update(repr(None if tier is None else tier.pending_device_slots()).encode())
        return digest.hexdigest()

    def sanity_check(self) -> None:
        """SGLang's idle check of the tree (``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK``), then
        the state digest logged whenever it changed: tensor-parallel ranks that agree log the
        same digest after the same requests."""
        super().sanity_check()
        digest = self.state_digest()
        if digest != self._logged_digest:
            self._logged_digest = digest
            rank = 0 if self.tp_world_size == 1 else torch.distributed.get_rank(self.tp_group)
            logger.info("semantic state digest tp_rank=%d: %s", rank, digest)

    # ---- into the tree, and out of the cache ----

    def checkpoint_into_tree(self, req: "Req", *, up_to: int, **kwargs) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        self._attach_staged(req)
        self._publish()

    def _attach_staged(self, req: "Req") -> None:
        staged = self._staged.get(req.rid)
        if not staged or self.disable:
            return
        inserted = req.kv.cache_protected_len
        ready = [item for item in staged if item[0] <= inserted]
        keep = [item for item in staged if item[0] > inserted]
        if keep:
            self._staged[req.rid] = keep
        else:
            del self._staged[req.rid]
        if ready:
            self._attach_checkpoints(req, ready)

    def _attach_checkpoints(self, req: "Req", ready: list[tuple[int, torch.Tensor]]) -> None:
        """Attach each (depth, slot) of ``ready`` (all within what ``req`` has inserted) to the
        node ending at its depth, splitting nodes there: one walk down the request's path for
        all of them.

        SGLang's insert walks from the root, so attaching a request's ~100 message-start
        checkpoints one insert each cost ~100 walks of ~100 nodes (tens of ms per request
        on the scheduler thread). The path is already in the tree, owned by this request's
        insert, so the walk only splits nodes and commits each slot as the insert's last
        step does (``commit_insert_component_data``).
        """
        tree = self.tree_core
        deepest = max(depth for depth, _ in ready)
        key = RadixKey(
            req.full_untruncated_fill_ids,
            req.extra_key,
            is_bigram=tree.is_eagle,
            limit=deepest,
            cache_salt=req.cache_salt,
        )
        # A bigram key (EAGLE) is one unit shorter than the tokens it covers.
        shift = deepest - len(key)
        tokens = _int64_copy(key.token_ids, deepest)
        slots: dict[int, list[tuple[int, torch.Tensor]]] = {}  # key length -> staged there
        for depth, slot in ready:
            if depth - shift <= 0:  # a one-token bigram key holds nothing to attach to
                self.checkpoint_pool.free(slot)
            else:
                slots.setdefault(depth - shift, []).append((depth, slot))
        targets = sorted(slots)
        actions: list = []
        node_at: dict[int, "UnifiedTreeNode"] = {}
        node, walked, next_target = tree.root_node, 0, 0
        while next_target < len(targets):
            child = node.children[key.child_key_at(walked, self.page_size)]
            end = walked + len(child.key)
            if _key_match(child.key, key, tokens, walked, self.page_size) < min(len(child.key), targets[-1] - walked):
                raise RuntimeError(
                    f"request {req.rid}'s path leaves the tree before depth {targets[-1] + shift}, "
                    f"which its insert covered ({req.kv.cache_protected_len} tokens)"
                )
            inside = next_target
            while inside < len(targets) and targets[inside] < end:
                inside += 1
            self._split_at(child, walked, targets[next_target:inside], node_at, actions)
            if inside < len(targets) and targets[inside] == end:
                node_at[end] = child
                inside += 1
            node, walked, next_target = child, end, inside
        for target in targets:
            node = node_at[target]
            for depth, slot in slots[target]:
                params = InsertParams(
                    mamba_value=slot,
                    prev_prefix_len=depth,
                    inserted_len=depth,
                    priority=req.priority or 0,
                    session_id=req.session_id,
                    rotation_base=req.kv_rotation_base,
                )
                result = InsertResult(prefix_len=target, last_device_node=node.id)
                for component in tree.components:
                    component.commit_insert_component_data(
                        node=node, is_new_leaf=False, params=params, result=result, cache_actions=actions
                    )
                if result.mamba_exist:
                    self.checkpoint_pool.free(slot)
            remember_depth(node, target)
        self._apply_cache_actions(actions)

    def _split_at(
        self, node: "UnifiedTreeNode", start: int, targets: list[int], node_at: dict[int, "UnifiedTreeNode"], actions: list
    ) -> None:
        """Split ``node`` (its key starting at depth ``start``) so that a node ends at each of
        ``targets`` (inside it, ascending), recording it in ``node_at``.

        SGLang's split copies both halves of the node's KV indices, so splitting a long
        node at k depths from one end copies it k times over (a 128k-token prompt with ~50
        checkpoints: ~0.4 s); splitting at the middle target first copies it log k times.
        """
        if not targets:
            return
        middle = len(targets) // 2
        depth = targets[middle]
        # ``node`` stays the part below ``depth``; the part above is the new node. SGLang's split
        # reads the key it is given for its first page and the page past the split only: capped
        # there, it does not copy the rest of the node's key for them.
        split = depth - start
        upper, action = self.tree_core._split_node(_capped(node.key, split + self.page_size), node, split)
        if action is not None:
            actions.append(action)
        node_at[depth] = upper
        self._split_at(upper, start, targets[:middle], node_at, actions)
        self._split_at(node, depth, targets[middle + 1 :], node_at, actions)

    def on_release(self, req: "Req", *, checkpointed: bool) -> None:
        for _, slot in self._staged.pop(req.rid, ()):
            self.checkpoint_pool.free(slot)
        self._planned.discard(req.rid)
        super().on_release(req, checkpointed=checkpointed)
        if self.planning is not None:
            if checkpointed:
                # The insert on finish left prompt + the output the final state covers.
                cached_ids, cached = _key_ids(req.full_untruncated_fill_ids[: req.kv.cache_protected_len])
                self.planning.finished(
                    req.rid, cached, len(req.origin_input_ids),
                    self.checkpoint_at(cached_ids, req.extra_key, req.cache_salt), self.free_checkpoints(),
                )
            self.planning.released(req.rid)
        self._publish()

    def end_session(self, session: str) -> None:
        """The client of agent session ``session`` (what its requests name as
        ``checkpoint_session``) sends no more requests: its checkpoints go first when slots
        are needed. Nothing is freed now: a checkpoint it shares serves other sessions."""
        if self.planning is not None:
            self.planning.session_ended(session)
            logger.info("checkpoint session %r ended", session)

    def reset(self) -> None:
        super().reset()
        if hasattr(self, "_staged"):
            self._staged.clear()
            self._planned.clear()
            self.checkpoint_pool.clear()
            self.components[MAMBA].clear_checkpoints()


def _key_match(node_key: RadixKey, key: RadixKey, tokens: Optional[np.ndarray], offset: int, page: int) -> int:
    """``node_key.match_at(key, offset, page)``, ``tokens`` being ``key``'s token ids (up to its
    cap) as an int64 array: the two compared as arrays by a compiled scan (a few us a node,
    ~20 us in all for a 128k-token path), where SGLang's galloping compare copies slices of
    both keys at every step (~20 us a node). Keys of another shape (EAGLE's bigrams, a capped
    node, ids not held as int64) are left to ``match_at``."""
    own = _int64_view(node_key.token_ids)
    if tokens is None or own is None or key.is_bigram or node_key.limit is not None:
        return node_key.match_at(key, offset, page)
    return common_prefix_length(own, tokens[offset:offset + own.shape[0]]) // page * page


def _capped(key: RadixKey, length: int) -> RadixKey:
    """``key`` read as its first ``length`` units (at most), its tokens not copied."""
    raw = length + 1 if key.is_bigram else length  # a bigram unit reads the token after it
    if key.limit is not None:
        raw = min(raw, key.limit)
    return RadixKey(key.token_ids, key.extra_key, is_bigram=key.is_bigram, limit=raw, cache_salt=key.cache_salt)


def _key_ids(tokens) -> tuple[array, np.ndarray]:
    """Token ids as SGLang's keys hold them, an ``array("q")``, and as an int64 array sharing
    its memory: ``tokens`` itself if it is such an array (SGLang's requests hold theirs so),
    else a copy."""
    view = _int64_view(tokens)
    if view is not None:
        return tokens, view
    ids = array("q")
    # From the raw bytes: ``array("q", tokens.tobytes())`` costs ~0.8 ms at 128k tokens.
    ids.frombytes(memoryview(np.ascontiguousarray(tokens, dtype=np.int64)).cast("B"))
    return ids, np.frombuffer(ids, dtype=np.int64)


def _int64_copy(ids, length: int) -> Optional[np.ndarray]:
    """The first ``length`` ids of an ``array("q")`` as an int64 array of their own (None for
    ids held otherwise). A copy, not a view, of a request's live ids: SGLang extends them in
    place as the request decodes, which a view kept alive (by an error's traceback) forbids."""
    view = _int64_view(ids)
    return None if view is None else view[:length].copy()


def _int64_view(ids) -> Optional[np.ndarray]:
    """An ``array("q")`` of token ids as an int64 array, sharing its memory (None for ids held
    otherwise)."""
    if not isinstance(ids, array) or ids.typecode != "q":
        return None
    return np.frombuffer(ids, dtype=np.int64)


def _namespace(req: "Req") -> Optional[tuple[Optional[str], Optional[str]]]:
    """``RequestToPlan.namespace`` of ``req``: its LoRA ``extra_key`` and ``cache_salt`` as
    SGLang's ``RadixKey`` keys them (an empty salt is none), None for neither."""
    salt = req.cache_salt or None
    return None if req.extra_key is None and salt is None else (req.extra_key, salt)

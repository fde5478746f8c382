"""A request's checkpoint lifecycle outside a server, by the steps a server takes.

The replay's `semantic` policy, the CPU reference engine and the tests serve requests through
``RequestLifecycle``; a server takes the same steps in SGLang's scheduler and model runner,
with the plugin's hooks. Per request:

1. ``new_request``: the request carries its checkpoint hint and session in
   ``sampling_params.custom_params``, validated as the server's tokenization hook validates
   them (``anchors.hints.validate_request_hint``).
2. ``admit``: the scheduler's admission match (at most len(prompt) - 1 tokens; the cache
   refreshes and reports the checkpoint it restores), the lock on the matched path, a request
   row and KV for the uncached part.
3. ``start``: what runs before the prefill forward, wrapped by the same planning step the
   server's ``prepare_for_extend`` hook runs (``runtime.anchor_capture.plan_around_prepare``):
   the restore source is read, the checkpoint the match restored is copied into the request's
   live slot (what SGLang's model runner does on the forward stream), and a request in its
   first forward gets its checkpoints planned and staged by the cache. The caller then
   computes: the engine runs the model and writes the staged states, the tests write
   fingerprints, the replay checks placement only.
4. ``finish`` / ``abort``: SGLang's ``release_kv_cache`` inserts the request (attaching its
   staged checkpoints) or not, and the cache's ``on_release`` tells the planning what the
   request left, exactly as on a server.
"""

from __future__ import annotations

from array import array
from typing import Any, Optional, Sequence

import torch

from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocation import ensure_mamba_capacity
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_hybrid.anchors.hints import checkpoint_params, validate_request_hint
from sglang_hybrid.harness.pools import StandaloneTreeCache
from sglang_hybrid.runtime.anchor_capture import CaptureQueries, plan_around_prepare


class KVExhausted(RuntimeError):
    """The request does not fit even after evicting the tree; nothing it took is kept."""


class RequestLifecycle:
    """Runs requests through a standalone tree cache with the steps SGLang's server takes."""

    def __init__(self, tree: StandaloneTreeCache):
        self.tree = tree
        self._next_rid = 0

    @property
    def cache(self):
        return self.tree.cache

    def new_request(
        self,
        input_ids: Sequence[int],
        output_ids: Sequence[int] = (),
        *,
        hint: Any = None,
        session: Optional[str] = None,
    ) -> Req:
        """A request for ``input_ids`` whose output will be ``output_ids`` (the caller feeds
        them), asking for checkpoint ``hint`` (positions or a mode) in agent ``session``."""
        if len(input_ids) == 0:
            raise ValueError("a request needs at least one prompt token")
        sampling = validate_request_hint({"custom_params": checkpoint_params(hint, session)}, len(input_ids))
        req = Req(
            rid=f"req-{self._next_rid}",
            origin_input_text="",
            origin_input_ids=array("q", input_ids),
            sampling_params=SamplingParams(
                temperature=0,
                max_new_tokens=max(1, len(output_ids)),
                custom_params=sampling["custom_params"],
            ),
        )
        self._next_rid += 1
        req.output_ids = array("q", output_ids)
        req.full_untruncated_fill_ids = array("q", [*input_ids, *output_ids])
        return req

    def match(self, req: Req, *, cow: bool = True) -> MatchResult:
        """Admission match (``cow``) or probe of at most len(prompt) - 1 tokens: one token is
        always computed."""
        key = RadixKey(array("q", req.origin_input_ids[:-1]), req.extra_key, cache_salt=req.cache_salt)
        result = self.cache.match_prefix(
            MatchPrefixParams(key=key, req=req if cow else None, cow_mamba=cow)
        )
        req.prefix_len = result.device_prefix_len
        req.last_node = result.last_device_node
        return result

    def admit(self, req: Req) -> MatchResult:
        """Match, lock the matched path, take a request row and KV for the uncached part.

        Like the scheduler, KV is reclaimed by evicting the tree (never the locked matched
        prefix) when the allocator is short. If the request still cannot be placed it raises
        ``KVExhausted`` having given back everything it took, as a scheduler leaves such a
        request waiting.
        """
        result = self.match(req)
        req.lock = self.cache.lock(result.last_device_node)
        pool = self.tree.req_to_token_pool
        if not ensure_mamba_capacity(pool, [req], self.cache):
            self._give_back(req)
            raise KVExhausted("no live state slot free: too many requests in flight")
        pool.alloc([req])
        prefix = self.cache.path_device_indices(result.last_device_node)[: req.prefix_len]
        total = len(req.full_untruncated_fill_ids)
        need = total - req.prefix_len
        if self.tree.allocator.available_size() < need:
            self.cache.evict(EvictParams(num_tokens=need - self.tree.allocator.available_size()))
        new_kv = self.tree.allocator.alloc(need)
        if new_kv is None:
            self._give_back(req)
            raise KVExhausted(
                f"KV pool exhausted: {need} tokens asked, "
                f"{self.tree.allocator.available_size()} free after eviction"
            )
        pool.write((req.kv.req_pool_idx, slice(0, total)), torch.cat([prefix, new_kv]))
        req.kv.kv_committed_len = total
        req.kv.kv_allocated_len = total
        req.kv.cache_protected_len = req.prefix_len
        req.extend_end = total
        return result

    def _give_back(self, req: Req) -> None:
        self.cache.unlock(req.lock)
        req.lock = None
        pool = self.tree.req_to_token_pool
        if req.kv.holds_kv:
            pool.free_mamba_cache(req)
            pool.free(req)
        elif req.kv.holds_mamba:
            pool.mamba_allocator.free(req.kv.mamba_pool_idx.view(1))
            req.kv.mamba_pool_idx = None
        req.kv.mamba_cow_src_index = None

    def start(self, reqs: Sequence[Req]) -> Optional[CaptureQueries]:
        """Everything before the prefill forward of ``reqs`` (admitted, in the forward's
        order): restores copied, checkpoints planned and staged; returns the captures the
        forward owes (None: none)."""
        _, queries = plan_around_prepare(self.cache, reqs, lambda: [self._copy_on_write(req) for req in reqs])
        return queries

    def _copy_on_write(self, req: Req) -> None:
        src = req.kv.mamba_cow_src_index
        if src is None:
            return
        pool = self.tree.req_to_token_pool
        src_slot = torch.as_tensor([int(src)])
        dst_slot = req.kv.mamba_pool_idx.view(1)
        if pool.mamba_ckpt_pool is not None:
            pool.mamba_ckpt_pool.load_to_active(pool.mamba_pool, src_slot, dst_slot)
        else:
            pool.copy_mamba_state(src_slot, dst_slot)
        req.kv.mamba_cow_src_index = None

    def finish(self, req: Req) -> None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)

    def abort(self, req: Req) -> None:
        req.finished_reason = FINISH_ABORT("aborted")
        release_kv_cache(req, self.cache, checkpoint=False)

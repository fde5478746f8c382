"""The real SGLang tree cache outside a server: CPU pools, registry-built cache, scheduler steps.

The replay simulator, the CPU reference engine and the tests all need the cache exactly as a
scheduler builds and drives it, without a model server. ``build_tree_cache`` allocates
SGLang's own pools (``HybridReqToTokenPool`` with its ``MambaPool``, ``HybridLinearKVPool``,
``TokenToKVPoolAllocator``) and asks ``registry.create_tree_cache`` for the backend, so
``semantic`` is reached through ``--radix-cache-backend`` like in a server.
``SchedulerDriver`` performs, per request, the steps the scheduler performs: the admission
match (at most len(prompt) - 1 tokens, copy-on-write of the matched state), request-row and
KV allocation, the deferred copy-on-write the model runner executes before a forward, and the
release with or without checkpoint (``release_kv_cache``).
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence
from unittest import mock

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocation import ensure_mamba_capacity
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from sglang_hybrid.config import SemanticCacheConfig
from sglang_hybrid.plugin import register

# GDN's chunked scan works in 64-token chunks; SGLang aligns its own checkpoint grid to it.
FLA_CHUNK_SIZE = 64


@dataclass(frozen=True)
class HybridPoolSpec:
    """Sizes of the pools a hybrid model needs; the state layout comes from the model."""

    cache_params: Mamba2CacheParams
    full_attention_layer_ids: tuple[int, ...]
    kv_head_num: int
    kv_head_dim: int
    kv_dtype: torch.dtype = torch.float32
    kv_size: int = 1 << 16
    max_num_reqs: int = 8
    max_context_len: int = 1 << 15
    device: str = "cpu"

    @property
    def mamba_layer_ids(self) -> list[int]:
        return list(self.cache_params.layers)


@dataclass
class TreeCacheUnderTest:
    cache: object
    allocator: TokenToKVPoolAllocator
    req_to_token_pool: HybridReqToTokenPool

    @property
    def mamba_pool(self):
        return self.req_to_token_pool.mamba_pool


def build_tree_cache(
    backend: Optional[str],
    spec: HybridPoolSpec,
    *,
    config: SemanticCacheConfig = SemanticCacheConfig(),
) -> TreeCacheUnderTest:
    """Allocate the pools of ``spec`` and build the tree cache SGLang selects for ``backend``.

    ``backend`` is a ``--radix-cache-backend`` name ("semantic"), or None for SGLang's
    default selection (the stock ``UnifiedRadixCache``). Both use the Python tree core, so
    they are compared on equal terms (a custom component requires it).
    """
    register()
    server_args = ServerArgs(model_path="dummy", page_size=1, radix_cache_backend=backend)
    server_args._mamba_cache_chunk_size = FLA_CHUNK_SIZE
    set_global_server_args_for_scheduler(server_args)
    req_to_token_pool = HybridReqToTokenPool(
        size=spec.max_num_reqs,
        mamba_size=spec.max_num_reqs * 2,
        mamba_spec_state_size=spec.max_num_reqs,
        max_context_len=spec.max_context_len,
        device=spec.device,
        enable_memory_saver=False,
        cache_params=spec.cache_params,
        mamba_layer_ids=spec.mamba_layer_ids,
        enable_mamba_extra_buffer=False,
    )
    kv_pool = HybridLinearKVPool(
        size=spec.kv_size,
        dtype=spec.kv_dtype,
        page_size=1,
        head_num=spec.kv_head_num,
        head_dim=spec.kv_head_dim,
        full_attention_layer_ids=list(spec.full_attention_layer_ids),
        device=spec.device,
        enable_memory_saver=False,
        mamba_pool=req_to_token_pool.mamba_pool,
    )
    allocator = TokenToKVPoolAllocator(
        size=spec.kv_size,
        dtype=spec.kv_dtype,
        device=spec.device,
        kvcache=kv_pool,
        need_sort=False,
    )
    params = CacheInitParams(
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        disable=False,
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=True,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    env = {**config.to_env(), "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    with mock.patch.dict(os.environ, env):
        cache = create_tree_cache(ctx)
    return TreeCacheUnderTest(cache, allocator, req_to_token_pool)


class KVExhausted(RuntimeError):
    """The request does not fit even after evicting the tree; nothing it took is kept."""


class SchedulerDriver:
    """Runs requests through a tree cache with the steps SGLang's scheduler takes."""

    def __init__(self, under_test: TreeCacheUnderTest):
        self.t = under_test
        self._next_rid = 0

    @property
    def cache(self):
        return self.t.cache

    def new_request(self, input_ids: Sequence[int], output_ids: Sequence[int] = ()) -> Req:
        if len(input_ids) == 0:
            raise ValueError("a request needs at least one prompt token")
        req = Req(
            rid=f"req-{self._next_rid}",
            origin_input_text="",
            origin_input_ids=array("q", input_ids),
            sampling_params=SamplingParams(
                temperature=0, max_new_tokens=max(1, len(output_ids))
            ),
        )
        self._next_rid += 1
        req.output_ids = array("q", output_ids)
        req.full_untruncated_fill_ids = array("q", [*input_ids, *output_ids])
        return req

    def match(self, req: Req, *, cow: bool = True) -> MatchResult:
        """Admission match of at most len(prompt) - 1 tokens: one token is always computed."""
        key = RadixKey(array("q", req.origin_input_ids[:-1]))
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
        pool = self.t.req_to_token_pool
        if not ensure_mamba_capacity(pool, [req], self.cache):
            self._give_back(req)
            raise KVExhausted("no live state slot free: too many requests in flight")
        pool.alloc([req])
        prefix = self.cache.path_device_indices(result.last_device_node)[: req.prefix_len]
        total = len(req.full_untruncated_fill_ids)
        need = total - req.prefix_len
        if self.t.allocator.available_size() < need:
            self.cache.evict(EvictParams(num_tokens=need - self.t.allocator.available_size()))
        new_kv = self.t.allocator.alloc(need)
        if new_kv is None:
            self._give_back(req)
            raise KVExhausted(
                f"KV pool exhausted: {need} tokens asked, "
                f"{self.t.allocator.available_size()} free after eviction"
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
        pool = self.t.req_to_token_pool
        if req.kv.holds_kv:
            pool.free_mamba_cache(req)
            pool.free(req)
        elif req.kv.holds_mamba:
            pool.mamba_allocator.free(req.kv.mamba_pool_idx.view(1))
            req.kv.mamba_pool_idx = None
        req.kv.mamba_cow_src_index = None

    def run_copy_on_write(self, req: Req) -> None:
        """The restore ModelRunner runs on the forward stream before the request's forward."""
        src = req.kv.mamba_cow_src_index
        if src is None:
            return
        pool = self.t.req_to_token_pool
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

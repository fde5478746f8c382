"""The real SGLang tree cache outside a server: CPU pools and the registry-built cache.

The replay, the CPU reference engine, the benchmarks and the tests all need the cache exactly
as a scheduler builds it, without a model server. ``build_tree_cache`` allocates SGLang's own
pools (``HybridReqToTokenPool`` with its ``MambaPool``, ``HybridLinearKVPool``,
``TokenToKVPoolAllocator``) and asks ``registry.create_tree_cache`` for the backend, so
``semantic`` is reached through ``--radix-cache-backend`` and built by the plugin's own factory,
planning included, like in a server. ``hybrid_pool_spec`` is the one way to describe the
pools; ``harness/lifecycle.py`` drives requests through the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence
from unittest import mock

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from sglang_hybrid.cache.planning import CheckpointPlanning
from sglang_hybrid.config import SemanticCacheConfig
from sglang_hybrid.kernels import GDN_CHUNK_SIZE
from sglang_hybrid.plugin import BACKEND_NAME, register, semantic_state_cache


@dataclass(frozen=True)
class HybridPoolSpec:
    """Sizes of the pools a hybrid model needs (build one with ``hybrid_pool_spec``)."""

    cache_params: Mamba2CacheParams
    full_attention_layer_ids: tuple[int, ...]
    kv_head_num: int
    kv_head_dim: int
    kv_dtype: torch.dtype
    kv_size: int
    max_num_reqs: int
    max_context_len: int
    device: str = "cpu"

    @property
    def mamba_layer_ids(self) -> list[int]:
        return list(self.cache_params.layers)


def hybrid_pool_spec(
    *,
    recurrent_layers: Sequence[int],
    attention_layers: Sequence[int],
    intermediate_size: int,
    num_heads: int,
    head_dim: int,
    state_size: int,
    conv_kernel: int,
    n_groups: int = 1,
    conv_shard_groups: Optional[Sequence[int]] = None,
    conv_dtype: torch.dtype = torch.float32,
    temporal_dtype: torch.dtype = torch.float32,
    kv_head_num: int = 1,
    kv_head_dim: int,
    kv_dtype: torch.dtype = torch.float32,
    kv_size: int,
    max_num_reqs: int,
    max_context_len: int,
) -> HybridPoolSpec:
    """Pools for recurrent layers of the given state shape (as SGLang derives it for one
    tensor-parallel rank, ``Mamba2StateShape.create``) beside attention layers."""
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=intermediate_size,
        n_groups=n_groups,
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=state_size,
        conv_kernel=conv_kernel,
        **({"conv_shard_groups": list(conv_shard_groups)} if conv_shard_groups else {}),
    )
    params = Mamba2CacheParams(
        shape=shape,
        layers=list(recurrent_layers),
        dtype=Mamba2StateDType(conv=conv_dtype, temporal=temporal_dtype),
    )
    return HybridPoolSpec(
        cache_params=params,
        full_attention_layer_ids=tuple(attention_layers),
        kv_head_num=kv_head_num,
        kv_head_dim=kv_head_dim,
        kv_dtype=kv_dtype,
        kv_size=kv_size,
        max_num_reqs=max_num_reqs,
        max_context_len=max_context_len,
    )


@dataclass
class StandaloneTreeCache:
    """A tree cache and the SGLang pools it was built on."""

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
    planning: Optional[CheckpointPlanning] = None,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> StandaloneTreeCache:
    """Allocate the pools of ``spec`` and build the tree cache SGLang selects for ``backend``.

    ``backend`` is a ``--radix-cache-backend`` name ("semantic"), or None for SGLang's
    default selection (the stock ``UnifiedRadixCache``). Both use the Python tree core, so
    they are compared on equal terms (a custom component requires it). ``config`` reaches the
    backend factory the way ``sglang-hybrid launch`` hands it to a scheduler; a test that
    needs a planning of its own passes it as ``planning`` instead of the one the factory
    builds from ``config``. ``tp_group``: the tensor-parallel group (gloo) the cache agrees
    with, as a scheduler gives it its TP CPU group; None: a single rank.
    """
    register()
    server_args = ServerArgs(model_path="dummy", page_size=1, radix_cache_backend=backend)
    server_args._mamba_cache_chunk_size = GDN_CHUNK_SIZE
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
        tp_cache_group=tp_group,
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
        tp_size=1 if tp_group is None else torch.distributed.get_world_size(tp_group),
        tp_rank=0 if tp_group is None else torch.distributed.get_rank(tp_group),
        tp_group=tp_group,
    )
    env = {**config.to_env(), "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    with mock.patch.dict(os.environ, env):
        if planning is None:
            cache = create_tree_cache(ctx)
        else:
            if backend != BACKEND_NAME:
                raise ValueError(f"a planning is given to the {BACKEND_NAME!r} backend only, not {backend!r}")
            cache = semantic_state_cache(ctx, config, planning)
    return StandaloneTreeCache(cache, allocator, req_to_token_pool)

"""Shared helpers for cache tests: a small hybrid layout and fingerprinted recurrent states.

A test stands in for the model by writing, into a request's state slot, a fingerprint of
the exact token prefix the state has consumed. Restoring the wrong checkpoint (wrong node,
wrong slot, stale content) then shows up as a fingerprint mismatch.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

from sglang_hybrid.cache.standalone import (
    HybridPoolSpec,
    SchedulerDriver,
    TreeCacheUnderTest,
    build_tree_cache,
)
from sglang_hybrid.config import SemanticCacheConfig

MAMBA_LAYERS = [0, 1, 2, 4, 5, 6]
FULL_LAYERS = (3, 7)


def small_spec(**overrides) -> HybridPoolSpec:
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2,
        head_dim=8, state_size=8, conv_kernel=4,
    )
    params = Mamba2CacheParams(
        shape=shape,
        layers=MAMBA_LAYERS,
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )
    values = dict(
        cache_params=params, full_attention_layer_ids=FULL_LAYERS,
        kv_head_num=1, kv_head_dim=4, kv_size=8192, max_num_reqs=8, max_context_len=4096,
    )
    values.update(overrides)
    return HybridPoolSpec(**values)


def build(backend: Optional[str], checkpoint_slots: int = 16, **spec_overrides) -> SchedulerDriver:
    t = build_tree_cache(
        backend,
        small_spec(**spec_overrides),
        config=SemanticCacheConfig(state_checkpoint_slots=checkpoint_slots),
    )
    return SchedulerDriver(t)


def fingerprint(tokens: Sequence[int]) -> float:
    digest = hashlib.blake2b(bytes(str(list(tokens)), "ascii"), digest_size=4).digest()
    # Exactly representable in bf16 and fp32, so conv and temporal carry the same value.
    return float(int.from_bytes(digest, "little") % 251 + 1)


def write_live_state(t: TreeCacheUnderTest, slot: torch.Tensor, tokens: Sequence[int]) -> None:
    value = fingerprint(tokens)
    cache = t.mamba_pool.mamba_cache
    for conv in cache.conv:
        conv[:, int(slot)] = value
    cache.temporal[:, int(slot)] = value


def live_state_fingerprint(t: TreeCacheUnderTest, slot: torch.Tensor) -> float:
    cache = t.mamba_pool.mamba_cache
    values = {float(v) for v in cache.temporal[:, int(slot)].unique()}
    for conv in cache.conv:
        values |= {float(v) for v in conv[:, int(slot)].float().unique()}
    assert len(values) == 1, f"state slot {int(slot)} is not one consistent state: {values}"
    return values.pop()


def serve(driver: SchedulerDriver, prompt, output=(), anchors=()):
    """One request end to end: admit, restore, 'compute' (checks the restored state), stage
    checkpoints at ``anchors`` (depths), finish. Returns the match result."""
    t = driver.t
    req = driver.new_request(prompt, output)
    result = driver.admit(req)
    driver.run_copy_on_write(req)
    restored_depth = result.device_prefix_len
    if restored_depth > 0:
        assert live_state_fingerprint(t, req.kv.mamba_pool_idx) == fingerprint(
            req.full_untruncated_fill_ids[:restored_depth]
        ), "restored state does not match the prefix it claims"
    cache = driver.cache
    for depth in anchors:
        if not restored_depth < depth <= len(req.full_untruncated_fill_ids):
            continue
        slot = cache.alloc_checkpoint_slot() if hasattr(cache, "alloc_checkpoint_slot") else None
        if slot is None:
            continue
        write_checkpoint_slot(t, slot, req.full_untruncated_fill_ids[:depth])
        cache.stage_checkpoint(req, depth, slot)
    write_live_state(t, req.kv.mamba_pool_idx, req.full_untruncated_fill_ids)
    driver.finish(req)
    return result


def write_checkpoint_slot(t: TreeCacheUnderTest, slot: torch.Tensor, tokens) -> None:
    pool = t.req_to_token_pool.mamba_ckpt_pool
    value = fingerprint(tokens)
    for conv in pool.conv:
        conv[:, int(slot)] = value
    pool.temporal[:, int(slot)] = value


def build_tiered(device_slots: int, host_slots: int, **spec_overrides) -> SchedulerDriver:
    t = build_tree_cache(
        "semantic",
        small_spec(**spec_overrides),
        config=SemanticCacheConfig(
            state_checkpoint_slots=device_slots, state_checkpoint_host_slots=host_slots
        ),
    )
    return SchedulerDriver(t)


def tree_nodes(cache) -> list:
    """Every node of the cache's tree but the root."""
    stack, out = [cache.tree_core.root_node], []
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None:
            out.append(node)
    return out

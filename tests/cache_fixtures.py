"""Shared helpers for cache tests: a small hybrid layout and fingerprinted recurrent states.

A test stands in for the model by writing, into a request's state slot, a fingerprint of
the exact token prefix the state has consumed. Restoring the wrong checkpoint (wrong node,
wrong slot, stale content) then shows up as a fingerprint mismatch. Requests go through the
server's lifecycle (``RequestLifecycle``); checkpoints are staged where a request's hint asks
(planner ``none``, eviction by recency).
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import numpy as np
import torch

from sglang_hybrid.anchors.detector import NO_ANCHORS
from sglang_hybrid.cache.planning import CheckpointId, Tier
from sglang_hybrid.cache.semantic_cache import SemanticStateCache
from sglang_hybrid.config import SemanticCacheConfig
from sglang_hybrid.harness.lifecycle import RequestLifecycle
from sglang_hybrid.harness.pools import HybridPoolSpec, StandaloneTreeCache, build_tree_cache, hybrid_pool_spec

MAMBA_LAYERS = [0, 1, 2, 4, 5, 6]
FULL_LAYERS = (3, 7)


def small_spec(**overrides) -> HybridPoolSpec:
    values = dict(
        recurrent_layers=MAMBA_LAYERS, attention_layers=FULL_LAYERS,
        intermediate_size=32, num_heads=2, head_dim=8, state_size=8, conv_kernel=4,
        conv_dtype=torch.bfloat16, kv_head_dim=4, kv_size=8192, max_num_reqs=8, max_context_len=4096,
    )
    values.update(overrides)
    return hybrid_pool_spec(**values)


class ValueByDepth:
    """A ``CheckpointPlanning`` that plans nothing, values a checkpoint by its depth (deeper is
    worth more) and records the moves and evictions it is told of."""

    evicts_by_value = True

    def __init__(self):
        self.moves: list[tuple[CheckpointId, CheckpointId]] = []
        self.evictions: list[CheckpointId] = []
        self.depths: dict[CheckpointId, int] = {}  # the generation-end checkpoints held

    def plan(self, request):
        return []

    def staged(self, rid, depth, checkpoint):
        raise AssertionError("nothing was planned")

    def value(self, checkpoint, depth):
        return float(depth)

    def device_values(self, num_slots):
        values = np.zeros(num_slots)
        for checkpoint, depth in self.depths.items():
            if checkpoint.tier is Tier.DEVICE:
                values[checkpoint.slot] = depth
        return values

    def moved(self, old, new):
        self.moves.append((old, new))
        self.depths[new] = self.depths.pop(old)

    def evicted(self, checkpoint):
        self.evictions.append(checkpoint)
        self.depths.pop(checkpoint)

    def finished(self, rid, cached, prompt_len, end, free):
        if end is not None:
            self.depths[end] = len(cached)
        for checkpoint in free:
            self.depths.pop(checkpoint, None)

    def released(self, rid):
        pass


def build_tiered(device_slots: int, host_slots: int, planning=None, **spec_overrides) -> RequestLifecycle:
    """The semantic cache; its planning stages what hints ask and evicts by recency, unless
    ``planning`` is given."""
    config = SemanticCacheConfig(
        state_checkpoint_slots=device_slots,
        state_checkpoint_host_slots=host_slots,
        checkpoint_planner="none",
        anchor_template_family=NO_ANCHORS,
    )
    return RequestLifecycle(
        build_tree_cache("semantic", small_spec(**spec_overrides), config=config, planning=planning)
    )


def build(backend: Optional[str], checkpoint_slots: int = 16, planning=None, **spec_overrides) -> RequestLifecycle:
    if backend is None:
        return RequestLifecycle(build_tree_cache(None, small_spec(**spec_overrides)))
    return build_tiered(checkpoint_slots, 0, planning, **spec_overrides)


def fingerprint(tokens: Sequence[int]) -> float:
    digest = hashlib.blake2b(bytes(str(list(tokens)), "ascii"), digest_size=4).digest()
    # Exactly representable in bf16 and fp32, so conv and temporal carry the same value.
    return float(int.from_bytes(digest, "little") % 251 + 1)


def write_live_state(tree: StandaloneTreeCache, slot: torch.Tensor, tokens: Sequence[int]) -> None:
    value = fingerprint(tokens)
    cache = tree.mamba_pool.mamba_cache
    for conv in cache.conv:
        conv[:, int(slot)] = value
    cache.temporal[:, int(slot)] = value


def live_state_fingerprint(tree: StandaloneTreeCache, slot: torch.Tensor) -> float:
    cache = tree.mamba_pool.mamba_cache
    values = {float(v) for v in cache.temporal[:, int(slot)].unique()}
    for conv in cache.conv:
        values |= {float(v) for v in conv[:, int(slot)].float().unique()}
    assert len(values) == 1, f"state slot {int(slot)} is not one consistent state: {values}"
    return values.pop()


def serve(driver: RequestLifecycle, prompt, output=(), anchors=()):
    """One request end to end: admit, start (restore, stage checkpoints at the prompt
    depths ``anchors``, its hint), 'compute' (checks the restored state, writes the staged
    ones), finish. Returns the match result."""
    tree = driver.tree
    req = driver.new_request(prompt, output, hint=sorted(set(anchors)) or None)
    result = driver.admit(req)
    driver.start([req])
    restored_depth = result.device_prefix_len
    if restored_depth > 0:
        assert live_state_fingerprint(tree, req.kv.mamba_pool_idx) == fingerprint(
            req.full_untruncated_fill_ids[:restored_depth]
        ), "restored state does not match the prefix it claims"
    if isinstance(driver.cache, SemanticStateCache):
        for depth, checkpoint in driver.cache.staged_checkpoints(req):
            write_checkpoint_slot(tree, checkpoint.slot, req.full_untruncated_fill_ids[:depth])
    write_live_state(tree, req.kv.mamba_pool_idx, req.full_untruncated_fill_ids)
    driver.finish(req)
    return result


def write_checkpoint_slot(tree: StandaloneTreeCache, slot: torch.Tensor, tokens) -> None:
    pool = tree.req_to_token_pool.mamba_ckpt_pool
    value = fingerprint(tokens)
    for conv in pool.conv:
        conv[:, int(slot)] = value
    pool.temporal[:, int(slot)] = value



def tree_nodes(cache) -> list:
    """Every node of the cache's tree but the root."""
    stack, out = [cache.tree_core.root_node], []
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None:
            out.append(node)
    return out

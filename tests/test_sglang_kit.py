"""SGLang's own unified-radix-cache test kit (shipped in the sglang wheel) drives the same
scenarios against the stock cache and the ``semantic`` backend.

Pools come from the kit's ``build_fixture`` for each FULL+MAMBA config of its ``CONFIGS``;
requests come from the kit's fixture mixin (``_make_inflight_req``: KV committed in the
request's own slots, not yet in the tree); the caches come from ``registry.create_tree_cache``.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.kits.unified_radix_cache import fixtures as kit_fixtures
from sglang.test.kits.unified_radix_cache.config import CONFIGS
from sglang.test.kits.unified_radix_cache.fixtures import match_prefix
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

from sglang_hybrid.config import SemanticCacheConfig
from sglang_hybrid.plugin import register

MAMBA_CONFIGS = [cfg for cfg in CONFIGS if cfg.has_mamba and not cfg.has_swa]
BACKENDS = [None, "semantic"]


def kit_cache(cfg, backend):
    register()
    with mock.patch.object(kit_fixtures, "get_device", return_value="cpu"):
        _, allocator, req_to_token_pool = kit_fixtures.build_fixture(cfg)
    server_args = ServerArgs(model_path="dummy", page_size=cfg.page_size, radix_cache_backend=backend)
    server_args._mamba_cache_chunk_size = max(kit_fixtures.FLA_CHUNK_SIZE, cfg.page_size)
    set_global_server_args_for_scheduler(server_args)
    params = CacheInitParams(
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=cfg.page_size,
        disable=False,
        enable_mamba_extra_buffer=cfg.enable_mamba_extra_buffer,
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
        enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
        model_config=None, tp_size=1, tp_rank=0, tp_group=None,
    )
    env = {**SemanticCacheConfig(state_checkpoint_slots=8).to_env(),
           "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    with mock.patch.dict(os.environ, env):
        cache = create_tree_cache(ctx)
    return cache, allocator, req_to_token_pool


class Steps(UnifiedRadixCacheFixtures):
    """The kit's shared steps, bound to one config."""

    def __init__(self, cfg):
        self.cfg = cfg


def finish_into_tree(steps, cache, allocator, pool, input_ids, output_ids):
    req, _ = steps._make_inflight_req(cache, allocator, pool, input_ids, output_ids, allocated=True)
    req.finished_reason = FINISH_LENGTH(length=len(output_ids))
    release_kv_cache(req, cache, checkpoint=True)
    return req


@pytest.mark.parametrize("cfg", MAMBA_CONFIGS, ids=lambda c: c.label)
@pytest.mark.parametrize("backend", BACKENDS, ids=["stock", "semantic"])
def test_kit_finished_request_then_continuation(cfg, backend):
    if backend == "semantic" and cfg.page_size != 1:
        # Where semantic must differ: it refuses paged / extra-buffer configurations with a
        # clear error instead of rounding its anchor positions to a page grid.
        with pytest.raises(ValueError, match="no_buffer and --page-size 1"):
            kit_cache(cfg, backend)
        return
    if cfg.page_size != 1:
        pytest.skip("the kit's in-flight request carries no ping-pong track state")
    steps = Steps(cfg)
    cache, allocator, pool = kit_cache(cfg, backend)
    prompt = steps._make_seq(100, 12)
    output = steps._make_seq(900, 3)
    finish_into_tree(steps, cache, allocator, pool, prompt, output)
    hit = match_prefix(cache, prompt + output + [1, 2, 3])
    assert hit.device_prefix_len == len(prompt) + len(output)
    branch = match_prefix(cache, prompt[:6] + [7] * 6)
    assert branch.full_kv_hit_length == 6 and branch.device_prefix_len == 0
    cache.sanity_check()


@pytest.mark.parametrize("backend", BACKENDS, ids=["stock", "semantic"])
def test_kit_path_chain_and_eviction_accounting(backend):
    (cfg,) = [c for c in MAMBA_CONFIGS if c.page_size == 1]
    steps = Steps(cfg)
    cache, allocator, pool = kit_cache(cfg, backend)
    free_kv = allocator.available_size()
    seqs = [steps._make_seq(1000 * (i + 1), 8) for i in range(4)]
    for seq in seqs:
        finish_into_tree(steps, cache, allocator, pool, seq, [5])
    node = cache.tree_core.node_by_id(match_prefix(cache, seqs[0] + [5, 1]).last_device_node)
    depth = 0
    while node.parent is not None:
        depth, node = depth + len(node.key), node.parent
    assert depth == 9
    cache.evict(EvictParams(num_tokens=10_000))
    assert allocator.available_size() == free_kv
    assert pool.mamba_allocator.available_size() == pool.mamba_allocator.size
    if backend == "semantic":
        assert cache.checkpoint_pool.used_size() == 0
    cache.sanity_check()

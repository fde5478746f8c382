"""Bad input and concurrency at the cache: a clear error or a graceful fallback, nothing lost."""

from __future__ import annotations

from array import array

import pytest
import torch

from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool, StateLayout
from sglang_hybrid.harness.lifecycle import KVExhausted, RequestLifecycle
from sglang_hybrid.harness.pools import build_tree_cache
from sglang_hybrid.config import CONFIG_ENV_VAR, SemanticCacheConfig

from cache_fixtures import (
    build, fingerprint, live_state_fingerprint, serve, small_spec, tree_nodes, write_checkpoint_slot, write_live_state,
)
from test_semantic_cache import assert_slot_accounting

MAMBA = ComponentType.MAMBA


def idle(driver) -> bool:
    pool = driver.tree.req_to_token_pool
    return (
        pool.mamba_allocator.available_size() == pool.mamba_allocator.size
        and driver.cache.staged_slots() == 0
    )


def test_empty_prompt_is_refused_before_touching_the_cache():
    driver = build("semantic")
    with pytest.raises(ValueError, match="at least one prompt token"):
        driver.new_request([])
    assert idle(driver)


def test_one_token_prompt_matches_nothing_and_caches_its_end():
    driver = build("semantic")
    assert serve(driver, [42], [7]).device_prefix_len == 0
    assert serve(driver, [42], [7]).device_prefix_len == 0  # len-1 = 0 tokens may be matched
    assert serve(driver, [42, 7, 9], [1]).device_prefix_len == 2
    assert_slot_accounting(driver)
    assert idle(driver)


def test_prompt_longer_than_the_kv_pool_is_refused_without_leaking():
    driver = build("semantic", kv_size=256)
    serve(driver, list(range(100, 200)), [1], anchors=[50])
    before = driver.cache.checkpoint_pool.used_size()
    with pytest.raises(KVExhausted, match="KV pool exhausted"):
        driver.admit(driver.new_request(list(range(1000, 1400)), [1]))
    assert idle(driver)
    assert driver.cache.checkpoint_pool.used_size() <= before
    assert_slot_accounting(driver)


@pytest.mark.parametrize("foreign", ["live request slot", "free checkpoint slot", "past the pool"])
def test_insert_refuses_a_value_that_is_not_a_slot_taken_from_the_checkpoint_pool(foreign):
    # SGLang's own unified-radix-cache tests insert a live request's slot as the MAMBA value;
    # stored as a checkpoint, it would be read as one and freed into the wrong pool.
    driver = build("semantic", checkpoint_slots=4)
    serve(driver, list(range(100, 120)), [1])
    (held,) = [n.component_data[MAMBA].value for n in tree_nodes(driver.cache) if n.component_data[MAMBA].value is not None]
    value = {
        "live request slot": driver.tree.req_to_token_pool.mamba_allocator.alloc(1),
        "free checkpoint slot": torch.tensor([int(driver.cache.checkpoint_pool.free_slot_ids()[0])]),
        "past the pool": torch.tensor([driver.cache.checkpoint_pool.num_slots + 1]),
    }[foreign]
    assert int(value) != int(held)
    tokens = list(range(500, 508))
    kv = driver.tree.allocator.alloc(len(tokens))
    before = driver.cache.total_size()
    with pytest.raises(ValueError, match="not a slot taken from the checkpoint pool"):
        driver.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=kv, mamba_value=value))
    assert driver.cache.total_size() == before
    assert driver.cache.checkpoints_on_path(tokens) == (0, [])
    assert_slot_accounting(driver)


def test_stage_at_depth_zero_is_an_error_and_frees_the_slot():
    driver = build("semantic", checkpoint_slots=2)
    req = driver.new_request(list(range(10, 30)), [1])
    driver.admit(req)
    slot = driver.cache.alloc_checkpoint_slot()
    with pytest.raises(ValueError, match="depth must be positive"):
        driver.cache.stage_checkpoint(req, 0, slot)
    assert driver.cache.checkpoint_pool.used_size() == 0
    driver.abort(req)
    assert idle(driver)


def test_staged_checkpoint_past_the_inserted_length_is_freed_on_release():
    # A capture for a depth the request never inserts (truncated output, early stop) must
    # not stay attached to the request or leak its slot.
    driver = build("semantic", checkpoint_slots=3)
    req = driver.new_request(list(range(10, 30)), [1, 2])
    driver.admit(req)
    slot = driver.cache.alloc_checkpoint_slot()
    write_checkpoint_slot(driver.tree, slot, list(range(500)))
    driver.cache.stage_checkpoint(req, 500, slot)
    write_live_state(driver.tree, req.kv.mamba_pool_idx, req.full_untruncated_fill_ids)
    driver.finish(req)
    assert driver.cache.staged_slots() == 0
    assert_slot_accounting(driver)


def test_pool_smaller_than_one_requests_plan_keeps_what_fits():
    driver = build("semantic", checkpoint_slots=1)
    prompt = list(range(100, 200))
    serve(driver, prompt, [1], anchors=[10, 30, 50, 70, 99])
    stats = driver.cache.stats
    # Staging stops at the first depth no slot is left for; the end state finds none either.
    assert stats.taken == 1 and stats.exhausted == 2
    assert_slot_accounting(driver)
    assert idle(driver)


def test_config_rejects_bad_values_with_the_flag_name():
    with pytest.raises(ValueError, match="--state-checkpoint-slots must be >= 0"):
        SemanticCacheConfig(state_checkpoint_slots=-1)
    with pytest.raises(ValueError, match="either --state-checkpoint-slots or --state-checkpoint-memory-gib"):
        SemanticCacheConfig(state_checkpoint_slots=4, state_checkpoint_memory_gib=1.0)
    with pytest.raises(ValueError, match="not valid JSON"):
        SemanticCacheConfig.from_env({CONFIG_ENV_VAR: "{slots: 3"})
    with pytest.raises(ValueError, match="unknown fields"):
        SemanticCacheConfig.from_env({CONFIG_ENV_VAR: '{"slots": 3}'})


def test_memory_budget_sizes_the_pool():
    layout = StateLayout(
        num_layers=2, conv_shapes=((8, 3),), conv_dtypes=(torch.bfloat16,),
        temporal_shape=(2, 4, 4), temporal_dtype=torch.float32,
    )
    assert layout.bytes_per_slot == 2 * (8 * 3 * 2) + 2 * (2 * 4 * 4 * 4)
    config = SemanticCacheConfig(state_checkpoint_memory_gib=layout.bytes_per_slot * 10 / (1 << 30))
    assert config.checkpoint_slots(layout.bytes_per_slot) == 10
    with pytest.raises(ValueError, match="must be >= 0"):
        StateCheckpointPool(layout, -1, "cpu")


def test_many_requests_restore_from_one_checkpoint_which_is_never_written():
    driver = build("semantic", checkpoint_slots=4, max_num_reqs=6)
    base = list(range(300, 360))
    serve(driver, base, [1], anchors=[len(base)])
    pool = driver.cache.checkpoint_pool
    snapshot = [c.clone() for c in pool.conv], pool.temporal.clone()
    readers = []
    for i in range(5):  # all admitted before any finishes: they share the source checkpoint
        req = driver.new_request(base + [1, 900 + i, 901 + i], [2])
        assert driver.admit(req).device_prefix_len == len(base) + 1
        readers.append(req)
    for req in readers:
        driver.start([req])
    for i, req in enumerate(readers):
        assert live_state_fingerprint(driver.tree, req.kv.mamba_pool_idx) == fingerprint(base + [1])
        write_live_state(driver.tree, req.kv.mamba_pool_idx, [7000 + i])  # each moves on alone
    for req in readers:
        assert live_state_fingerprint(driver.tree, req.kv.mamba_pool_idx) != fingerprint(base + [1])
    assert torch.equal(pool.temporal, snapshot[1])
    assert all(torch.equal(a, b) for a, b in zip(pool.conv, snapshot[0]))
    for req in readers:
        write_live_state(driver.tree, req.kv.mamba_pool_idx, req.full_untruncated_fill_ids)
        driver.finish(req)
    assert_slot_accounting(driver)
    assert idle(driver)


@pytest.mark.parametrize("ending", ["abort", "finish"])
def test_a_request_that_ended_leaves_its_token_arrays_resizable(ending):
    """SGLang's streaming sessions build a turn's request by extending the previous turn's
    token arrays in place. numpy's view of an ``array("q")`` forbids resizing it while the
    view lives, so the planning must keep none of a request's arrays once it ended, aborted
    included: else the next turn would fail on the scheduler thread."""
    config = SemanticCacheConfig(state_checkpoint_slots=16, anchor_template_family="chatml")
    driver = RequestLifecycle(build_tree_cache("semantic", small_spec(), config=config))
    req = driver.new_request(list(range(300, 340)), [900, 901], session="agent")
    driver.admit(req)
    driver.start([req])
    getattr(driver, ending)(req)
    for ids in (req.origin_input_ids, req.full_untruncated_fill_ids):
        del ids[len(ids) - 1:]
        ids.extend([7, 8])

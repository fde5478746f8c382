"""The host-memory checkpoint tier: demotion, promotion, eviction from both tiers, exactness."""

from __future__ import annotations

from cache_fixtures import ValueByDepth, build_tiered, serve, tree_nodes
from test_semantic_cache import assert_slot_accounting, checkpoint_slots_in_tree

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from sglang_hybrid.cache.planning import CheckpointId

MAMBA = ComponentType.MAMBA


def sessions(n):
    return [[100 + k] * 40 for k in range(n)]


def held(driver, prompt):
    return driver.match(driver.new_request(prompt + [1, 9]), cow=False).device_prefix_len


def assert_tiers_accounted(driver):
    assert_slot_accounting(driver)
    mamba = driver.cache.components[MAMBA]
    tier = driver.cache.checkpoint_pool.host_tier
    host = [int(s) for s in mamba.host_slots.values()]
    assert len(set(host)) == len(host)
    assert not set(host) & set(tier.free_slot_ids())
    assert tier.used_size() == len(host) == len(mamba.host_lru)
    # a node never holds its state in both tiers
    device_nodes = {n.id for n in tree_nodes(driver.cache) if n.component_data[MAMBA].value is not None}
    assert not device_nodes & set(mamba.host_slots)


def test_device_evictions_are_demoted_and_still_matchable():
    driver = build_tiered(device_slots=2, host_slots=8)
    prompts = sessions(5)
    for prompt in prompts:
        serve(driver, prompt, [1])
    stats = driver.cache.stats
    assert stats.demoted == 3 and stats.evicted == 0
    assert [held(driver, p) for p in prompts] == [41] * 5
    assert_tiers_accounted(driver)


def test_host_hit_is_promoted_and_restores_the_exact_state():
    driver = build_tiered(device_slots=2, host_slots=8)
    prompts = sessions(4)
    for prompt in prompts:
        serve(driver, prompt, [1])
    # prompts[0] lives on host now; serve() checks the restored state's fingerprint.
    result = serve(driver, prompts[0] + [1, 5, 5], [2])
    assert result.device_prefix_len == 41
    stats = driver.cache.stats
    assert stats.restored_from_host == 1 and stats.promoted == 1
    assert_tiers_accounted(driver)


def test_host_tier_evicts_its_least_recent_when_full():
    driver = build_tiered(device_slots=1, host_slots=2)
    prompts = sessions(5)
    for prompt in prompts:
        serve(driver, prompt, [1])
    stats = driver.cache.stats
    assert stats.demoted == 4 and stats.host_evicted == 2
    assert [held(driver, p) for p in prompts] == [0, 0, 41, 41, 41]
    assert_tiers_accounted(driver)


def test_kv_eviction_drops_host_copies_with_their_nodes():
    driver = build_tiered(device_slots=1, host_slots=4)
    for prompt in sessions(3):
        serve(driver, prompt, [1])
    driver.cache.evict(EvictParams(num_tokens=10_000))
    assert driver.cache.checkpoint_pool.host_tier.used_size() == 0
    assert checkpoint_slots_in_tree(driver.cache) == []
    assert_tiers_accounted(driver)


def test_promotion_without_a_free_device_slot_restores_straight_from_host():
    driver = build_tiered(device_slots=1, host_slots=4, max_num_reqs=4)
    a, b = sessions(2)
    serve(driver, a, [1])
    serve(driver, b, [1])  # a demoted
    holder = driver.new_request(b + [1, 7, 7], [2])
    driver.admit(holder)  # locks b's device checkpoint: the only device slot is pinned
    result = serve(driver, a + [1, 5], [2])
    assert result.device_prefix_len == 41
    assert driver.cache.stats.restored_from_host == 1
    driver.abort(holder)
    assert_tiers_accounted(driver)


def test_a_valued_host_tier_keeps_what_the_planning_values_most():
    driver = build_tiered(device_slots=1, host_slots=2, planning=ValueByDepth())  # deeper is worth more
    prompts = [[100 + k] * length for k, length in enumerate([60, 20, 50, 30, 40])]
    for prompt in prompts:
        serve(driver, prompt, [1])
    # The 20-token state left the full host tier for the 50-token one; the 30-token victim was
    # worth less than both host checkpoints, so it was dropped rather than demoted.
    stats = driver.cache.stats
    assert (stats.demoted, stats.host_evicted, stats.evicted) == (3, 1, 1)
    assert [held(driver, p) for p in prompts] == [61, 0, 51, 0, 41]
    assert_tiers_accounted(driver)


def test_moves_between_tiers_are_told_to_the_planning_under_each_tier_id():
    planning = ValueByDepth()
    driver = build_tiered(device_slots=1, host_slots=2, planning=planning)
    a, b = sessions(2)
    serve(driver, a, [1])
    [device_slot] = checkpoint_slots_in_tree(driver.cache)
    serve(driver, b, [1])  # a demoted
    [host_slot] = driver.cache.components[MAMBA].host_slots.values()
    assert planning.moves == [(CheckpointId.device(device_slot), CheckpointId.host(host_slot))]
    serve(driver, a + [1, 5], [2])  # b demoted to make room, a promoted into its slot
    [b_host_slot] = driver.cache.components[MAMBA].host_slots.values()
    assert planning.moves[1:] == [
        (CheckpointId.device(device_slot), CheckpointId.host(b_host_slot)),
        (CheckpointId.host(host_slot), CheckpointId.device(device_slot)),
    ]
    assert driver.cache.free_checkpoints() == [CheckpointId.host(host_slot)]

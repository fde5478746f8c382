"""SemanticStateCache through SGLang's own build path, against the stock UnifiedRadixCache."""

from __future__ import annotations

import json
from array import array
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import registered_radix_cache_backends
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from cache_fixtures import ValueByDepth, build, fingerprint, serve, tree_nodes, write_checkpoint_slot, write_live_state
from sglang_hybrid.anchors.detector import AnchorDetector
from sglang_hybrid.anchors.special_tokens import QWEN3_NEWLINE_ID, QWEN3_ROLE_IDS, QWEN3_SPECIAL_IDS
from sglang_hybrid.cache.semantic_cache import SemanticStateCache, _capped, _key_match
from sglang_hybrid.kernels import MIN_CAPTURE_SPACING
from sglang_hybrid.cache.semantic_component import node_depth
from sglang_hybrid.planning.anchor_planning import AnchorPlanning
from sglang_hybrid.planning.planner import CheckpointPlanner
from sglang_hybrid.replay.shared_data import QWEN3_TEMPLATE, SWE_AGENT_TRAJ

MAMBA = ComponentType.MAMBA


def checkpoint_depths(cache) -> list[int]:
    """Depths of every node holding a checkpoint, walking the real tree."""
    return sorted(node_depth(n) for n in tree_nodes(cache) if n.component_data[MAMBA].value is not None)


def checkpoint_slots_in_tree(cache) -> list[int]:
    return [int(n.component_data[MAMBA].value) for n in tree_nodes(cache)
            if n.component_data[MAMBA].value is not None]


def assert_slot_accounting(driver) -> None:
    """No slot both free and used; used = checkpoints in the tree + staged captures."""
    cache = driver.cache
    pool = cache.checkpoint_pool
    in_tree = checkpoint_slots_in_tree(cache)
    free = pool.free_slot_ids()
    assert len(set(in_tree)) == len(in_tree), "a slot is attached to two nodes"
    assert not set(in_tree) & set(free), "a slot is both free and in the tree"
    assert len(free) == len(set(free)), "a slot is twice on the free list"
    assert pool.used_size() == len(in_tree) + cache.staged_slots()
    cache.sanity_check()


# ---- SGLang integration ----


def test_semantic_backend_is_registered_by_sglang_plugin_entry_point():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("sglang_hybrid")]
    ep.load()()
    assert "semantic" in registered_radix_cache_backends()


def test_registry_builds_semantic_cache_with_separate_pool():
    driver = build("semantic", checkpoint_slots=5)
    cache = driver.cache
    assert isinstance(cache, SemanticStateCache)
    assert cache.checkpoint_pool.num_slots == 5
    mamba_cache = driver.tree.mamba_pool.mamba_cache
    assert cache.checkpoint_pool.temporal.shape[2:] == mamba_cache.temporal.shape[2:]
    assert cache.checkpoint_pool.temporal.dtype == mamba_cache.temporal.dtype
    assert [c.dtype for c in cache.checkpoint_pool.conv] == [c.dtype for c in mamba_cache.conv]


@pytest.mark.parametrize("backend", [None, "semantic"])
def test_finished_request_is_reused_by_its_continuation(backend):
    driver = build(backend)
    prompt, output = list(range(1000, 1040)), [5, 6, 7]
    assert serve(driver, prompt, output).device_prefix_len == 0
    follow_up = prompt + output + [9, 9, 9, 9]
    # Both caches keep the state at the end of prompt + output (what KV holds).
    assert serve(driver, follow_up).device_prefix_len == len(prompt) + len(output)
    driver.cache.sanity_check()


@pytest.mark.parametrize("backend", [None, "semantic"])
def test_edit_keeps_kv_prefix_but_restores_only_from_a_state(backend):
    driver = build(backend)
    prompt = list(range(1000, 1060))
    serve(driver, prompt, [1, 2])
    edited = prompt[:30] + [7] * 10 + prompt[40:]
    result = driver.match(driver.new_request(edited), cow=False)
    assert result.full_kv_hit_length == 30  # KV of the common prefix is there...
    assert result.device_prefix_len == 0  # ...but no state exists at or before token 30.
    driver.cache.sanity_check()


@pytest.mark.parametrize("backend", [None, "semantic"])
def test_kv_eviction_drops_the_checkpoint_with_it(backend):
    driver = build(backend)
    serve(driver, list(range(1000, 1040)), [1])
    driver.cache.evict(EvictParams(num_tokens=10_000))
    assert driver.cache.full_evictable_size() == 0
    assert driver.cache.mamba_evictable_size() == 0
    pool = driver.tree.req_to_token_pool
    assert pool.mamba_allocator.available_size() == pool.mamba_allocator.size
    if backend == "semantic":
        assert driver.cache.checkpoint_pool.used_size() == 0
        assert driver.cache.stats.dropped_with_kv == 1
    driver.cache.sanity_check()


def test_identical_repeat_recomputes_one_token_where_stock_recomputes_all():
    # Where semantic must differ: stock SGLang keeps states only at insert ends, and the
    # scheduler matches at most len-1 tokens, so a repeated prompt finds no state (#22935).
    prompt = list(range(1000, 1100))
    stock = build(None)
    serve(stock, prompt, [1, 2])
    assert serve(stock, prompt, [1, 2]).device_prefix_len == 0

    semantic = build("semantic")
    serve(semantic, prompt, [1, 2], anchors=[len(prompt) - 1])
    assert serve(semantic, prompt, [1, 2]).device_prefix_len == len(prompt) - 1
    assert semantic.cache.stats.tokens_recomputed == len(prompt) + 1


def test_checkpoint_eviction_keeps_kv_where_stock_drops_the_leaf():
    # Where semantic must differ: stock evicts a leaf's state by deleting the leaf, KV too;
    # a checkpoint eviction here only frees the slot, the prefix KV stays matchable.
    prompt = list(range(1000, 1040))
    stock = build(None)
    serve(stock, prompt, [1])
    stock.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert stock.match(stock.new_request(prompt + [3]), cow=False).full_kv_hit_length == 0

    semantic = build("semantic")
    serve(semantic, prompt, [1])
    assert semantic.cache.evict_checkpoints(1) == 1
    result = semantic.match(semantic.new_request(prompt + [3]), cow=False)
    assert result.full_kv_hit_length == len(prompt)
    assert result.device_prefix_len == 0
    assert semantic.cache.stats.evicted == 1
    assert_slot_accounting(semantic)


def test_cached_states_never_hold_live_request_slots():
    # Where semantic must differ: the stock tree keeps its states in the live MambaPool, so
    # cached states compete with admission; semantic keeps them in the checkpoint pool.
    prompts = [list(range(1000 * i, 1000 * i + 30)) for i in range(1, 6)]
    stock, semantic = build(None), build("semantic")
    for prompt in prompts:
        serve(stock, prompt, [1])
        serve(semantic, prompt, [1])
    live = lambda d: d.tree.req_to_token_pool.mamba_allocator.available_size()
    full = semantic.tree.req_to_token_pool.mamba_allocator.size
    assert live(stock) == full - len(prompts)
    assert live(semantic) == full
    assert semantic.cache.checkpoint_pool.used_size() == len(prompts)
    # A live-slot shortfall cannot be met by dropping checkpoints: they are left alone.
    semantic.cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=3))
    assert semantic.cache.checkpoint_pool.used_size() == len(prompts)


# ---- checkpoints at anchors ----


def test_staged_checkpoints_attach_at_their_depths_and_serve_a_branch():
    driver = build("semantic")
    system = list(range(500, 560))
    user_a, user_b = [1] * 20, [2] * 25
    serve(driver, system + user_a, [3, 3], anchors=[len(system), len(system) + 16])
    assert checkpoint_depths(driver.cache) == [60, 76, 82]
    result = serve(driver, system + user_b, [4])
    assert result.device_prefix_len == len(system)
    assert_slot_accounting(driver)


def test_pool_of_size_zero_degrades_to_recomputation():
    driver = build("semantic", checkpoint_slots=0)
    prompt = list(range(1000, 1050))
    for _ in range(3):
        assert serve(driver, prompt, [1], anchors=[10, 49]).device_prefix_len == 0
    stats = driver.cache.stats
    assert stats.taken == 0 and stats.exhausted >= 3
    # KV is still cached and shared.
    assert driver.match(driver.new_request(prompt), cow=False).full_kv_hit_length == 49
    assert_slot_accounting(driver)


def test_lru_evicts_least_recently_restored_and_probe_matches_do_not_refresh():
    driver = build("semantic", checkpoint_slots=3)
    a, b, c, d = ([k] * 40 for k in (11, 12, 13, 14))
    for prompt in (a, b, c):
        serve(driver, prompt, [1])
    driver.match(driver.new_request(a + [1, 7]), cow=False)  # a probe does not refresh a
    serve(driver, d, [1])  # needs a slot: a is the least recently restored
    serve(driver, b + [1, 5, 5], [1])  # restores b (refreshed), its end state evicts c
    held = lambda p: driver.match(driver.new_request(p + [1, 9]), cow=False).device_prefix_len
    assert (held(a), held(b), held(c), held(d)) == (0, 41, 0, 41)
    assert driver.cache.stats.evicted == 2
    assert_slot_accounting(driver)


def test_a_planning_that_evicts_by_value_overrides_recency():
    driver = build("semantic", checkpoint_slots=2, planning=ValueByDepth())  # keeps deep states
    deep, shallow = [21] * 200, [22] * 20
    serve(driver, deep, [1])
    serve(driver, shallow, [1])
    serve(driver, [23] * 30, [1])
    assert driver.match(driver.new_request(deep + [1, 4]), cow=False).device_prefix_len == 201
    assert driver.match(driver.new_request(shallow + [1, 4]), cow=False).device_prefix_len == 0


def test_a_request_makes_room_for_its_generation_end_when_it_is_planned():
    """The eviction call at a request's plan frees a slot for the state its finish keeps as
    well: the finish takes that slot without valuing the pool again."""
    driver = build("semantic", checkpoint_slots=2, planning=ValueByDepth())
    serve(driver, [41] * 30, [1])
    serve(driver, [42] * 40, [1])
    calls = []
    evict = driver.cache.evict_checkpoints
    driver.cache.evict_checkpoints = lambda num: calls.append(num) or evict(num)
    req = driver.new_request([43] * 50, [1])
    driver.admit(req)
    driver.start([req])
    assert calls == [1] and driver.cache.checkpoint_pool.available_size() == 1
    write_live_state(driver.tree, req.kv.mamba_pool_idx, req.full_untruncated_fill_ids)
    driver.finish(req)
    assert calls == [1] and driver.cache.checkpoint_pool.available_size() == 0
    # The shallowest went (ValueByDepth), and the new generation end is held.
    assert driver.match(driver.new_request([41] * 30 + [1, 5]), cow=False).device_prefix_len == 0
    assert driver.match(driver.new_request([43] * 50 + [1, 5]), cow=False).device_prefix_len == 51
    assert_slot_accounting(driver)


def test_locked_checkpoint_survives_pressure_until_its_request_finishes():
    driver = build("semantic", checkpoint_slots=2)
    base = [31] * 40
    serve(driver, base, [1])
    holder = driver.new_request(base + [1, 6, 6], [2])
    assert driver.admit(holder).device_prefix_len == 41  # holds a lock on base's node
    for k in (32, 33, 34):
        serve(driver, [k] * 30, [1])
    assert driver.match(driver.new_request(base + [1, 8]), cow=False).device_prefix_len == 41
    driver.start([holder])
    write_live_state(driver.tree, holder.kv.mamba_pool_idx, holder.full_untruncated_fill_ids)
    driver.finish(holder)
    serve(driver, [35] * 30, [1])
    serve(driver, [36] * 30, [1])
    assert driver.match(driver.new_request(base + [1, 8]), cow=False).device_prefix_len == 0
    assert_slot_accounting(driver)


def test_abort_frees_staged_checkpoints_and_live_slot():
    driver = build("semantic", checkpoint_slots=4)
    req = driver.new_request(list(range(100, 160)), [1])
    driver.admit(req)
    for depth in (10, 20):
        slot = driver.cache.alloc_checkpoint_slot()
        write_checkpoint_slot(driver.tree, slot, req.full_untruncated_fill_ids[:depth])
        driver.cache.stage_checkpoint(req, depth, slot)
    assert driver.cache.checkpoint_pool.used_size() == 2
    driver.abort(req)
    assert driver.cache.checkpoint_pool.used_size() == 0
    pool = driver.tree.req_to_token_pool
    assert pool.mamba_allocator.available_size() == pool.mamba_allocator.size
    assert_slot_accounting(driver)


def test_restored_state_is_a_copy_the_checkpoint_is_never_written():
    driver = build("semantic")
    base = list(range(100, 150))
    serve(driver, base, [1])
    (slot,) = checkpoint_slots_in_tree(driver.cache)
    before = driver.cache.checkpoint_pool.temporal[:, slot].clone()
    req = driver.new_request(base + [1, 2, 3], [4])
    driver.admit(req)
    driver.start([req])
    write_live_state(driver.tree, req.kv.mamba_pool_idx, [999])  # the request moves on
    assert torch.equal(driver.cache.checkpoint_pool.temporal[:, slot], before)
    assert before.flatten()[0].item() == fingerprint(base + [1])


# ---- real agent traces ----


@pytest.fixture(scope="module")
def swe_agent_prompts():
    from sglang_hybrid.replay.rendering import qwen3_encode, render_chat

    traj = json.loads(SWE_AGENT_TRAJ.read_text())
    prompts = []
    for step in traj["trajectory"]:
        prompt = qwen3_encode(render_chat(step["messages"], template_path=QWEN3_TEMPLATE))
        output = qwen3_encode(step["response"])[:16]
        prompts.append((prompt, output))
    return prompts


@pytest.mark.skipif(not SWE_AGENT_TRAJ.exists(), reason="../shared/data not present")
def test_edit_then_match_on_swe_agent_trace_restores_deepest_checkpoint_before_divergence(
    swe_agent_prompts,
):
    from sglang_hybrid.anchors.detector import AnchorDetector

    detector = AnchorDetector.for_family("chatml")
    driver = build("semantic", checkpoint_slots=4096, kv_size=1 << 19, max_context_len=1 << 16)
    history: list[tuple[list[int], list[int]]] = []  # (sequence, checkpoint depths) served
    for prompt, output in swe_agent_prompts:
        anchors = []  # every detected anchor, spaced as the planning spaces checkpoints
        for position in [*np.unique(detector.detect(prompt).positions), len(prompt) - 1]:
            if 0 < position < len(prompt) and (not anchors or position - anchors[-1] >= MIN_CAPTURE_SPACING):
                anchors.append(int(position))
        expected = 0
        for sequence, depths in history:
            lcp = next((i for i, (x, y) in enumerate(zip(sequence, prompt)) if x != y), min(len(sequence), len(prompt)))
            usable = [d for d in depths if d <= min(lcp, len(prompt) - 1)]
            expected = max([expected, *usable])
        result = serve(driver, prompt, output, anchors=anchors)
        assert result.device_prefix_len == expected
        full = prompt + output
        history.append((full, sorted(set(anchors) | {len(full)})))
        assert_slot_accounting(driver)
    stats = driver.cache.stats
    assert stats.restored == len(swe_agent_prompts) - 1
    assert stats.tokens_restored + stats.tokens_recomputed == sum(len(p) for p, _ in swe_agent_prompts)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), page=st.sampled_from([1, 2, 4]), capped=st.booleans())
def test_tree_walk_compares_a_node_key_as_sglang_does(data, page, capped):
    """The tree walks' compare of a node's key with a request's tokens at an offset gives
    SGLang's ``match_at``: the same length, rounded down to the page, on keys that agree for
    any share of the node, including none, all of it, and tokens that end inside it."""
    tokens = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=40))
    offset = data.draw(st.integers(0, len(tokens)))
    node = tokens[offset:offset + data.draw(st.integers(0, len(tokens) - offset))]
    node += data.draw(st.lists(st.integers(0, 3), max_size=6))
    node = node or [0]
    limit = data.draw(st.integers(offset, len(tokens))) if capped else None
    key = RadixKey(array("q", tokens), limit=limit)
    view = np.array(tokens[:limit], dtype=np.int64)
    node_key = RadixKey(array("q", node))
    assert _key_match(node_key, key, view, offset, page) == node_key.match_at(key, offset, page)


@pytest.mark.parametrize("bigram", [False, True])
@pytest.mark.parametrize("extra_key", [None, "lora-a"])
def test_a_split_reads_the_same_child_keys_from_a_capped_key(bigram, extra_key):
    """The attach walk hands SGLang's split a node's key capped a page past the split: the
    child keys the split reads from it (the first page, the page past the split) are the
    whole key's, bigrams and namespaced keys included."""
    key = RadixKey(array("q", range(100, 140)), extra_key, is_bigram=bigram)
    for split in range(1, len(key) - 1):
        capped = _capped(key, split + 1)
        assert capped.child_key(1) == key.child_key(1)
        assert capped[split:].child_key(1) == key[split:].child_key(1)
        assert len(capped[split:]) == 1


def test_lookups_read_the_tree_in_the_requests_namespace():
    """A request with a LoRA adapter (``extra_key``) or a cache salt has its tree path under
    that namespace: the planning hears of its generation-end checkpoint, a lookup finds its
    prefix there and only there, and the next request in that namespace restores from it."""
    planning = ValueByDepth()
    driver = build("semantic", planning=planning)
    prompt, output = list(range(300, 340)), list(range(900, 904))
    req = driver.new_request(prompt, output)
    req.extra_key, req.cache_salt = "lora-a", "salt"
    driver.admit(req)
    driver.start([req])
    driver.finish(req)
    (end, depth), = planning.depths.items()
    cached = (prompt + output)[:depth]
    assert depth > len(prompt)
    assert driver.cache.checkpoints_on_path(cached, "lora-a", "salt") == (depth, [(depth, end)])
    assert driver.cache.checkpoints_on_path(cached) == (0, [])
    again = driver.new_request(cached + [7], [8])
    again.extra_key, again.cache_salt = "lora-a", "salt"
    assert driver.admit(again).device_prefix_len == depth


@pytest.mark.parametrize("namespace", [("lora-a", None), (None, "tenant-b"), ("lora-a", "tenant-b")])
def test_a_session_follows_only_prompts_sent_in_its_own_namespace(namespace):
    """Trials of one task send the same prompts; the planner takes a later trial to follow
    the first, and values the first's checkpoints for it. A trial under another LoRA adapter
    or cache salt shares no tree path with the first, so can restore from none of its
    checkpoints: it follows nobody."""
    im_start, im_end = QWEN3_SPECIAL_IDS["<|im_start|>"], QWEN3_SPECIAL_IDS["<|im_end|>"]
    prompt = [token for role, content in (("system", range(2000, 2040)), ("user", range(3000, 3030)),
                                          ("assistant", range(4000, 4020)), ("user", range(5000, 5030)))
              for token in (im_start, QWEN3_ROLE_IDS[role], QWEN3_NEWLINE_ID, *content, im_end, QWEN3_NEWLINE_ID)]
    prompt += [im_start, QWEN3_ROLE_IDS["assistant"], QWEN3_NEWLINE_ID]
    planning = AnchorPlanning(AnchorDetector.for_family("chatml"), "adaptive", CheckpointPlanner())
    driver = build("semantic", planning=planning)

    def trial(session: str, extra_key, cache_salt) -> None:
        req = driver.new_request(prompt, [6000, im_end], session=session)
        req.extra_key, req.cache_salt = extra_key, cache_salt
        driver.admit(req)
        driver.start([req])
        driver.finish(req)

    trial("first", None, None)
    trial("elsewhere", *namespace)
    trial("second", None, None)
    trial("elsewhere-second", *namespace)
    sessions = planning.planner.sessions
    assert sessions["second"].following.leader == "first"
    assert sessions["elsewhere"].following is None
    assert sessions["elsewhere-second"].following.leader == "elsewhere"

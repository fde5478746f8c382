"""Anchor capture inside SGLang's own Gated DeltaNet extend path, on CPU.

``GDNAttnBackend.forward_extend`` (SGLang's code: convolution, gating, the chunked-scan
kernel call; the scan itself is our CPU fallback, Triton kernels run interpreted) serves a
ragged batch of two requests, one of them continuing from a restored checkpoint, with the
plugin's hooks applied; the requests go through the server's lifecycle (``RequestLifecycle``).
The states the forward captured at the requested anchors, attached to the tree by the real
cache, must equal the states of separate prefills that stop at those anchors, run through the
same backend.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend, GDNKernelDispatcher
from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_hybrid.anchors.detector import NO_ANCHORS, AnchorDetector, AnchorKind
from sglang_hybrid.cache.planning import CheckpointId
from sglang_hybrid.config import SemanticCacheConfig
from sglang_hybrid.harness.lifecycle import RequestLifecycle
from sglang_hybrid.harness.pools import HybridPoolSpec, build_tree_cache, hybrid_pool_spec
from sglang_hybrid.kernels import MIN_CAPTURE_SPACING
from sglang_hybrid.runtime.anchor_capture import queries_for_forward

NUM_K_HEADS, NUM_V_HEADS, HEAD_K, HEAD_V, CONV_KERNEL = 2, 4, 16, 16, 4
KEY_DIM, VALUE_DIM = NUM_K_HEADS * HEAD_K, NUM_V_HEADS * HEAD_V
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
GDN_LAYER_ID = 0


@pytest.fixture(scope="module", autouse=True)
def hooks_applied():
    from sglang_hybrid.plugin import register

    register()
    HookRegistry.apply_hooks()


def _spec() -> HybridPoolSpec:
    return hybrid_pool_spec(
        recurrent_layers=[GDN_LAYER_ID], attention_layers=[1],
        intermediate_size=VALUE_DIM, n_groups=NUM_K_HEADS, num_heads=NUM_V_HEADS,
        head_dim=HEAD_V, state_size=HEAD_K, conv_kernel=CONV_KERNEL,
        conv_shard_groups=[KEY_DIM, KEY_DIM, VALUE_DIM],
        kv_head_dim=4, kv_size=4096, max_num_reqs=6, max_context_len=1024,
    )  # fmt: skip


def _layer(generator: torch.Generator) -> SimpleNamespace:
    """The attributes of SGLang's RadixLinearAttention that the GDN backend reads."""
    return SimpleNamespace(
        layer_id=GDN_LAYER_ID,
        conv_weights=torch.randn(CONV_DIM, CONV_KERNEL, generator=generator) * 0.5,
        bias=None,
        activation="silu",
        A_log=torch.randn(NUM_V_HEADS, generator=generator) * 0.5,
        dt_bias=torch.randn(NUM_V_HEADS, generator=generator) * 0.5,
        q_dim=KEY_DIM, k_dim=KEY_DIM, v_dim=VALUE_DIM,
        num_q_heads=NUM_K_HEADS, num_k_heads=NUM_K_HEADS, num_v_heads=NUM_V_HEADS,
        head_q_dim=HEAD_K, head_k_dim=HEAD_K, head_v_dim=HEAD_V,
    )  # fmt: skip


def _backend(req_to_token_pool) -> GDNAttnBackend:
    """SGLang's GDN backend without a model runner: the state the extend path reads."""
    backend = object.__new__(GDNAttnBackend)
    backend.req_to_token_pool = req_to_token_pool
    backend.mis_metadata = None
    backend._use_strided_target_verify_qkv = False
    dispatcher = object.__new__(GDNKernelDispatcher)
    dispatcher.extend_kernel = TritonGDNKernel()
    backend.kernel_dispatcher = dispatcher
    return backend


def _extend(backend, layer, live_slots, prefix_lens, inputs):
    """One prefill forward of sequences ``inputs[i] = (mixed_qkv, a, b)`` entering with
    ``prefix_lens[i]`` tokens already in ``live_slots[i]``."""
    seq_lens = [x.shape[0] for x, _, _ in inputs]
    query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(seq_lens)]), dtype=torch.int32)
    backend.forward_metadata = SimpleNamespace(
        query_start_loc=query_start_loc,
        mamba_cache_indices=torch.tensor(live_slots, dtype=torch.int32),
        retrieve_next_token=None, retrieve_next_sibling=None, retrieve_parent_token=None,
        has_mamba_track_mask=False, conv_block_table=None,
        state_checkpoint_cu_starts=None, num_state_checkpoints=0,
        state_checkpoint_every_n_tokens=0,
    )  # fmt: skip
    forward_batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=seq_lens,
        spec_info=None,
    )
    mixed_qkv = torch.cat([x for x, _, _ in inputs])
    a = torch.cat([a for _, a, _ in inputs])
    b = torch.cat([b for _, _, b in inputs])
    return backend.forward_extend(
        layer=layer, forward_batch=forward_batch, mixed_qkv=mixed_qkv, a=a, b=b
    )


def _token_inputs(generator, num_tokens):
    return (
        torch.randn(num_tokens, CONV_DIM, generator=generator),
        torch.randn(num_tokens, NUM_V_HEADS, generator=generator),
        torch.randn(num_tokens, NUM_V_HEADS, generator=generator),
    )


def _slice(inputs, begin, end):
    return tuple(t[begin:end] for t in inputs)


def _concat(*parts):
    return tuple(torch.cat(ts) for ts in zip(*parts))


def _separate_prefill_state(backend, layer, pool, inputs, depth):
    """Conv and recurrent state after a prefill of the first ``depth`` tokens from zeros."""
    slot = int(pool.mamba_allocator.alloc(1)[0])
    live = pool.mamba2_layer_cache(GDN_LAYER_ID)
    live.conv[0][slot].zero_()
    live.temporal[slot].zero_()
    _extend(backend, layer, [slot], [0], [_slice(inputs, 0, depth)])
    state = live.conv[0][slot].clone(), live.temporal[slot].clone()
    pool.mamba_allocator.free(torch.tensor([slot]))
    return state


def test_one_extend_captures_every_anchor_equal_to_separate_prefills():
    generator = torch.Generator().manual_seed(0)
    config = SemanticCacheConfig(state_checkpoint_slots=32, anchor_template_family=NO_ANCHORS)
    driver = RequestLifecycle(build_tree_cache("semantic", _spec(), config=config))
    cache, pool = driver.cache, driver.tree.req_to_token_pool
    checkpoints = pool.mamba_ckpt_pool
    layer = _layer(generator)
    backend = _backend(pool)

    def admit_and_extend(requests):
        """requests: (token ids, per-token inputs, hint positions); one forward for all."""
        reqs = [driver.new_request(ids, hint=hint) for ids, _, hint in requests]
        for req in reqs:
            driver.admit(req)
        driver.start(reqs)
        _extend(
            backend, layer,
            [int(r.kv.mamba_pool_idx) for r in reqs],
            [r.prefix_len for r in reqs],
            [_slice(inputs, r.prefix_len, len(ids)) for r, (ids, inputs, _) in zip(reqs, requests)],
        )  # fmt: skip
        for req in reqs:
            driver.finish(req)
        return reqs

    # One ragged forward of three new requests: positions 1, both sides of the first chunk
    # boundary (63 | 64, 65), mid-chunk and the last token. A request's checkpoints are at
    # least MIN_CAPTURE_SPACING apart, so the boundary's sides come from different ones.
    ids_a = list(range(1000, 1150))
    inputs_a = _token_inputs(generator, 150)
    anchors_a = [1, 63, 100, 150]
    ids_d, ids_e = list(range(4000, 4130)), list(range(5000, 5100))
    inputs_d, inputs_e = _token_inputs(generator, 130), _token_inputs(generator, 100)
    anchors_d, anchors_e = [64, 129], [65, 81]
    req_a, req_d, req_e = admit_and_extend(
        [(ids_a, inputs_a, anchors_a), (ids_d, inputs_d, anchors_d), (ids_e, inputs_e, anchors_e)]
    )
    assert req_a.prefix_len == req_d.prefix_len == req_e.prefix_len == 0

    # A ragged batch: a new request, and one that leaves A after 100 tokens, restoring A's
    # checkpoint there and capturing past it (its positions count from its own start).
    ids_b = list(range(2000, 2090))
    inputs_b = _token_inputs(generator, 90)
    ids_c = ids_a[:100] + list(range(3000, 3050))
    inputs_c = _concat(_slice(inputs_a, 0, 100), _token_inputs(generator, 50))
    anchors_b, anchors_c = [30, 89], [120, 149]
    req_b, req_c = admit_and_extend([(ids_b, inputs_b, anchors_b), (ids_c, inputs_c, anchors_c)])
    assert (req_b.prefix_len, req_c.prefix_len) == (0, 100)

    checked = 0
    requests = [(ids_a, inputs_a, anchors_a), (ids_d, inputs_d, anchors_d), (ids_e, inputs_e, anchors_e),
                (ids_b, inputs_b, anchors_b), (ids_c, inputs_c, anchors_c)]
    for ids, inputs, anchors in requests:
        for depth in anchors:
            checkpoint = cache.checkpoint_at(ids[:depth])
            assert checkpoint is not None, f"no checkpoint at depth {depth}"
            slot = checkpoint.slot
            conv, temporal = _separate_prefill_state(backend, layer, pool, inputs, depth)
            torch.testing.assert_close(checkpoints.conv[0][0][slot], conv, rtol=0, atol=0)
            torch.testing.assert_close(checkpoints.temporal[0][slot], temporal, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == sum(len(anchors) for _, _, anchors in requests)


# ---- planning and per-forward queries, on the replay's tiny state layout ----


def _tiny_lifecycle(planner: str) -> RequestLifecycle:
    from sglang_hybrid.replay.policies.semantic import tiny_state_spec

    config = SemanticCacheConfig(state_checkpoint_slots=8, checkpoint_planner=planner, anchor_template_family="chatml")
    return RequestLifecycle(build_tree_cache("semantic", tiny_state_spec(kv_tokens=1 << 14, max_context=1 << 12), config=config))


def _chat_prompt() -> list[int]:
    from sglang_hybrid.replay import rendering

    text = rendering.render_chatml(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "Calling ls."},
            {"role": "user", "content": "Now the sizes."},
        ],
        None,
    )
    return rendering.qwen3_encode(text + "<|im_start|>assistant\n")


def _positions(queries) -> list[int]:
    """Captured positions, counted from the first token the forward computes."""
    return (queries.index.end - queries.index.seq_start).tolist()


def test_chunked_prefill_captures_each_depth_in_the_forward_that_crosses_it():
    driver = _tiny_lifecycle("none")
    req = driver.new_request(list(range(1, 101)), hint=[10, 50, 70, 100])
    driver.admit(req)
    pool = driver.cache.checkpoint_pool
    # First chunk: tokens [0, 50).
    req.extend_end = 50
    first = driver.start([req])
    assert _positions(first) == [10, 50] and first.index.seq.tolist() == [0, 0]
    assert queries_for_forward(pool, [0], [50]) is first
    # Second chunk: tokens [50, 100); positions count from the chunk's first token.
    req.prefix_len, req.extend_end = 50, 100
    second = driver.start([req])
    assert _positions(second) == [20, 50]
    assert len({*first.index.slot.tolist(), *second.index.slot.tolist()}) == 4
    with pytest.raises(RuntimeError, match="does not match the batch"):
        queries_for_forward(pool, [0], [50])
    driver.abort(req)
    assert pool.used_size() == 0, "an aborted request's staged slots leaked"


@pytest.mark.planning_failure_expected
def test_a_request_whose_planning_fails_is_served_without_checkpoints(monkeypatch, caplog):
    driver = _tiny_lifecycle("none")
    pool = driver.cache.checkpoint_pool
    planning = driver.cache.planning
    plan = planning.plan

    def plan_then_fail_on_staging(request):
        depths = plan(request)
        monkeypatch.setattr(planning, "staged", lambda *args: (_ for _ in ()).throw(KeyError("planner bug")))
        return depths

    monkeypatch.setattr(planning, "plan", plan_then_fail_on_staging)
    failing = driver.new_request(list(range(1, 101)), hint=[10, 50])
    driver.admit(failing)
    assert driver.start([failing]) is None  # no exception into the scheduler, nothing captured
    assert "served without in-prefill checkpoints" in caplog.text
    assert pool.used_size() == 0, "the staged slot of a failed plan leaked"
    failing.prefix_len, failing.extend_end = 50, 100
    assert driver.start([failing]) is None  # not planned again
    driver.finish(failing)

    monkeypatch.setattr(planning, "plan", plan)
    monkeypatch.undo()
    healthy = driver.new_request(list(range(200, 300)), hint=[10, 50])
    driver.admit(healthy)
    assert _positions(driver.start([healthy])) == [10, 50]


def test_messages_mode_stages_every_message_start_past_the_restored_prefix():
    driver = _tiny_lifecycle("messages")
    prompt = _chat_prompt()
    req = driver.new_request(prompt)
    driver.admit(req)
    staged = _positions(driver.start([req]))
    detected = AnchorDetector.for_family("chatml").detect(np.asarray(prompt)).of_kind(AnchorKind.MESSAGE_START)
    starts = sorted({int(s) for s in detected})
    # The first message starts at depth 0, the state every request starts from anyway; of
    # the others, every start not within MIN_CAPTURE_SPACING after a staged one is staged.
    assert staged[0] == starts[1] and len(staged) >= 2 and set(staged) <= set(starts)
    for start in starts[1:]:
        previous = max(s for s in staged if s <= start)
        assert start in staged or start - previous < MIN_CAPTURE_SPACING
    assert all(b - a >= MIN_CAPTURE_SPACING for a, b in zip(staged, staged[1:]))


def test_checkpoints_closer_than_the_spacing_keep_the_shallower():
    driver = _tiny_lifecycle("none")
    req = driver.new_request(list(range(1, 101)), hint=[10, 20, 26, 40, 41, 100])
    driver.admit(req)
    assert _positions(driver.start([req])) == [10, 26, 100]


def test_none_mode_and_none_hint_stage_nothing():
    for planner, hint in (("none", None), ("messages", "none")):
        driver = _tiny_lifecycle(planner)
        req = driver.new_request(_chat_prompt(), hint=hint)
        driver.admit(req)
        assert driver.start([req]) is None
        assert driver.cache.checkpoint_pool.used_size() == 0


def test_a_request_joins_the_session_whose_checkpoint_it_restored():
    driver = _tiny_lifecycle("adaptive")
    planner = driver.cache.planning.planner
    prompt = _chat_prompt()
    # The lifecycle inserts prompt + output: the output the final state covers.
    first = driver.new_request(prompt, [7, 8], session="agent-1")
    driver.admit(first)
    driver.start([first])
    driver.finish(first)

    follow_up = driver.new_request([*prompt, 7, 8, 9, 10, 11])
    driver.admit(follow_up)
    source = CheckpointId.device(follow_up.kv.mamba_cow_src_index)
    assert planner.records[source].session == "agent-1"
    driver.start([follow_up])
    assert planner.sessions["agent-1"].last_clock == planner.clock, "the follow-up was planned in its own session"

"""The torch-native GDN and conv1d fallbacks against transformers' and SGLang's own versions.

References: transformers' Qwen3-Next ``torch_chunk_gated_delta_rule`` (a chunked
algorithm, unlike the token loop under test), ``torch_recurrent_gated_delta_rule`` and
``causal_conv1d_update``; SGLang's ``fused_gdn_gating`` Triton kernel (interpreted). The
fallbacks are called with SGLang's packed varlen layout and state pools: [slot, HV, V, K]
recurrent states, [slot, dim, W-1] conv states, padding rows with slot -1.
"""

import os

# Must precede the first triton import (SGLang's gating kernel runs interpreted here).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    causal_conv1d_update as hf_causal_conv1d_update,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from sglang_hybrid.cpu_fallbacks import (  # noqa: E402
    causal_conv1d_fn,
    causal_conv1d_update,
    gdn_decode,
    gdn_extend,
    install_cpu_fallbacks,
    qkvzba_split_reshape_cat,
)

NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM = 2, 4, 32
CONV_DIM, CONV_WIDTH = 48, 4
NUM_SLOTS = 6


def _hf_gdn(q, k, v, g, beta, state_vk, reference):
    """Run a transformers GDN reference on one sequence in SGLang's layouts."""
    heads_per_k = NUM_V_HEADS // NUM_K_HEADS
    out, final = reference(
        q.repeat_interleave(heads_per_k, dim=1)[None].float(),
        k.repeat_interleave(heads_per_k, dim=1)[None].float(),
        v[None].float(),
        g[None].float(),
        beta[None].float(),
        initial_state=state_vk.transpose(-1, -2)[None].float(),  # HF keeps [HV, K, V]
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0].transpose(-1, -2)


def _random_gdn_inputs(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, NUM_K_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_K_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_V_HEADS, HEAD_DIM, generator=gen)
    g = -torch.rand(num_tokens, NUM_V_HEADS, generator=gen) * 0.5
    beta = torch.rand(num_tokens, NUM_V_HEADS, generator=gen)
    return q, k, v, g, beta


def test_gdn_extend_matches_transformers_chunked_rule_per_sequence_and_slot():
    seq_lens = [70, 5, 33]  # 70 spans two of the reference's 64-token chunks
    slots = [4, -1, 1]  # the middle row is padding: its slot and output stay untouched
    total = sum(seq_lens)
    q, k, v, g, beta = _random_gdn_inputs(total, seed=0)
    ssm_states = torch.randn(NUM_SLOTS, NUM_V_HEADS, HEAD_DIM, HEAD_DIM) * 0.1
    before = ssm_states.clone()
    query_start_loc = torch.tensor([0, 70, 75, 108], dtype=torch.int32)

    out, last_state, chunk_states = gdn_extend(
        q[None], k[None], v[None], g[None], beta[None],
        ssm_states=ssm_states,
        cache_indices=torch.tensor(slots, dtype=torch.int32),
        query_start_loc=query_start_loc,
    )  # fmt: skip

    assert out.shape == (1, total, NUM_V_HEADS, HEAD_DIM)
    assert last_state is None
    # fla's h: the state entering each 64-token chunk, chunks numbered per sequence
    # (70 tokens: 2 chunks, 33 tokens: 1; padding rows have none).
    assert chunk_states.shape == (1, 3, NUM_V_HEADS, HEAD_DIM, HEAD_DIM)
    torch.testing.assert_close(chunk_states[0, 0], before[4].float())
    torch.testing.assert_close(chunk_states[0, 2], before[1].float())
    _, state_after_64 = _hf_gdn(
        q[:64], k[:64], v[:64], g[:64], beta[:64], before[4], torch_chunk_gated_delta_rule
    )
    torch.testing.assert_close(chunk_states[0, 1], state_after_64, atol=2e-4, rtol=1e-3)
    for (start, end), slot in zip([(0, 70), (70, 75), (75, 108)], slots):
        if slot < 0:
            assert torch.count_nonzero(out[0, start:end]) == 0
            continue
        ref_out, ref_state = _hf_gdn(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end],
            before[slot], torch_chunk_gated_delta_rule,
        )  # fmt: skip
        torch.testing.assert_close(out[0, start:end], ref_out, atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(ssm_states[slot], ref_state, atol=2e-4, rtol=1e-3)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(ssm_states[untouched], before[untouched])


def test_gdn_decode_matches_sglang_gating_and_transformers_recurrent_rule():
    from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating

    batch = 3
    slots = [2, 5, -1]
    q, k, v, _, _ = _random_gdn_inputs(batch, seed=1)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(batch, NUM_V_HEADS, generator=gen)
    b = torch.randn(batch, NUM_V_HEADS, generator=gen)
    A_log = torch.randn(NUM_V_HEADS, generator=gen) * 0.5
    dt_bias = torch.randn(NUM_V_HEADS, generator=gen)
    ssm_states = torch.randn(NUM_SLOTS, NUM_V_HEADS, HEAD_DIM, HEAD_DIM) * 0.1
    before = ssm_states.clone()

    out = gdn_decode(
        q[None], k[None], v[None], a, b,
        A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
        cache_indices=torch.tensor(slots, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
    )  # fmt: skip

    g, beta = fused_gdn_gating(A_log, a, b, dt_bias)  # [1, batch, HV] each
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.count_nonzero(out[0, row]) == 0
            continue
        ref_out, ref_state = _hf_gdn(
            q[row : row + 1], k[row : row + 1], v[row : row + 1],
            g[0, row : row + 1], beta[0, row : row + 1],
            before[slot], torch_recurrent_gated_delta_rule,
        )  # fmt: skip
        torch.testing.assert_close(out[0, row], ref_out[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ssm_states[slot], ref_state, atol=1e-5, rtol=1e-4)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(ssm_states[untouched], before[untouched])


def _conv_params(seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(CONV_DIM, CONV_WIDTH, generator=gen)
    bias = torch.randn(CONV_DIM, generator=gen)
    return gen, weight, bias


def test_causal_conv1d_fn_continues_only_sequences_with_initial_state():
    gen, weight, bias = _conv_params(seed=3)
    seq_lens = [9, 2, 6]  # 2 < W-1: the new state keeps part of the old one
    slots = [0, 3, 5]
    has_initial_state = torch.tensor([False, True, True])
    x = torch.randn(CONV_DIM, sum(seq_lens), generator=gen)
    conv_states = torch.randn(NUM_SLOTS, CONV_DIM, CONV_WIDTH - 1, generator=gen)
    before = conv_states.clone()

    out = causal_conv1d_fn(
        x, weight, bias, conv_states,
        query_start_loc=torch.tensor([0, 9, 11, 17], dtype=torch.int32),
        seq_lens_cpu=seq_lens,
        cache_indices=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=has_initial_state,
        activation="silu",
    )  # fmt: skip

    bounds = [(0, 9), (9, 11), (11, 17)]
    for (start, end), slot, continues in zip(bounds, slots, has_initial_state.tolist()):
        ref_state = before[slot].clone()[None] if continues else torch.zeros(1, CONV_DIM, 3)
        ref_out = hf_causal_conv1d_update(
            x[None, :, start:end], ref_state, weight, bias, activation="silu"
        )
        torch.testing.assert_close(out[:, start:end], ref_out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_states[slot], ref_state[0])
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(conv_states[untouched], before[untouched])


def test_causal_conv1d_fn_leaves_an_empty_extend_as_it_found_it():
    gen, weight, bias = _conv_params(seed=4)
    x = torch.randn(CONV_DIM, 5, generator=gen)
    conv_states = torch.randn(NUM_SLOTS, CONV_DIM, CONV_WIDTH - 1, generator=gen)
    before = conv_states.clone()
    out = causal_conv1d_fn(
        x, weight, bias, conv_states,
        query_start_loc=torch.tensor([0, 0, 5], dtype=torch.int32),
        seq_lens_cpu=[0, 5],
        cache_indices=torch.tensor([1, 2], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]),
        activation="silu",
    )  # fmt: skip
    assert out.shape == x.shape
    assert torch.equal(conv_states[1], before[1])


@pytest.mark.parametrize("tokens_per_row", [None, 3])
def test_causal_conv1d_update_steps_each_slot_and_skips_padding(tokens_per_row):
    gen, weight, bias = _conv_params(seed=4)
    slots = [4, -1, 1]
    shape = (3, CONV_DIM) if tokens_per_row is None else (3, CONV_DIM, tokens_per_row)
    x = torch.randn(*shape, generator=gen)
    conv_state = torch.randn(NUM_SLOTS, CONV_DIM, CONV_WIDTH - 1, generator=gen)
    before = conv_state.clone()

    out = causal_conv1d_update(
        x, conv_state, weight, bias, "silu",
        conv_state_indices=torch.tensor(slots, dtype=torch.int32),
    )  # fmt: skip

    assert out.shape == x.shape
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.count_nonzero(out[row]) == 0
            continue
        ref_state = before[slot].clone()[None]
        x_row = x[row : row + 1]
        ref_out = hf_causal_conv1d_update(
            x_row[..., None] if tokens_per_row is None else x_row,
            ref_state, weight, bias, activation="silu",
        )  # fmt: skip
        expected = ref_out[0, :, 0] if tokens_per_row is None else ref_out[0]
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state[slot], ref_state[0])
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(conv_state[untouched], before[untouched])


def test_install_patches_sglang_kernels_on_a_host_without_cuda():
    if torch.cuda.is_available():
        assert install_cpu_fallbacks() is False
        return
    from sglang.srt.layers.attention.linear import gdn_backend
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
    from sglang.srt.layers.rotary_embedding import base as rotary_base

    assert install_cpu_fallbacks() is True
    assert install_cpu_fallbacks() is True  # idempotent
    assert gdn_backend.causal_conv1d_fn is causal_conv1d_fn
    assert gdn_backend.causal_conv1d_update is causal_conv1d_update
    assert TritonGDNKernel.supports_packed_decode is False
    assert TritonGDNKernel().extend is gdn_extend
    assert TritonGDNKernel().decode is gdn_decode
    from sglang.srt.models import qwen3_next

    assert qwen3_next.fused_qkvzba_split_reshape_cat is qkvzba_split_reshape_cat
    assert rotary_base._is_cpu is True
    assert torch.get_device_module() is torch.cpu
    assert torch.get_device_module("cpu") is torch.cpu


@pytest.mark.parametrize("num_heads_qk, num_heads_v, head_qk, head_v", [(2, 4, 32, 32), (2, 2, 16, 8), (4, 16, 16, 16)])
def test_qkvzba_split_equals_sglangs_kernel_bit_for_bit(num_heads_qk, num_heads_v, head_qk, head_v):
    from sglang.kernels.ops.attention.triton_gdn_fused_proj import fused_qkvzba_split_reshape_cat

    gen = torch.Generator().manual_seed(5)
    tokens = 7
    qkvz_width = num_heads_qk * (2 * head_qk + 2 * num_heads_v // num_heads_qk * head_v)
    mixed_qkvz = torch.randn(tokens, qkvz_width, generator=gen).bfloat16()
    mixed_ba = torch.randn(tokens, 2 * num_heads_v, generator=gen).bfloat16()
    args = (num_heads_qk, num_heads_v, head_qk, head_v)
    expected = fused_qkvzba_split_reshape_cat(mixed_qkvz, mixed_ba, *args)  # interpreted Triton
    for ours, theirs in zip(qkvzba_split_reshape_cat(mixed_qkvz, mixed_ba, *args), expected):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)

"""Anchor capture inside SGLang's own Mamba2 prefill, on CPU.

Two levels. SGLang's Triton SSD scan (``mamba_chunk_scan_combined``, patched, interpreted)
returns the states at tracked positions, several per sequence, equal to the sequential
recurrence; the CPU fallback the server uses on this host (``cpu_mamba2_fallbacks``) gives
the same states and the same output as that scan. Then ``Mamba2AttnBackend.forward`` running
SGLang's ``MambaMixer2.forward`` (its conv1d and scan calls; our fallbacks beneath, the
plugin's hooks around) serves ragged batches of requests through the server's lifecycle
(``RequestLifecycle``): one prefilled in two chunks with anchors on both sides of the chunk
boundary, one restored from a mid-prompt checkpoint. Every state the forwards captured,
attached to the tree by the real cache, must equal the state of a separate prefill that stops
there through the same backend: conv bit-exact, SSM within 1e-5.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend
from sglang.srt.layers.attention.mamba.mamba import MambaMixer2
from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata, Mamba2Metadata
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_hybrid import cpu_mamba2_fallbacks, patches
from sglang_hybrid.anchors.detector import NO_ANCHORS
from sglang_hybrid.config import SemanticCacheConfig
from sglang_hybrid.harness.lifecycle import RequestLifecycle
from sglang_hybrid.harness.pools import HybridPoolSpec, build_tree_cache, hybrid_pool_spec
from sglang_hybrid.kernels.reference import mamba2_states_reference

HEADS, HEAD_DIM, STATE, GROUPS, CONV_KERNEL, HIDDEN = 4, 8, 16, 2, 4, 16
INTERMEDIATE = HEADS * HEAD_DIM
CONV_DIM = INTERMEDIATE + 2 * GROUPS * STATE
SSD_CHUNK = 32
MAMBA_LAYER_ID = 0


@pytest.fixture(scope="module", autouse=True)
def hooks_applied():
    from sglang_hybrid.plugin import register

    register()
    HookRegistry.apply_hooks()


# ---- the scan: SGLang's Triton SSD and the CPU fallback, at tracked positions ----


def _scan_inputs(generator, lens):
    total = sum(lens)
    return dict(
        x=torch.randn(1, total, HEADS, HEAD_DIM, generator=generator),
        dt=torch.randn(1, total, HEADS, generator=generator) * 0.5,
        A=-torch.rand(HEADS, generator=generator) - 0.5,
        B=torch.randn(1, total, GROUPS, STATE, generator=generator),
        C=torch.randn(1, total, GROUPS, STATE, generator=generator),
        D=torch.randn(HEADS, generator=generator),
        dt_bias=torch.randn(HEADS, generator=generator) * 0.3,
    )


def test_sglang_ssd_scan_and_cpu_fallback_track_states_at_any_positions(monkeypatch):
    patches.install()
    from sglang.kernels.ops.mamba.triton_ops.ssd_combined import mamba_chunk_scan_combined

    # SGLang enters torch.get_device_module(x.device).device(index); CPU has no such context.
    monkeypatch.setattr(torch.cpu, "device", lambda index=None: contextlib.nullcontext(), raising=False)
    generator = torch.Generator().manual_seed(0)
    lens = [70, 50, 30]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    inputs = _scan_inputs(generator, lens)
    initial = torch.randn(len(lens), HEADS, HEAD_DIM, STATE, generator=generator) * 0.3
    initial[0] = 0  # the first sequence is new, the others continue
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), cu.diff())[None]
    chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(
        cu, SSD_CHUNK, sum(lens)
    )
    # Several positions in the first sequence (the segments between them end at 0:
    # patches/0003), both sides of the 32-token chunk boundary, sequence ends.
    track_seq = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    track_end = torch.tensor([1, 31, 32, 70, 71, 120, 150])
    options = dict(
        chunk_size=SSD_CHUNK, seq_idx=seq_idx, chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets, cu_seqlens=cu, initial_states=initial,
        return_varlen_states=True, return_track_states=True, track_seq_idx=track_seq,
        track_end_locs=track_end, dt_softplus=True, state_dtype=torch.float32,
    )  # fmt: skip
    results = {}
    for name, scan in (("triton", mamba_chunk_scan_combined), ("fallback", cpu_mamba2_fallbacks.mamba_chunk_scan_combined)):
        out = torch.empty_like(inputs["x"])
        results[name] = (out, *scan(**inputs, out=out, **options))

    steps = F.softplus(inputs["dt"][0] + inputs["dt_bias"])
    expected = mamba2_states_reference(
        inputs["x"], steps, inputs["A"], inputs["B"], cu, initial, track_seq, track_end - cu[track_seq].long()
    )
    triton_out, triton_chunks, triton_final, triton_tracked = results["triton"]
    fallback_out, fallback_chunks, fallback_final, fallback_tracked = results["fallback"]
    torch.testing.assert_close(triton_tracked[0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fallback_tracked[0], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fallback_out, triton_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fallback_final, triton_final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fallback_chunks, triton_chunks, rtol=1e-5, atol=1e-5)


# ---- the mixer: SGLang's MambaMixer2 through Mamba2AttnBackend, hooks applied ----


def _exact_values(shape, generator) -> torch.Tensor:
    """Multiples of 1/8 in [-3/8, 3/8]: products of two and sums of a few are exact in fp32,
    so the projection gives the same pre-conv inputs whatever the batch around a token (a
    matmul's summation order depends on the batch shape)."""
    return torch.randint(-3, 4, shape, generator=generator).float() / 8


class _Projection(nn.Linear):
    """SGLang's parallel linears return (output, bias)."""

    def forward(self, x):
        return super().forward(x), None


def _mixer(generator: torch.Generator) -> MambaMixer2:
    """SGLang's MambaMixer2 with its forward's attributes set directly: the constructor needs
    a tensor-parallel runtime, and the gated norm (which does not touch the state) is a
    plain SiLU gate."""
    mixer = object.__new__(MambaMixer2)
    nn.Module.__init__(mixer)
    mixer.in_proj = _Projection(HIDDEN, INTERMEDIATE + CONV_DIM + HEADS)
    mixer.out_proj = _Projection(INTERMEDIATE, HIDDEN)
    mixer.conv1d = nn.Conv1d(CONV_DIM, CONV_DIM, CONV_KERNEL, groups=CONV_DIM)
    for module in (mixer.in_proj, mixer.out_proj, mixer.conv1d):
        for parameter in module.parameters():
            parameter.data = _exact_values(parameter.shape, generator)
    mixer.norm = lambda states, gate: states * F.silu(gate)
    mixer.A = -torch.rand(HEADS, generator=generator) - 0.5
    mixer.D = torch.randn(HEADS, generator=generator)
    mixer.dt_bias = torch.randn(HEADS, generator=generator) * 0.3
    mixer.intermediate_size, mixer.conv_dim, mixer.num_heads = INTERMEDIATE, CONV_DIM, HEADS
    mixer.head_dim, mixer.ssm_state_size, mixer.n_groups = HEAD_DIM, STATE, GROUPS
    mixer.groups_ssm_state_size, mixer.tp_size, mixer.activation = GROUPS * STATE, 1, "silu"
    return mixer


def _spec() -> HybridPoolSpec:
    return hybrid_pool_spec(
        recurrent_layers=[MAMBA_LAYER_ID], attention_layers=[1],
        intermediate_size=INTERMEDIATE, n_groups=GROUPS, num_heads=HEADS,
        head_dim=HEAD_DIM, state_size=STATE, conv_kernel=CONV_KERNEL,
        kv_head_dim=4, kv_size=4096, max_num_reqs=6, max_context_len=1024,
    )  # fmt: skip


def _backend(req_to_token_pool) -> Mamba2AttnBackend:
    """SGLang's Mamba2 backend without a model runner: the state its forward reads."""
    backend = object.__new__(Mamba2AttnBackend)
    backend.req_to_token_pool = req_to_token_pool
    return backend


def _extend(backend, mixer, live_slots, prefix_lens, hidden):
    """One prefill forward of sequences with hidden states ``hidden[i]`` entering with
    ``prefix_lens[i]`` tokens already in ``live_slots[i]``."""
    seq_lens = [h.shape[0] for h in hidden]
    query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(seq_lens)]), dtype=torch.int32)
    forward_batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, logical_forward_mode=ForwardMode.EXTEND,
        extend_num_tokens=sum(seq_lens), extend_seq_lens_cpu=seq_lens,
        extend_prefix_lens=torch.tensor(prefix_lens), extend_prefix_lens_cpu=list(prefix_lens),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix_lens, seq_lens)]),
        spec_info=None, mamba_track_mask=None,
    )  # fmt: skip
    entering = ForwardMetadata(
        query_start_loc=query_start_loc, mamba_cache_indices=torch.tensor(live_slots, dtype=torch.int32)
    )
    backend.forward_metadata = Mamba2Metadata.prepare_mixed(entering, SSD_CHUNK, forward_batch)
    with torch.no_grad():  # as SGLang's model runner
        return backend.forward(
            mixer=mixer, layer_id=MAMBA_LAYER_ID, hidden_states=torch.cat(hidden), output=None,
            forward_batch=forward_batch, use_triton_causal_conv=True,
        )  # fmt: skip


def _separate_prefill_state(backend, mixer, pool, hidden, depth):
    """Conv and SSM state after a prefill of the first ``depth`` tokens from zeros."""
    slot = int(pool.mamba_allocator.alloc(1)[0])
    live = pool.mamba2_layer_cache(MAMBA_LAYER_ID)
    live.conv[0][slot].zero_()
    live.temporal[slot].zero_()
    _extend(backend, mixer, [slot], [0], [hidden[:depth]])
    state = live.conv[0][slot].clone(), live.temporal[slot].clone()
    pool.mamba_allocator.free(torch.tensor([slot]))
    return state


def test_mamba2_prefills_capture_every_anchor_equal_to_separate_prefills():
    generator = torch.Generator().manual_seed(0)
    config = SemanticCacheConfig(state_checkpoint_slots=32, anchor_template_family=NO_ANCHORS)
    driver = RequestLifecycle(build_tree_cache("semantic", _spec(), config=config))
    cache, pool = driver.cache, driver.tree.req_to_token_pool
    checkpoints = pool.mamba_ckpt_pool
    mixer = _mixer(generator)
    backend = _backend(pool)

    def forward(reqs_and_hidden):
        """One prefill forward computing tokens [prefix_len, extend_end) of each request."""
        reqs = [req for req, _ in reqs_and_hidden]
        driver.start(reqs)
        _extend(
            backend, mixer, [int(r.kv.mamba_pool_idx) for r in reqs], [r.prefix_len for r in reqs],
            [hidden[r.prefix_len:r.extend_end] for r, hidden in reqs_and_hidden],
        )  # fmt: skip

    # A is prefilled in two chunks, [0, 80) beside B and [80, 150) alone: anchors at 64 and
    # on the boundary (80) are captured by the first forward, 96 and 150 by the second.
    ids_a, hidden_a, anchors_a = list(range(1000, 1150)), _exact_values((150, HIDDEN), generator), [1, 31, 64, 80, 96, 150]
    ids_b, hidden_b, anchors_b = list(range(2000, 2090)), _exact_values((90, HIDDEN), generator), [32, 89]
    req_a = driver.new_request(ids_a, hint=anchors_a)
    req_b = driver.new_request(ids_b, hint=anchors_b)
    driver.admit(req_a)
    driver.admit(req_b)
    req_a.extend_end = 80
    forward([(req_a, hidden_a), (req_b, hidden_b)])
    req_a.prefix_len, req_a.extend_end = 80, 150
    forward([(req_a, hidden_a)])
    driver.finish(req_a)
    driver.finish(req_b)

    # C leaves A after 64 tokens: it restores A's checkpoint there and captures past it.
    ids_c = ids_a[:64] + list(range(3000, 3060))
    hidden_c = torch.cat([hidden_a[:64], _exact_values((60, HIDDEN), generator)])
    anchors_c = [66, 100, 124]
    req_c = driver.new_request(ids_c, hint=anchors_c)
    driver.admit(req_c)
    assert req_c.prefix_len == 64
    forward([(req_c, hidden_c)])
    driver.finish(req_c)

    checked = 0
    for ids, hidden, anchors in ((ids_a, hidden_a, anchors_a), (ids_b, hidden_b, anchors_b), (ids_c, hidden_c, anchors_c)):
        for depth in anchors:
            checkpoint = cache.checkpoint_at(ids[:depth])
            assert checkpoint is not None, f"no checkpoint at depth {depth}"
            conv, temporal = _separate_prefill_state(backend, mixer, pool, hidden, depth)
            torch.testing.assert_close(checkpoints.conv[0][0][checkpoint.slot], conv, rtol=0, atol=0)
            torch.testing.assert_close(checkpoints.temporal[0][checkpoint.slot], temporal, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == len(anchors_a) + len(anchors_b) + len(anchors_c)

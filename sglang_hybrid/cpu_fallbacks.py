"""Run the real SGLang 0.5.23 server on a host without CUDA (tests, CI, laptops).

A CUDA build of torch on a machine with no driver sends SGLang down its generic GPU paths,
which break in four ways (each patch below names the SGLang code it works around):

* device probes that assume a driver (``torch.get_device_module()`` answers ``torch.cuda``;
  the rotary embedding imports vllm's CUDA op; fla's ``input_guard`` enters
  ``torch.cpu.device``, which does not exist);
* Triton, which has no driver here and runs only under ``TRITON_INTERPRET=1``, where the
  autotuner still benchmarks on the (missing) driver;
* kernels whose interpreted numbers are wrong: the fla chunked gated-delta rule and the
  Triton causal conv1d give non-finite output from finite input;
* one kernel the interpreter runs one program per token and head:
  ``fused_qkvzba_split_reshape_cat`` (Qwen3-Next's input projection split), which took all
  of a CPU server's prefill time;
* and kernels SGLang binds only on a GPU platform: Mamba2's conv1d (its SSD scan and decode
  step are replaced too, ``cpu_mamba2_fallbacks``).

``install_cpu_fallbacks()`` patches each of these after import, in the process that calls
it; our SGLang plugin calls it in every SGLang process. Each patch is small, idempotent and
applied only when ``torch.cuda.is_available()`` is false, so a GPU server runs SGLang
unchanged. The GDN and conv1d replacements below are plain torch, exact in fp32, and loop
over sequences (and, for the gated-delta rule, tokens) in Python: fine for the tiny models
and short prompts a CPU test serves, far too slow for anything real.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_hybrid import cpu_mamba2_fallbacks
from sglang_hybrid.kernels import GDN_CHUNK_SIZE

logger = logging.getLogger(__name__)

_installed = False


def install_cpu_fallbacks() -> bool:
    """Patch SGLang for a host without CUDA; return whether anything was installed."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    _default_device_module_to_cpu()
    _keep_native_rotary_embedding()
    _fla_device_context_to_null()
    _autotune_first_config_when_interpreted()
    _torch_native_gdn_kernels()
    _torch_native_causal_conv1d()
    _torch_native_qkvzba_split()
    _torch_native_mamba2_kernels()
    _installed = True
    logger.info("sglang_hybrid: CPU fallbacks installed (no CUDA device on this host)")
    return True


# --------------------------------------------------------------------------------------
# Device probes


def _default_device_module_to_cpu() -> None:
    # Qwen3-Next builds its gated RMSNorm on ``torch.get_device_module().current_device()``.
    # On a CUDA build that is torch.cuda even without a driver, and current_device() raises.
    original = torch.get_device_module

    @functools.wraps(original)
    def get_device_module(device=None):
        if device is None:
            return torch.cpu
        return original(device)

    torch.get_device_module = get_device_module


def _keep_native_rotary_embedding() -> None:
    # RotaryEmbedding.__init__ imports vllm's CUDA rotary op on every platform it does not
    # list; marking the module as CPU keeps its torch-native forward and changes nothing else.
    from sglang.srt.layers.rotary_embedding import base as rotary_base

    rotary_base._is_cpu = True


def _fla_device_context_to_null() -> None:
    # fla's input_guard enters ``device_torch_lib.device(index)``; without a Triton driver
    # that lib is torch.cpu, which has no device context. CPU tensors need none.
    from sglang.kernels.ops.attention.fla import utils as fla_utils

    if not hasattr(fla_utils.device_torch_lib, "device"):
        fla_utils.custom_device_ctx = lambda index: contextlib.nullcontext()


def _autotune_first_config_when_interpreted() -> None:
    # Under the interpreter the autotuner still asks the active driver for a benchmarker,
    # and there is none. Timing is meaningless there anyway: keep the first config only, and
    # the autotuner skips benchmarking.
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.prune_configs

    @functools.wraps(original)
    def prune_configs(self, kwargs):
        return original(self, kwargs)[:1]

    Autotuner.prune_configs = prune_configs


# --------------------------------------------------------------------------------------
# Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, token by token, in fp32.

    q, k: [T, Hk, K]; v: [T, HV, V]; g (log decay), beta: [T, HV]; state: [HV, V, K]
    (SGLang's state-pool layout). q and k are L2-normalised, q scaled by K**-0.5, and both
    shared across HV // Hk value heads, as SGLang's kernels do with
    ``use_qk_l2norm_in_kernel=True``. Returns the output [T, HV, V] (fp32) and the final
    state [HV, V, K] (fp32).
    """
    num_v_heads = v.shape[1]
    heads_per_k = num_v_heads // k.shape[1]
    q = F.normalize(q.float(), p=2, dim=-1, eps=1e-6).repeat_interleave(heads_per_k, dim=1)
    k = F.normalize(k.float(), p=2, dim=-1, eps=1e-6).repeat_interleave(heads_per_k, dim=1)
    q = q * q.shape[-1] ** -0.5
    v, decay, beta = v.float(), g.float().exp(), beta.float()
    state = state.float().clone()
    out = torch.empty_like(v)
    # Per head: state [V, K] times a key or query column [K, 1] (bmm over the heads).
    k_columns, q_columns = k.unsqueeze(-1), q.unsqueeze(-1)
    for t in range(v.shape[0]):
        state *= decay[t, :, None, None]
        predicted_v = torch.bmm(state, k_columns[t]).squeeze(-1)
        correction = (v[t] - predicted_v) * beta[t, :, None]
        state += correction[:, :, None] * k[t, :, None, :]
        out[t] = torch.bmm(state, q_columns[t]).squeeze(-1)
    return out, state


def gdn_gates(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), in fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g, b.float().sigmoid()


def _sequences(query_start_loc: torch.Tensor, cache_indices: torch.Tensor):
    """(index, start, end, state slot) per sequence, skipping padding rows (negative slots)."""
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist()
    for i, slot in enumerate(slots[: len(starts) - 1]):
        if slot >= 0:
            yield i, starts[i], starts[i + 1], slot


def gdn_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    inplace_update: bool = True,
    track_state: Optional[torch.Tensor] = None,
    snapshot_states: Optional[torch.Tensor] = None,
    snapshot_chunk_ptr: Optional[torch.Tensor] = None,
    snapshot_offsets: Optional[torch.Tensor] = None,
    snapshot_rows: Optional[torch.Tensor] = None,
    **unused_kernel_options,
) -> tuple[torch.Tensor, None, torch.Tensor]:
    """Drop-in for the patched ``TritonGDNKernel.extend`` (fla ``chunk_gated_delta_rule``).

    Tensors are packed [1, total_tokens, ...]; each sequence starts from and writes back
    ``ssm_states[slot]``, like the fla kernel with ``initial_state_indices``. Returns the
    output, None, and the fp32 state at the start of every 64-token chunk of every sequence
    ``(1, NT, HV, V, K)``, as fla's ``h`` (chunks numbered per sequence). ``snapshot_*``
    (patches/0002) ask for the states at positions inside chunks, written to rows of
    ``snapshot_states``.
    """
    if not inplace_update:
        raise NotImplementedError("the CPU GDN fallback does not support multi-item scoring")
    if track_state is not None:
        raise NotImplementedError("the CPU GDN fallback keeps no extra_buffer snapshots")
    snapshots: dict[int, list[tuple[int, int]]] = {}  # chunk -> [(offset, row)]
    if snapshot_states is not None:
        ptr, offsets, rows = snapshot_chunk_ptr.tolist(), snapshot_offsets.tolist(), snapshot_rows.tolist()
        for chunk in range(len(ptr) - 1):
            snapshots[chunk] = sorted(zip(offsets[ptr[chunk]:ptr[chunk + 1]], rows[ptr[chunk]:ptr[chunk + 1]]))
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    chunk_starts = []
    for _, start, end, slot in _sequences(query_start_loc, cache_indices):
        state = ssm_states[slot].float().clone()
        for chunk_start in range(start, end, GDN_CHUNK_SIZE):
            chunk_end = min(chunk_start + GDN_CHUNK_SIZE, end)
            taken = snapshots.get(len(chunk_starts), [])
            chunk_starts.append(state)
            # Run the chunk in pieces that end where a snapshot is asked for.
            piece_start = chunk_start
            for piece_end, row in [*((chunk_start + o, r) for o, r in taken), (chunk_end, None)]:
                if piece_end > piece_start:
                    piece_out, state = gated_delta_rule(
                        q[0, piece_start:piece_end], k[0, piece_start:piece_end], v[0, piece_start:piece_end],
                        g[0, piece_start:piece_end], beta[0, piece_start:piece_end], state,
                    )  # fmt: skip
                    out[0, piece_start:piece_end] = piece_out.to(out.dtype)
                    piece_start = piece_end
                if row is not None:
                    snapshot_states[row] = state.to(snapshot_states.dtype)
        ssm_states[slot] = state.to(ssm_states.dtype)
    state_shape = ssm_states.shape[1:]
    h = torch.stack(chunk_starts) if chunk_starts else ssm_states.new_empty((0, *state_shape), dtype=torch.float32)
    return out, None, h.unsqueeze(0)


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    **unused_kernel_options,
) -> torch.Tensor:
    """Drop-in for ``TritonGDNKernel.decode`` (fused sigmoid-gating recurrent update).

    q, k, v: [1, B, heads, dim]; a, b: [B, HV]. Gates are computed here from A_log and
    dt_bias; each row steps ``ssm_states[slot]`` in place. Returns [1, B, HV, V].
    """
    g, beta = gdn_gates(A_log, a, b, dt_bias)
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    for _, start, end, slot in _sequences(query_start_loc, cache_indices):
        seq_out, final_state = gated_delta_rule(
            q[0, start:end], k[0, start:end], v[0, start:end],
            g[start:end], beta[start:end], ssm_states[slot],
        )  # fmt: skip
        out[0, start:end] = seq_out.to(out.dtype)
        ssm_states[slot] = final_state.to(ssm_states.dtype)
    return out


def _torch_native_gdn_kernels() -> None:
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

    # The packed decode fuses the gating into a Triton kernel; without it the backend
    # splits q/k/v and calls ``decode``.
    TritonGDNKernel.supports_packed_decode = False
    TritonGDNKernel.supports_track_state_snapshot = False
    TritonGDNKernel.supports_position_snapshots = True
    TritonGDNKernel.extend = staticmethod(gdn_extend)
    TritonGDNKernel.decode = staticmethod(gdn_decode)


# --------------------------------------------------------------------------------------
# Causal depthwise conv1d (the short convolution in front of GDN / Mamba2 mixers)


def _conv_window(window: torch.Tensor, weight, bias, activation, num_outputs: int):
    """Depthwise conv over ``window`` [N, dim, state_len + L] (fp32); the last ``num_outputs``."""
    out = F.conv1d(
        window.float(),
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        groups=weight.shape[0],
    )[..., -num_outputs:]
    if activation in ("silu", "swish", True):
        out = F.silu(out)
    elif activation is not None:
        raise NotImplementedError(f"conv1d activation {activation!r}")
    return out


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens_cpu: list[int],
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    block_table: Optional[torch.Tensor] = None,
    **unused_kernel_options,
) -> torch.Tensor:
    """Drop-in for SGLang's varlen prefill ``causal_conv1d_fn``.

    x: [dim, total_tokens], sequences packed by ``query_start_loc``. A sequence continues
    from ``conv_states[slot]`` (its last W-1 inputs) when ``has_initial_state`` says so,
    otherwise from zeros; afterwards the slot holds its own last inputs. The state holds at
    least the W-1 inputs the convolution needs.
    """
    if block_table is not None:
        raise NotImplementedError("the CPU conv1d fallback does not support paged conv state")
    state_len = conv_states.shape[-1]
    if cache_indices is None:
        cache_indices = torch.arange(len(seq_lens_cpu))
    continues = (
        [False] * len(seq_lens_cpu) if has_initial_state is None else has_initial_state.tolist()
    )
    out = torch.empty_like(x)
    for seq, start, end, slot in _sequences(query_start_loc, cache_indices):
        if end == start:
            continue  # nothing to convolve; the state stays the sequence's
        prefix = conv_states[slot] if continues[seq] else x.new_zeros(x.shape[0], state_len)
        window = torch.cat([prefix.to(x.dtype), x[:, start:end]], dim=-1)
        out[:, start:end] = _conv_window(
            window[None], weight, bias, activation, end - start
        )[0].to(x.dtype)
        conv_states[slot] = window[:, -state_len:].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation=None,
    cache_seqlens: Optional[torch.Tensor] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    **unused_kernel_options,
) -> torch.Tensor:
    """Drop-in for SGLang's decode ``causal_conv1d_update``.

    x: [B, dim] or [B, dim, L]. Row i continues from ``conv_state[conv_state_indices[i]]``
    (rows with a negative slot are padding and left untouched) and shifts its L new inputs
    into that state.
    """
    if cache_seqlens is not None or intermediate_conv_window is not None:
        raise NotImplementedError(
            "the CPU conv1d fallback supports neither circular conv state nor speculative "
            "decoding"
        )
    single_token = x.dim() == 2
    x3 = x.unsqueeze(-1) if single_token else x
    if conv_state_indices is None:
        conv_state_indices = torch.arange(x3.shape[0], device=x.device)
    slots = conv_state_indices.long()
    rows = (slots >= 0).nonzero().flatten()
    slots = slots[rows]
    out = torch.zeros_like(x3)
    window = torch.cat([conv_state[slots].to(x.dtype), x3[rows]], dim=-1)
    out[rows] = _conv_window(window, weight, bias, activation, x3.shape[-1]).to(x.dtype)
    conv_state[slots] = window[..., -conv_state.shape[-1] :].to(conv_state.dtype)
    return out.squeeze(-1) if single_token else out


def _torch_native_causal_conv1d() -> None:
    from sglang.srt.layers.attention.linear import gdn_backend

    gdn_backend.causal_conv1d_fn = causal_conv1d_fn
    gdn_backend.causal_conv1d_update = causal_conv1d_update


# --------------------------------------------------------------------------------------
# Qwen3-Next's split of the fused input projections


def qkvzba_split_reshape_cat(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-in for SGLang's ``fused_qkvzba_split_reshape_cat`` (triton_gdn_fused_proj.py).

    The projections arrive interleaved per key-head group, ``[g0_q, g0_k, g0_v, g0_z, g1_q,
    ...]`` and ``[g0_b, g0_a, g1_b, ...]``; returns ``mixed_qkv`` (all q, all k, all v per
    token), ``z`` [T, HV, V], ``b`` and ``a`` [T, HV]. Pure data movement: bit-exact.
    """
    tokens = mixed_qkvz.shape[0]
    v_per_group = num_heads_v // num_heads_qk * head_v
    groups = mixed_qkvz.view(tokens, num_heads_qk, 2 * head_qk + 2 * v_per_group)
    q, k, v, z = groups.split([head_qk, head_qk, v_per_group, v_per_group], dim=-1)
    mixed_qkv = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
    b, a = mixed_ba.view(tokens, num_heads_qk, -1).chunk(2, dim=-1)
    return (
        mixed_qkv,
        z.reshape(tokens, num_heads_v, head_v).contiguous(),
        b.reshape(tokens, num_heads_v).contiguous(),
        a.reshape(tokens, num_heads_v).contiguous(),
    )


def _torch_native_qkvzba_split() -> None:
    from sglang.srt.models import qwen3_next

    qwen3_next.fused_qkvzba_split_reshape_cat = qkvzba_split_reshape_cat


# --------------------------------------------------------------------------------------
# Mamba2's mixer


def _torch_native_mamba2_kernels() -> None:
    # MambaMixer2 binds its conv1d only on CUDA, NPU or XPU (here the names are missing
    # altogether) and calls the Triton SSD scan and decode step by module-level name.
    from sglang.srt.layers.attention.mamba import mamba

    mamba.causal_conv1d_fn = mamba.causal_conv1d_fn_triton = causal_conv1d_fn
    mamba.causal_conv1d_update = mamba.causal_conv1d_update_triton = causal_conv1d_update
    mamba.mamba_chunk_scan_combined = cpu_mamba2_fallbacks.mamba_chunk_scan_combined
    mamba.selective_state_update = cpu_mamba2_fallbacks.selective_state_update

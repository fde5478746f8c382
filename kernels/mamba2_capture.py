"""Mamba2 (SSD) state at anchor positions inside one extend batch.

SGLang's ``mamba_chunk_scan_combined`` keeps the state at the start of every *physical*
chunk of the packed token stream (``chunk_size`` 256 for Nemotron-H), in the pool's dtype.
The state after ``pos`` tokens of a sequence is the state at the last chunk boundary before
it (or the state the sequence entered with, if it began after that boundary) advanced over
the at most ``chunk_size`` tokens in between. The SSD recurrence is diagonal per head,
``h = exp(dt_t A) h + dt_t x_t B_t^T``, so the advance over a block of tokens is one matrix
product, ``h = exp(A sum dt) h + (x * dt exp(A (C_last - C_t)))^T B`` with ``C`` the running
sum of ``dt``: this kernel takes it 64 tokens at a time on the matrix units.

Layouts: ``x (T, H, P)``, ``dt (T, H)`` as the mixer passes it to the scan (the kernel adds
``dt_bias``, applies softplus and clamps to ``dt_limit`` as the scan does), ``A (H,)``,
``B (T, G, N)``; states ``(H, P, N)``. Head ``h`` reads group ``h // (H // G)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, drop_unit_batch, on_device

NEMOTRON_H_CHUNK_SIZE = 256
_BLOCK_T = 64
_GPU_BLOCK_P = 64
_GPU_NUM_WARPS = 4
_GPU_DOT_PRECISION = "tf32"


@triton.jit
def _mamba2_capture_kernel(
    x, dt, dt_bias, A, B, chunk_states, initial_states, dst,
    base_rows, initial_rows, tok_starts, tok_ends, dst_slots,
    stride_x_t, stride_x_h, stride_x_p,
    stride_dt_t, stride_dt_h,
    stride_b_t, stride_b_g, stride_b_n,
    stride_cs_r, stride_cs_h, stride_cs_p, stride_cs_n,
    stride_init_r, stride_init_h, stride_init_p, stride_init_n,
    stride_dst_s, stride_dst_h, stride_dst_p, stride_dst_n,
    dt_min, dt_max,
    P: tl.constexpr,
    N: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    query = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    offs_t = tl.arange(0, BT)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_state = mask_p[:, None] & mask_n[None, :]

    # base row >= 0: a chunk-start state; -1: the sequence's entering state (-1: zeros).
    row = tl.load(base_rows + query).to(tl.int64)
    init_row = tl.load(initial_rows + query).to(tl.int64)
    from_chunk = tl.load(
        chunk_states + tl.maximum(row, 0) * stride_cs_r + head * stride_cs_h
        + offs_p[:, None] * stride_cs_p + offs_n[None, :] * stride_cs_n,
        mask=mask_state & (row >= 0), other=0.0,
    ).to(tl.float32)
    entering = tl.load(
        initial_states + tl.maximum(init_row, 0) * stride_init_r + head * stride_init_h
        + offs_p[:, None] * stride_init_p + offs_n[None, :] * stride_init_n,
        mask=mask_state & (row < 0) & (init_row >= 0), other=0.0,
    ).to(tl.float32)
    state = tl.where(row >= 0, from_chunk, entering)

    group = head // HEADS_PER_GROUP
    a = tl.load(A + head).to(tl.float32)
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + head).to(tl.float32)
    t_start = tl.load(tok_starts + query).to(tl.int64)
    t_end = tl.load(tok_ends + query).to(tl.int64)
    for t0 in range(t_start, t_end, BT):
        tok = t0 + offs_t
        valid = tok < t_end
        steps = tl.load(dt + tok * stride_dt_t + head * stride_dt_h, mask=valid, other=0.0).to(tl.float32)
        steps = steps + bias
        if DT_SOFTPLUS:
            steps = tl.where(steps <= 20.0, tl.log(1.0 + tl.exp(steps)), steps)
        # Padding tokens get dt = 0: no decay, no input.
        steps = tl.where(valid, tl.minimum(tl.maximum(steps, dt_min), dt_max), 0.0)
        inputs = tl.load(
            x + tok[:, None] * stride_x_t + head * stride_x_h + offs_p[None, :] * stride_x_p,
            mask=valid[:, None] & mask_p[None, :], other=0.0,
        ).to(tl.float32)
        b = tl.load(
            B + tok[:, None] * stride_b_t + group * stride_b_g + offs_n[None, :] * stride_b_n,
            mask=valid[:, None] & mask_n[None, :], other=0.0,
        ).to(tl.float32)
        cum = tl.cumsum(steps, axis=0)
        total = tl.sum(steps, axis=0)
        weights = steps * tl.exp(a * (total - cum))
        state = state * tl.exp(a * total) + tl.dot(
            tl.trans(inputs * weights[:, None]), b, input_precision=DOT_PRECISION
        )

    slot = tl.load(dst_slots + query).to(tl.int64)
    tl.store(
        dst + slot * stride_dst_s + head * stride_dst_h
        + offs_p[:, None] * stride_dst_p + offs_n[None, :] * stride_dst_n,
        state.to(dst.dtype.element_ty), mask=mask_state,
    )


def mamba2_capture_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    cu_seqlens: Sequence[int],
    chunk_states: torch.Tensor,
    query_seq: Sequence[int],
    query_pos: Sequence[int],
    dst: torch.Tensor,
    dst_slots: Sequence[int],
    *,
    initial_states: Optional[torch.Tensor] = None,
    initial_rows: Optional[Sequence[int]] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    chunk_size: int = NEMOTRON_H_CHUNK_SIZE,
) -> None:
    """Write the SSM state after tokens ``[0, query_pos[q])`` of sequence ``query_seq[q]``
    into ``dst[dst_slots[q]]`` (``dst``: ``(num_slots, H, P, N)``, e.g. one pool layer).

    ``chunk_states``: the scan's states at physical chunk starts (``(NC, H, P, N)`` or with a
    leading 1; ``NC = ceil(T / chunk_size)``). ``initial_states (R, H, P, N)`` with
    ``initial_rows`` (per sequence, -1: zeros) give each sequence's entering state; without
    them all sequences start from zeros. ``dt_bias``, ``dt_softplus`` and ``dt_limit`` are
    the scan's own arguments. Index arguments are host sequences (the scheduler holds them
    there): the only transfer to the device is one packed index tensor.
    """
    x = drop_unit_batch(x, 3, "x")
    dt = drop_unit_batch(dt, 2, "dt")
    B = drop_unit_batch(B, 3, "B")
    chunk_states = drop_unit_batch(chunk_states, 4, "chunk_states")
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1], B.shape[2]
    if dt.shape != (num_tokens, num_heads) or B.shape[0] != num_tokens or A.shape != (num_heads,) \
            or (dt_bias is not None and dt_bias.shape != (num_heads,)):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}, "
            f"dt_bias {None if dt_bias is None else tuple(dt_bias.shape)}"
        )
    if num_heads % num_groups:
        raise ValueError(f"{num_heads} heads are not a multiple of {num_groups} groups")
    state_shape = (num_heads, head_dim, state_dim)
    num_chunks = triton.cdiv(num_tokens, chunk_size)
    if tuple(chunk_states.shape) != (num_chunks, *state_shape):
        raise ValueError(f"chunk_states: expected ({num_chunks}, {num_heads}, {head_dim}, {state_dim}), "
                         f"got {tuple(chunk_states.shape)}")
    if dst.dim() != 4 or tuple(dst.shape[1:]) != state_shape:
        raise ValueError(f"dst: expected (num_slots, {num_heads}, {head_dim}, {state_dim}), got {tuple(dst.shape)}")
    if (initial_states is None) != (initial_rows is None):
        raise ValueError("initial states and their rows must be given together")
    if initial_states is not None and (initial_states.dim() != 4 or tuple(initial_states.shape[1:]) != state_shape):
        raise ValueError(f"initial_states: expected (rows, {num_heads}, {head_dim}, {state_dim}), "
                         f"got {tuple(initial_states.shape)}")

    cu = np.asarray(cu_seqlens, dtype=np.int64)
    seq = np.asarray(query_seq, dtype=np.int64)
    pos = np.asarray(query_pos, dtype=np.int64)
    slots = np.asarray(dst_slots, dtype=np.int64)
    if cu[0] != 0 or cu[-1] != num_tokens or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens must rise from 0 to {num_tokens}")
    if not seq.size == pos.size == slots.size:
        raise ValueError("query_seq, query_pos and dst_slots differ in length")
    if seq.size == 0:
        return
    if seq.min() < 0 or seq.max() >= cu.size - 1 or (pos < 0).any() or (pos > np.diff(cu)[seq]).any():
        raise IndexError("queries must name a sequence of the batch and a position within its tokens")
    if slots.min() < 0 or slots.max() >= dst.shape[0] or np.unique(slots).size != slots.size:
        raise IndexError(f"dst_slots must be distinct and lie in [0, {dst.shape[0]})")
    rows = np.full(cu.size - 1, -1) if initial_rows is None else np.asarray(initial_rows, dtype=np.int64)

    # The chunk-start row at packed boundary b belongs to this sequence only if the
    # sequence started before b; the boundary at the very end of the batch has no row.
    seq_start = cu[seq]
    token = seq_start + pos
    chunk = np.minimum(token // chunk_size, num_chunks - 1)
    boundary = chunk * chunk_size
    from_chunk = boundary > seq_start
    packed = np.stack([
        np.where(from_chunk, chunk, -1),
        rows[seq],
        np.where(from_chunk, boundary, seq_start),
        token,
        slots,
    ]).astype(np.int32)
    index = torch.from_numpy(packed).to(x.device)
    init = initial_states if initial_states is not None else chunk_states

    block_n = triton.next_power_of_2(state_dim)
    block_p = triton.next_power_of_2(head_dim) if INTERPRET else min(_GPU_BLOCK_P, triton.next_power_of_2(head_dim))
    grid = (seq.size, num_heads, triton.cdiv(head_dim, block_p))
    with on_device(x.device):
        _mamba2_capture_kernel[grid](
            x, dt, A if dt_bias is None else dt_bias, A, B, chunk_states, init, dst,
            *index,
            *x.stride(), *dt.stride(), *B.stride(),
            *chunk_states.stride(), *init.stride(), *dst.stride(),
            float(dt_limit[0]), float(dt_limit[1]),
            P=head_dim, N=state_dim, HEADS_PER_GROUP=num_heads // num_groups,
            HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
            BP=block_p, BN=block_n, BT=_BLOCK_T, DOT_PRECISION=_GPU_DOT_PRECISION, num_warps=_GPU_NUM_WARPS,
        )

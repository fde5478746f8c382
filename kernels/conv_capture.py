"""Causal-conv state at anchor positions inside one extend batch.

The conv state after ``pos`` tokens is the last ``W = kernel - 1`` pre-conv inputs before
that position, in SGLang's ``(dim, W)`` layout (oldest first); where ``pos < W`` its oldest
columns come from the state the sequence entered the batch with. Values are copied, never
computed (converted only if the input and slot dtypes differ), so a capture is bit-exact.
It must run before the layer's convolution overwrites the entering states.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, on_device
from .capture_index import CaptureIndex

_GPU_BLOCK_DIM = 256


@triton.jit
def _conv_capture_kernel(
    x, entering_states, dst,
    seqs, seq_starts, ends, continues, entering_rows, dst_slots,
    stride_x_t, stride_x_d,
    stride_e_r, stride_e_d, stride_e_w,
    stride_dst_s, stride_dst_d, stride_dst_w,
    DIM: tl.constexpr,
    W: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
):
    query = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    offs_w = tl.arange(0, BW)
    mask = (offs_d < DIM)[:, None] & (offs_w < W)[None, :]

    seq_start = tl.load(seq_starts + query).to(tl.int64)
    end = tl.load(ends + query).to(tl.int64)
    # Column w holds the input at packed index end - W + w (oldest first).
    token = end - W + offs_w
    in_batch = (token >= seq_start)[None, :]
    window = tl.load(
        x + tl.maximum(token, seq_start)[None, :] * stride_x_t + offs_d[:, None] * stride_x_d,
        mask=mask & in_batch, other=0.0,
    ).to(dst.dtype.element_ty)
    # Before the batch: column W + (token - seq_start) of the entering state, if any.
    entering = tl.load(continues + query) != 0
    row = tl.load(entering_rows + tl.load(seqs + query), mask=entering, other=0).to(tl.int64)
    before = tl.load(
        entering_states + row * stride_e_r + offs_d[:, None] * stride_e_d
        + tl.maximum(W + token - seq_start, 0)[None, :] * stride_e_w,
        mask=mask & (token < seq_start)[None, :] & entering, other=0.0,
    ).to(dst.dtype.element_ty)
    # where, not +: a sum would turn a copied -0.0 into +0.0.
    window = tl.where(in_batch, window, before)

    slot = tl.load(dst_slots + query).to(tl.int64)
    tl.store(
        dst + slot * stride_dst_s + offs_d[:, None] * stride_dst_d + offs_w[None, :] * stride_dst_w,
        window, mask=mask,
    )


def conv_capture_states(
    x: torch.Tensor,
    index: CaptureIndex,
    dst: torch.Tensor,
    entering_states: torch.Tensor,
    entering_rows: torch.Tensor,
) -> None:
    """Write each capture of ``index`` into ``dst[index.slot[q]]`` (``(num_slots, dim, W)``).

    ``x``: pre-conv inputs ``(T, dim)``, any strides (SGLang's transposed ``(dim, T)``
    buffer can be passed as ``buf.t()``). A sequence that ``continues`` entered with the
    state ``entering_states[entering_rows[seq]]`` (``(rows, dim, W)``, e.g. the live pool's
    conv layer and its slots); the others with zeros.
    """
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2:
        raise ValueError(f"x: expected (tokens, dim), got {tuple(x.shape)}")
    dim = x.shape[1]
    if dst.dim() != 3 or dst.shape[1] != dim:
        raise ValueError(f"dst: expected (num_slots, {dim}, kernel - 1), got {tuple(dst.shape)}")
    width = dst.shape[2]
    if entering_states.dim() != 3 or tuple(entering_states.shape[1:]) != (dim, width):
        raise ValueError(f"entering_states: expected (rows, {dim}, {width}), got {tuple(entering_states.shape)}")
    if len(index) == 0:
        return
    block_w = triton.next_power_of_2(width)
    block_d = triton.next_power_of_2(dim) if INTERPRET else min(_GPU_BLOCK_DIM, triton.next_power_of_2(dim))
    grid = (len(index), triton.cdiv(dim, block_d))
    with on_device(x.device):
        _conv_capture_kernel[grid](
            x, entering_states, dst,
            index.seq, index.seq_start, index.end, index.continues, entering_rows, index.slot,
            *x.stride(), *entering_states.stride(), *dst.stride(),
            DIM=dim, W=width, BD=block_d, BW=block_w, num_warps=4,
        )

"""Batched snapshot / restore of recurrent states between two slot pools in one launch.

Both pools are shaped as SGLang's ``MambaPool.State``: every conv tensor is
``(num_layers, num_slots, *conv_shape)`` and the temporal tensor is
``(num_layers, num_slots, *temporal_shape)``, with any layer and slot strides: layer-major
as SGLang's pools, or slot-major (``slot_major_pool``: each slot one contiguous run of bytes,
so moving it between device and host memory is one copy). Same per-slot shapes and dtypes,
own number of slots: the same function snapshots (live pool -> checkpoint pool), restores
(checkpoint pool -> live pool) and stages checkpoints for the host tier.

The kernel copies raw machine words, never values: each tensor's per-slot row is
reinterpreted as int32 (or int16 / uint8 when a row's byte size or stride does not allow
it), so bf16 conv states and fp32 temporal states share one compiled kernel and the copy
is bit-exact (NaN payloads and signed zeros included).
"""

import math

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, on_device

# The conv state of SGLang's recurrent layers is a list (one tensor for Mamba2 / GDN,
# several for models with separate q/k/v convolutions); one temporal tensor follows.
MAX_CONV_TENSORS = 3
_MAX_TENSORS = MAX_CONV_TENSORS + 1

# Words copied per program.  On a GPU 16 KiB per program keeps enough programs in flight
# to saturate HBM; the CPU interpreter runs programs one after another, so there each
# program takes a whole (large) row to keep the number of programs small.
_GPU_SEGMENT_WORDS = 4096
_GPU_BLOCK_WORDS = 1024
_GPU_NUM_WARPS = 4
_INTERPRET_MAX_SEGMENT_WORDS = 1 << 16


@triton.jit
def _copy_row_segment(
    src,
    dst,
    src_layer_stride,
    src_slot_stride,
    dst_layer_stride,
    dst_slot_stride,
    row_words,
    layer,
    src_slot,
    dst_slot,
    segment,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    src_row = src + layer * src_layer_stride + src_slot * src_slot_stride
    dst_row = dst + layer * dst_layer_stride + dst_slot * dst_slot_stride
    segment_start = segment * SEGMENT
    for block_start in tl.static_range(0, SEGMENT, BLOCK):
        offs = segment_start + block_start + tl.arange(0, BLOCK)
        mask = offs < row_words
        words = tl.load(src_row + offs, mask=mask)
        tl.store(dst_row + offs, words, mask=mask)


@triton.jit
def _copy_states_kernel(
    src_slots,
    dst_slots,
    num_layers,
    segments_per_layer,
    # Tensor i (i < NUM_TENSORS): word views of source / destination, their layer and
    # slot strides in words, the row length in words, and the exclusive end of its
    # segment range inside one (pair, layer).  Unused trailing entries repeat tensor 0.
    src0, dst0, src0_ls, src0_ss, dst0_ls, dst0_ss, row0, seg_end0,
    src1, dst1, src1_ls, src1_ss, dst1_ls, dst1_ss, row1, seg_end1,
    src2, dst2, src2_ls, src2_ss, dst2_ls, dst2_ss, row2, seg_end2,
    src3, dst3, src3_ls, src3_ss, dst3_ls, dst3_ss, row3,
    NUM_TENSORS: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Grid: one program per (pair, layer, segment); segments of all tensors of a layer
    # are numbered consecutively (tensor 0 first).
    pid = tl.program_id(0).to(tl.int64)
    segment = pid % segments_per_layer
    pair_layer = pid // segments_per_layer
    layer = pair_layer % num_layers
    pair = pair_layer // num_layers
    src_slot = tl.load(src_slots + pair).to(tl.int64)
    dst_slot = tl.load(dst_slots + pair).to(tl.int64)

    if segment < seg_end0:
        _copy_row_segment(src0, dst0, src0_ls, src0_ss, dst0_ls, dst0_ss, row0,
                          layer, src_slot, dst_slot, segment, SEGMENT, BLOCK)
    if NUM_TENSORS > 1:
        if (segment >= seg_end0) & (segment < seg_end1):
            _copy_row_segment(src1, dst1, src1_ls, src1_ss, dst1_ls, dst1_ss, row1,
                              layer, src_slot, dst_slot, segment - seg_end0, SEGMENT, BLOCK)
    if NUM_TENSORS > 2:
        if (segment >= seg_end1) & (segment < seg_end2):
            _copy_row_segment(src2, dst2, src2_ls, src2_ss, dst2_ls, dst2_ss, row2,
                              layer, src_slot, dst_slot, segment - seg_end1, SEGMENT, BLOCK)
    if NUM_TENSORS > 3:
        if segment >= seg_end2:
            _copy_row_segment(src3, dst3, src3_ls, src3_ss, dst3_ls, dst3_ss, row3,
                              layer, src_slot, dst_slot, segment - seg_end2, SEGMENT, BLOCK)


def _check_pool_tensor(name: str, t: torch.Tensor) -> None:
    if t.dim() < 3:
        raise ValueError(
            f"{name}: expected (num_layers, num_slots, *state_shape), got shape {tuple(t.shape)}"
        )
    if not t[0, 0].is_contiguous():
        raise ValueError(
            f"{name}: the per-slot state must be contiguous (strides {t.stride()} for shape "
            f"{tuple(t.shape)}); only the layer and slot dimensions may be strided"
        )


def _check_pairs(
    src_tensors: list[torch.Tensor],
    dst_tensors: list[torch.Tensor],
    names: list[str],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    num_layers = src_tensors[0].shape[0]
    device = src_tensors[0].device
    for name, src, dst in zip(names, src_tensors, dst_tensors):
        _check_pool_tensor(f"src {name}", src)
        _check_pool_tensor(f"dst {name}", dst)
        if src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
            raise ValueError(
                f"{name}: per-slot state differs between source {tuple(src.shape[2:])} "
                f"{src.dtype} and destination {tuple(dst.shape[2:])} {dst.dtype}"
            )
        if src.shape[0] != num_layers or dst.shape[0] != num_layers:
            raise ValueError(
                f"{name}: expected {num_layers} layers in source and destination, got "
                f"{src.shape[0]} and {dst.shape[0]}"
            )
        if src.device != device or dst.device != device:
            raise ValueError(f"{name}: all states must be on {device}, got {src.device} / {dst.device}")
    for side, tensors in (("source", src_tensors), ("destination", dst_tensors)):
        if len({t.shape[1] for t in tensors}) != 1:
            raise ValueError(
                f"{side}: conv and temporal tensors disagree on the number of slots: "
                f"{[t.shape[1] for t in tensors]}"
            )
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected a 1-D int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
        if slots.device != device:
            raise ValueError(f"{name}: expected on {device}, got {slots.device}")
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(
            f"src_slots has {src_slots.numel()} entries but dst_slots has {dst_slots.numel()}"
        )


def _check_slot_ranges(
    src_slots: torch.Tensor, dst_slots: torch.Tensor, num_src_slots: int, num_dst_slots: int
) -> None:
    # One device->host transfer for all checks.
    src_min, src_max, dst_min, dst_max, dst_distinct = torch.stack(
        [
            src_slots.min().long(),
            src_slots.max().long(),
            dst_slots.min().long(),
            dst_slots.max().long(),
            torch.unique(dst_slots).numel() * torch.ones((), dtype=torch.long, device=dst_slots.device),
        ]
    ).tolist()
    if src_min < 0 or src_max >= num_src_slots:
        raise IndexError(f"src_slots must lie in [0, {num_src_slots}), got range [{src_min}, {src_max}]")
    if dst_min < 0 or dst_max >= num_dst_slots:
        raise IndexError(f"dst_slots must lie in [0, {num_dst_slots}), got range [{dst_min}, {dst_max}]")
    if dst_distinct != dst_slots.numel():
        raise ValueError("dst_slots contains duplicates: two copies would write the same slot")


def _word_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """(L, S, *shape) tensors as (L, S, row_words) views of one common integer word type.

    The widest word (int32, then int16, then uint8) that every tensor's row length and
    strides allow is used, so one compiled kernel serves every dtype mix of a call.
    """
    rows = [t.flatten(2) for t in tensors]
    for word in (torch.int32, torch.int16, torch.uint8):
        try:
            return [r.view(word) for r in rows]
        except RuntimeError:
            continue
    raise AssertionError("a view as uint8 of a row-contiguous tensor cannot fail")


def copy_states(
    src_conv: list[torch.Tensor],
    src_temporal: torch.Tensor,
    dst_conv: list[torch.Tensor],
    dst_temporal: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Copy, for every layer, the conv and temporal states of ``src_slots[i]`` into ``dst_slots[i]``.

    Args:
        src_conv / dst_conv: lists (same length, at most ``MAX_CONV_TENSORS``) of
            ``(num_layers, num_src_slots | num_dst_slots, *conv_shape)`` tensors.
        src_temporal / dst_temporal: ``(num_layers, num_slots, *temporal_shape)``.
        src_slots / dst_slots: 1-D int32/int64 tensors of equal length N on the states' device.
        check_slots: verify slot ranges and that destinations are distinct.  This reads
            the slot tensors back to the host (a device sync); callers whose slot ids
            come from their own allocator may skip it on the hot path.

    One kernel launch regardless of N, layer count or dtype mix.  Source and destination
    may be the same pool if no slot appears on both sides.
    """
    if len(src_conv) != len(dst_conv):
        raise ValueError(f"src_conv has {len(src_conv)} tensors but dst_conv has {len(dst_conv)}")
    if len(src_conv) > MAX_CONV_TENSORS:
        raise ValueError(f"at most {MAX_CONV_TENSORS} conv tensors are supported, got {len(src_conv)}")
    src_tensors = [*src_conv, src_temporal]
    dst_tensors = [*dst_conv, dst_temporal]
    names = [f"conv[{i}]" for i in range(len(src_conv))] + ["temporal"]
    _check_pairs(src_tensors, dst_tensors, names, src_slots, dst_slots)
    num_pairs = src_slots.numel()
    if num_pairs == 0:
        return
    if check_slots:
        _check_slot_ranges(src_slots, dst_slots, src_temporal.shape[1], dst_temporal.shape[1])

    # One word type for both sides: a strided pool may force a narrower word than its peer.
    words = _word_views(src_tensors + dst_tensors)
    src_words, dst_words = words[: len(src_tensors)], words[len(src_tensors) :]

    max_row = max(w.shape[2] for w in src_words)
    if INTERPRET:
        segment = min(triton.next_power_of_2(max_row), _INTERPRET_MAX_SEGMENT_WORDS)
        block = segment
    else:
        segment = _GPU_SEGMENT_WORDS
        block = _GPU_BLOCK_WORDS

    args = []
    seg_end = 0
    for i in range(_MAX_TENSORS):
        j = i if i < len(src_words) else 0
        s, d = src_words[j], dst_words[j]
        row = s.shape[2]
        if i < len(src_words):
            seg_end += triton.cdiv(row, segment)
        args += [s, d, s.stride(0), s.stride(1), d.stride(0), d.stride(1), row]
        if i < _MAX_TENSORS - 1:
            args.append(seg_end)
    segments_per_layer = seg_end
    num_layers = src_temporal.shape[0]
    grid = (num_pairs * num_layers * segments_per_layer,)
    with on_device(src_temporal.device):
        _copy_states_kernel[grid](
            src_slots,
            dst_slots,
            num_layers,
            segments_per_layer,
            *args,
            NUM_TENSORS=len(src_words),
            SEGMENT=segment,
            BLOCK=block,
            num_warps=_GPU_NUM_WARPS,
        )


# Segments of a slot start on 256-byte boundaries: every dtype's alignment, and whole cache
# lines for the copy kernel's vector loads.
_SEGMENT_ALIGNMENT = 256


def _segments(num_layers: int, specs) -> tuple[list[int], int]:
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        nbytes = num_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        end += -(-nbytes // _SEGMENT_ALIGNMENT) * _SEGMENT_ALIGNMENT
    return offsets, end


def slot_major_bytes(num_layers: int, specs) -> int:
    """Bytes of one slot of ``slot_major_pool`` (its tensors, each padded to 256 bytes)."""
    return _segments(num_layers, specs)[1]


def slot_major_pool(num_layers: int, specs, rows: int, device, pin_memory: bool = False, zeroed: bool = True):
    """A pool of ``rows`` slots (zeroed, or left as allocated) whose every slot is one
    contiguous run of bytes.

    ``specs``: ``(shape, dtype)`` of each state tensor, the temporal one last. Returns
    ``(storage, conv list, temporal)``: ``storage`` is ``(rows, slot_bytes)`` uint8 and the
    others are typed ``(num_layers, rows, *shape)`` views of it, shaped as SGLang's
    ``MambaPool`` but strided slot-major.
    """
    offsets, slot_bytes = _segments(num_layers, specs)
    allocate = torch.zeros if zeroed else torch.empty
    storage = allocate((rows, slot_bytes), dtype=torch.uint8, device=device, pin_memory=pin_memory)
    views = []
    for (shape, dtype), offset in zip(specs, offsets):
        nbytes = num_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        typed = storage[:, offset:offset + nbytes].view(dtype)
        views.append(typed.view(rows, num_layers, *shape).transpose(0, 1))
    return storage, views[:-1], views[-1]

"""Kernels against their torch references.

By default the kernels run under Triton's CPU interpreter on CPU tensors.  With
``TRITON_INTERPRET=0`` in the environment (bench/gpu_check.sh) they are compiled and the
tests run on CUDA.
"""

import os

# Must precede the first triton import (through torch or the kernels).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sglang_hybrid.kernels import (  # noqa: E402
    CaptureIndex,
    conv_capture_states,
    copy_states,
    mamba2_capture_states,
)
from sglang_hybrid.kernels.reference import (  # noqa: E402
    conv_states_reference,
    copy_states_reference,
    mamba2_states_reference,
)

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need a CUDA device", allow_module_level=True)
# The Mamba2 capture multiplies fp32 matrices: exactly under the interpreter, on a GPU's
# matrix units in tf32 (10-bit mantissa), whose rounding bounds the agreement there.
FP32_PRODUCT_TOLERANCE = 1e-5 if INTERPRET else 3e-3


@pytest.fixture(params=["cpu" if INTERPRET else "cuda"])
def device(request) -> torch.device:
    return torch.device(request.param)


def _random_bits(shape, dtype, generator, device):
    """Arbitrary bit patterns (NaN payloads, infinities, signed zeros, denormals)."""
    int_dtype = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    info = torch.iinfo(int_dtype)
    bits = torch.randint(info.min, info.max, shape, generator=generator, dtype=int_dtype)
    return bits.view(dtype).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _cu_seqlens(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- copy


def _pool(num_layers, num_slots, shapes_dtypes, generator, device, slot_major=False):
    """Conv list + temporal tensor of one pool, filled with random bit patterns.

    ``slot_major`` lays slots outermost (the layer dimension strided inside a slot), as an
    envelope-strided pool does, to exercise non-contiguous layer / slot strides.
    """
    tensors = []
    for shape, dtype in shapes_dtypes:
        if slot_major:
            t = _random_bits((num_slots, num_layers, *shape), dtype, generator, device).transpose(0, 1)
        else:
            t = _random_bits((num_layers, num_slots, *shape), dtype, generator, device)
        tensors.append(t)
    return tensors[:-1], tensors[-1]


@pytest.mark.parametrize(
    "shapes_dtypes",
    [
        # GDN-like: one bf16 conv state (dim, K-1), fp32 temporal (HV, V, K).
        [((24, 3), torch.bfloat16), ((2, 8, 8), torch.float32)],
        # Several conv tensors, one with an odd byte count per row (forces 2-byte words).
        [((7, 3), torch.bfloat16), ((16, 3), torch.float16), ((4, 3), torch.float32),
         ((3, 4, 4), torch.float32)],
    ],
    ids=["gdn", "multi_conv_odd_rows"],
)
@pytest.mark.parametrize("slot_major", [False, True], ids=["layer_major", "slot_major"])
def test_copy_states_snapshot_and_restore_bit_exact(device, shapes_dtypes, slot_major):
    gen = torch.Generator().manual_seed(0)
    num_layers = 3
    work_conv, work_temporal = _pool(num_layers, 6, shapes_dtypes, gen, device, slot_major)
    ckpt_conv, ckpt_temporal = _pool(num_layers, 9, shapes_dtypes, gen, device)
    work_before = [t.clone() for t in (*work_conv, work_temporal)]

    # Snapshot: working slots 5, 1, 2 -> checkpoint slots 0, 8, 4.
    work_slots = torch.tensor([5, 1, 2], device=device)
    ckpt_slots = torch.tensor([0, 8, 4], device=device)
    expected = [t.clone() for t in (*ckpt_conv, ckpt_temporal)]
    copy_states_reference(work_conv, work_temporal, expected[:-1], expected[-1], work_slots, ckpt_slots)
    copy_states(work_conv, work_temporal, ckpt_conv, ckpt_temporal, work_slots, ckpt_slots)
    for got, want in zip((*ckpt_conv, ckpt_temporal), expected):
        assert torch.equal(_bits(got), _bits(want))
    for got, want in zip((*work_conv, work_temporal), work_before):
        assert torch.equal(_bits(got), _bits(want)), "the source pool must not change"

    # Restore: checkpoint slots 8, 4 -> working slots 0, 3 (int32 indices this time).
    restore_src = torch.tensor([8, 4], dtype=torch.int32, device=device)
    restore_dst = torch.tensor([0, 3], dtype=torch.int32, device=device)
    copy_states(ckpt_conv, ckpt_temporal, work_conv, work_temporal, restore_src, restore_dst)
    for work, before in zip((*work_conv, work_temporal), work_before):
        assert torch.equal(_bits(work[:, 0]), _bits(before[:, 1]))
        assert torch.equal(_bits(work[:, 3]), _bits(before[:, 2]))
        untouched = [1, 2, 4, 5]
        assert torch.equal(_bits(work[:, untouched]), _bits(before[:, untouched]))


def test_copy_states_rejects_bad_inputs(device):
    gen = torch.Generator().manual_seed(1)
    spec = [((8, 3), torch.bfloat16), ((2, 4, 4), torch.float32)]
    src_conv, src_temporal = _pool(2, 4, spec, gen, device)
    dst_conv, dst_temporal = _pool(2, 5, spec, gen, device)
    ok = torch.tensor([0, 1], device=device)

    with pytest.raises(IndexError, match="src_slots"):
        copy_states(src_conv, src_temporal, dst_conv, dst_temporal, torch.tensor([0, 4], device=device), ok)
    with pytest.raises(IndexError, match="dst_slots"):
        copy_states(src_conv, src_temporal, dst_conv, dst_temporal, ok, torch.tensor([-1, 2], device=device))
    with pytest.raises(ValueError, match="duplicates"):
        copy_states(src_conv, src_temporal, dst_conv, dst_temporal, ok, torch.tensor([3, 3], device=device))
    with pytest.raises(ValueError, match="temporal"):
        copy_states(src_conv, src_temporal, dst_conv, dst_temporal.to(torch.bfloat16), ok, ok)
    other_conv, _ = _pool(2, 5, [((8, 4), torch.bfloat16), ((1,), torch.float32)], gen, device)
    with pytest.raises(ValueError, match=r"conv\[0\]"):
        copy_states(src_conv, src_temporal, other_conv, dst_temporal, ok, ok)
    with pytest.raises(ValueError, match="entries"):
        copy_states(src_conv, src_temporal, dst_conv, dst_temporal, ok, ok[:1])


# ----------------------------------------------------------------------------- captures


def _queries(lens, interesting):
    """(seq, pos) for every interesting position that lies inside a sequence's tokens."""
    seqs, positions = [], []
    for s, n in enumerate(lens):
        for p in sorted({*interesting, n - 1, n}):
            if 0 <= p <= n:
                seqs.append(s)
                positions.append(p)
    return seqs, positions


def _scattered_slots(count, num_slots, seed):
    return torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def test_capture_index_geometry():
    # Sequences of 70, 64 and 5 tokens: fla chunks [0, 64) [64, 70) | [70, 134) | [134, 139).
    index = CaptureIndex.build(
        [70, 64, 5], [True, False, True], seq=[0, 1, 0, 1, 2], pos=[3, 0, 70, 64, 5],
        slots=[9, 8, 7, 6, 5], device="cpu",
    )
    assert index.seq_start.tolist() == [0, 70, 0, 70, 134]
    assert index.end.tolist() == [3, 70, 70, 134, 139]
    assert index.continues.tolist() == [1, 0, 1, 0, 1]
    # Chunk order: chunk 0 has pos 3; chunk 1 the end of sequence 0 (6 tokens into it);
    # chunk 2 the start of sequence 1 and its end (pos 64 ends that 64-token chunk).
    assert index.snapshot_chunk_ptr.tolist() == [0, 1, 2, 4, 5]
    assert index.snapshot_offsets.tolist() == [3, 6, 0, 64, 5]
    assert index.snapshot_rows.tolist() == [9, 7, 8, 6, 5]
    assert index.snapshots_per_chunk == 2
    three_in_a_chunk = CaptureIndex.build([64], [False], [0, 0, 0], [10, 20, 64], [1, 2, 3], "cpu")
    assert three_in_a_chunk.snapshots_per_chunk == 4


def test_capture_index_rejects_bad_captures():
    build = CaptureIndex.build
    with pytest.raises(IndexError, match="positions"):
        build([10, 70], [False, False], [0], [11], [0], "cpu")
    with pytest.raises(IndexError, match="sequences"):
        build([10, 70], [False, False], [2], [0], [0], "cpu")
    with pytest.raises(ValueError, match="same checkpoint slot"):
        build([10, 70], [False, False], [0, 1], [3, 4], [1, 1], "cpu")
    with pytest.raises(ValueError, match="no tokens"):
        build([10, 0], [False, False], [1], [0], [1], "cpu")
    with pytest.raises(IndexError, match="non-negative"):
        build([10], [False], [0], [1], [-1], "cpu")


# ----------------------------------------------------------------------------- Mamba2

# Packed physical chunks of 16 tokens: sequences 1 and 3 start exactly on a chunk
# boundary, sequence 3 has one token, and the batch ends on a boundary (96 = 6 * 16).
MAMBA_LENS = [16, 20, 12, 1, 47]
MAMBA_CHUNK = 16


def _mamba_inputs(dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    heads, groups, head_dim, state_dim = 4, 2, 8, 16
    total = sum(MAMBA_LENS)
    x = torch.randn(total, heads, head_dim, generator=gen)
    dt = F.softplus(torch.randn(total, heads, generator=gen) - 1.0)
    A = -torch.rand(heads, generator=gen) * 2.0
    B = torch.randn(total, groups, state_dim, generator=gen)
    initial_states = torch.randn(3, heads, head_dim, state_dim, generator=gen)
    # Sequence i enters with row initial_rows[i]; -1 starts from zeros.
    initial_rows = [2, -1, 0, 1, -1]
    x, B = (t.to(dtype).to(device) for t in (x, B))
    return x, dt.to(device), A.to(device), B, initial_states.to(device), initial_rows


def _mamba_packed_chunk_states(x, dt, A, B, cu, initial_per_seq):
    """SSD intermediate states: row c is the state at packed token c * chunk of the
    sequence holding token c * chunk - 1.  Row 0 (never a valid base) is NaN."""
    total = x.shape[0]
    bounds = cu.tolist()
    seqs, positions = [], []
    for c in range(1, -(-total // MAMBA_CHUNK)):
        boundary = c * MAMBA_CHUNK
        s = max(i for i in range(len(MAMBA_LENS)) if bounds[i] <= boundary - 1)
        seqs.append(s)
        positions.append(boundary - bounds[s])
    dev = x.device
    states = mamba2_states_reference(
        x, dt, A, B, cu, initial_per_seq, torch.tensor(seqs, device=dev), torch.tensor(positions, device=dev)
    )
    return torch.cat([torch.full_like(states[:1], float("nan")), states])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mamba2_capture_matches_sequential_recurrence(device, dtype):
    # fp32 chunk states (SGLang passes state_dtype = the pool's fp32), so bf16 x / B only
    # change the inputs both sides read: the same bound holds.
    x, dt, A, B, initial_states, initial_rows = _mamba_inputs(dtype, device, seed=3)
    cu = _cu_seqlens(MAMBA_LENS, device)
    initial_per_seq = torch.stack([
        initial_states[i] if i >= 0 else torch.zeros_like(initial_states[0]) for i in initial_rows
    ])
    chunk_states = _mamba_packed_chunk_states(x, dt, A, B, cu, initial_per_seq)
    seqs, positions = _queries(MAMBA_LENS, {0, 1, 2, 15, 16, 17})

    dst = torch.full((len(seqs) + 2, *chunk_states.shape[1:]), float("nan"), device=device)
    slots = [q + 2 for q in range(len(seqs))]
    mamba2_capture_states(
        x.unsqueeze(0), dt.unsqueeze(0), A, B.unsqueeze(0), cu.tolist(), chunk_states.unsqueeze(0),
        seqs, positions, dst, slots,
        initial_states=initial_states, initial_rows=initial_rows, chunk_size=MAMBA_CHUNK,
    )

    expected = mamba2_states_reference(
        x, dt, A, B, cu, initial_per_seq, torch.tensor(seqs, device=device), torch.tensor(positions, device=device)
    )
    assert _relative_error(dst[2:], expected) <= FP32_PRODUCT_TOLERANCE
    assert dst[:2].isnan().all()


def test_mamba2_capture_without_initial_states(device):
    x, dt, A, B, _, _ = _mamba_inputs(torch.float32, device, seed=4)
    cu = _cu_seqlens(MAMBA_LENS, device)
    chunk_states = _mamba_packed_chunk_states(x, dt, A, B, cu, None)
    seqs, positions = [0, 1, 2, 4, 4], [5, 20, 0, 1, 33]
    dst = torch.empty(5, *chunk_states.shape[1:], device=device)
    mamba2_capture_states(x, dt, A, B, cu.tolist(), chunk_states, seqs, positions, dst, range(5),
                          chunk_size=MAMBA_CHUNK)
    expected = mamba2_states_reference(
        x, dt, A, B, cu, None, torch.tensor(seqs, device=device), torch.tensor(positions, device=device)
    )
    assert torch.equal(dst[2], torch.zeros_like(dst[2])), "an empty prefix without initial state is zero"
    assert _relative_error(dst, expected) <= FP32_PRODUCT_TOLERANCE


# ----------------------------------------------------------------------------- conv

CONV_LENS = [1, 2, 9, 5]
CONV_DIM, CONV_WIDTH = 10, 3


@pytest.mark.parametrize("with_entering", [True, False], ids=["entering_state", "zeros"])
def test_conv_capture_bit_exact(device, with_entering):
    gen = torch.Generator().manual_seed(5)
    total = sum(CONV_LENS)
    # SGLang keeps the pre-conv activations as (dim, T); pass the transposed view.
    x_dim_major = _random_bits((CONV_DIM, total), torch.bfloat16, gen, device)
    x = x_dim_major.t()
    cu = _cu_seqlens(CONV_LENS, device)
    seqs, positions = _queries(CONV_LENS, {0, 1, 2, 3})
    # Live-pool rows the sequences entered with; those that do not continue start from zeros.
    entering_states = _random_bits((4, CONV_DIM, CONV_WIDTH), torch.bfloat16, gen, device)
    entering_rows = torch.tensor([1, 3, 0, 2], dtype=torch.int32, device=device)
    continues = [True, False, True, True] if with_entering else [False] * 4
    initial_per_seq = torch.stack([
        entering_states[row] if go_on else torch.zeros_like(entering_states[0])
        for row, go_on in zip(entering_rows.tolist(), continues)
    ])

    num_slots = len(seqs) + 3
    sentinel = _random_bits((num_slots, CONV_DIM, CONV_WIDTH), torch.bfloat16, gen, device)
    dst = sentinel.clone()
    slots = [q + 3 for q in reversed(range(len(seqs)))]
    index = CaptureIndex.build(CONV_LENS, continues, seqs, positions, slots, device)
    conv_capture_states(x, index, dst, entering_states, entering_rows)

    expected = conv_states_reference(
        x, cu, initial_per_seq, torch.tensor(seqs, device=device), torch.tensor(positions, device=device),
        CONV_WIDTH,
    )
    assert torch.equal(_bits(dst[torch.tensor(slots, device=device)]), _bits(expected))
    assert torch.equal(_bits(dst[:3]), _bits(sentinel[:3]))


def test_mamba2_capture_applies_the_scans_dt_bias_and_softplus(device):
    # The mixer passes dt raw; the scan (and the capture) add dt_bias, softplus, clamp.
    x, _, A, B, _, _ = _mamba_inputs(torch.float32, device, seed=6)
    gen = torch.Generator().manual_seed(7)
    raw_dt = (torch.randn(x.shape[0], x.shape[1], generator=gen) * 4).to(device)
    raw_dt[0, 0] = 30.0  # past softplus' linear threshold (20)
    dt_bias = torch.randn(x.shape[1], generator=gen).to(device)
    dt = torch.where(raw_dt + dt_bias <= 20.0, F.softplus(raw_dt + dt_bias), raw_dt + dt_bias).clamp(0.0, 5.0)
    cu = _cu_seqlens(MAMBA_LENS, device)
    chunk_states = _mamba_packed_chunk_states(x, dt, A, B, cu, None)
    seqs, positions = _queries(MAMBA_LENS, {1, 7, 16, 17})
    dst = torch.empty(len(seqs), *chunk_states.shape[1:], device=device)
    mamba2_capture_states(x, raw_dt, A, B, cu.tolist(), chunk_states, seqs, positions, dst, range(len(seqs)),
                          dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, 5.0), chunk_size=MAMBA_CHUNK)
    expected = mamba2_states_reference(
        x, dt, A, B, cu, None, torch.tensor(seqs, device=device), torch.tensor(positions, device=device)
    )
    assert _relative_error(dst, expected) <= FP32_PRODUCT_TOLERANCE

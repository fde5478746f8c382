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
    conv_state_at_positions,
    conv_state_at_positions_reference,
    copy_states,
    copy_states_reference,
    gdn_state_at_positions,
    gdn_state_at_positions_reference,
    mamba2_state_at_positions,
    mamba2_state_at_positions_reference,
)

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need a CUDA device", allow_module_level=True)


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


# ----------------------------------------------------------------------------- GDN

GDN_LENS = [1, 64, 130, 77, 128]  # ragged, incl. a one-token sequence and exact multiples of 64


def _gdn_queries(lens):
    """Position 0 and 1, chunk starts and ends, the last token and the end of each sequence."""
    seqs, positions = [], []
    for s, n in enumerate(lens):
        for p in sorted({0, 1, 2, 63, 64, 65, 127, 128, 129, n - 1, n}):
            if 0 <= p <= n:
                seqs.append(s)
                positions.append(p)
    return seqs, positions


def _gdn_chunk_states(k, v, g, beta, cu, initial, lens, chunk):
    """fla layout (sum_i ceil(len_i / chunk), H, V, K): each sequence's chunk-start states."""
    seqs = [s for s, n in enumerate(lens) for _ in range(0, n, chunk)]
    positions = [p for n in lens for p in range(0, n, chunk)]
    dev = k.device
    return gdn_state_at_positions_reference(
        k, v, g, beta, cu, initial, torch.tensor(seqs, device=dev), torch.tensor(positions, device=dev)
    )


def _gdn_inputs(lens, heads, k_heads, dk, dv, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    k = F.normalize(torch.randn(total, k_heads, dk, generator=gen), dim=-1)
    v = torch.randn(total, heads, dv, generator=gen)
    g = F.logsigmoid(torch.randn(total, heads, generator=gen) + 2.0)
    beta = torch.rand(total, heads, generator=gen)
    initial = torch.randn(len(lens), heads, dv, dk, generator=gen)
    k, v, g, beta = (t.to(dtype).to(device) for t in (k, v, g, beta))
    return k, v, g, beta, initial.to(device)


@pytest.mark.parametrize(
    "dtype,chunk_state_dtype,tolerance",
    [
        (torch.float32, torch.float32, 1e-5),
        # SGLang's case: bf16 activations and bf16 chunk states (fla's h).  The bf16
        # rounding of the chunk-start state (2^-9 relative) dominates the error.
        (torch.bfloat16, torch.bfloat16, 1e-2),
    ],
    ids=["fp32", "bf16"],
)
def test_gdn_state_at_positions_matches_sequential_recurrence(device, dtype, chunk_state_dtype, tolerance):
    heads, k_heads, dk, dv = 4, 2, 16, 12
    k, v, g, beta, initial = _gdn_inputs(GDN_LENS, heads, k_heads, dk, dv, dtype, device, seed=0)
    cu = _cu_seqlens(GDN_LENS, device)
    chunk_states = _gdn_chunk_states(k, v, g, beta, cu, initial, GDN_LENS, 64).to(chunk_state_dtype)
    seqs, positions = _gdn_queries(GDN_LENS)
    query_seq = torch.tensor(seqs, device=device)
    query_pos = torch.tensor(positions, dtype=torch.int32, device=device)

    num_slots = len(seqs) + 5
    dst = torch.full((num_slots, heads, dv, dk), float("nan"), device=device)
    dst_slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(1))[: len(seqs)].to(device)
    gdn_state_at_positions(
        k, v, g, beta, cu, chunk_states.unsqueeze(0), query_seq, query_pos, dst, dst_slots
    )

    expected = gdn_state_at_positions_reference(k, v, g, beta, cu, initial, query_seq, query_pos)
    got = dst[dst_slots.long()]
    assert _relative_error(got, expected) <= tolerance
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[dst_slots.long()] = False
    assert dst[untouched].isnan().all(), "only the destination slots may be written"


def test_gdn_state_at_positions_rejects_bad_queries(device):
    lens = [10, 70]
    k, v, g, beta, initial = _gdn_inputs(lens, 2, 2, 8, 8, torch.float32, device, seed=2)
    cu = _cu_seqlens(lens, device)
    chunk_states = _gdn_chunk_states(k, v, g, beta, cu, initial, lens, 64)
    dst = torch.zeros(4, 2, 8, 8, device=device)

    def call(seqs, positions, slots, states=chunk_states):
        gdn_state_at_positions(
            k, v, g, beta, cu, states,
            torch.tensor(seqs, device=device), torch.tensor(positions, device=device),
            dst, torch.tensor(slots, device=device),
        )

    with pytest.raises(IndexError, match="query_pos"):
        call([0], [11], [0])
    with pytest.raises(IndexError, match="query_seq"):
        call([2], [0], [0])
    with pytest.raises(IndexError, match="dst_slots"):
        call([0], [3], [4])
    with pytest.raises(ValueError, match="duplicates"):
        call([0, 1], [3, 4], [1, 1])
    with pytest.raises(ValueError, match="chunks"):
        call([0], [3], [0], states=chunk_states[:2])


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
    initial_rows = torch.randn(3, heads, head_dim, state_dim, generator=gen)
    # Sequence i enters with row initial_indices[i]; -1 starts from zeros.
    initial_indices = torch.tensor([2, -1, 0, 1, -1])
    x, B = (t.to(dtype).to(device) for t in (x, B))
    return x, dt.to(device), A.to(device), B, initial_rows.to(device), initial_indices.to(device)


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
    states = mamba2_state_at_positions_reference(
        x, dt, A, B, cu, initial_per_seq, torch.tensor(seqs, device=dev), torch.tensor(positions, device=dev)
    )
    return torch.cat([torch.full_like(states[:1], float("nan")), states])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mamba2_state_at_positions_matches_sequential_recurrence(device, dtype):
    # fp32 chunk states (SGLang passes state_dtype = the pool's fp32), so bf16 x / B only
    # change the inputs both sides read: the same 1e-5 bound holds.
    x, dt, A, B, initial_rows, initial_indices = _mamba_inputs(dtype, device, seed=3)
    cu = _cu_seqlens(MAMBA_LENS, device)
    initial_per_seq = torch.stack([
        initial_rows[i] if i >= 0 else torch.zeros_like(initial_rows[0]) for i in initial_indices.tolist()
    ])
    chunk_states = _mamba_packed_chunk_states(x, dt, A, B, cu, initial_per_seq)
    seqs, positions = [], []
    for s, n in enumerate(MAMBA_LENS):
        for p in sorted({0, 1, 2, 15, 16, 17, n - 1, n}):
            if 0 <= p <= n:
                seqs.append(s)
                positions.append(p)
    query_seq = torch.tensor(seqs, device=device)
    query_pos = torch.tensor(positions, device=device)

    dst = torch.full((len(seqs) + 2, *chunk_states.shape[1:]), float("nan"), device=device)
    dst_slots = torch.arange(len(seqs), device=device) + 2
    mamba2_state_at_positions(
        x.unsqueeze(0), dt.unsqueeze(0), A, B.unsqueeze(0), cu, chunk_states.unsqueeze(0),
        query_seq, query_pos, dst, dst_slots,
        initial_states=initial_rows, initial_state_indices=initial_indices, chunk_size=MAMBA_CHUNK,
    )

    expected = mamba2_state_at_positions_reference(x, dt, A, B, cu, initial_per_seq, query_seq, query_pos)
    assert _relative_error(dst[2:], expected) <= 1e-5
    assert dst[:2].isnan().all()


def test_mamba2_state_at_positions_without_initial_states(device):
    x, dt, A, B, _, _ = _mamba_inputs(torch.float32, device, seed=4)
    cu = _cu_seqlens(MAMBA_LENS, device)
    chunk_states = _mamba_packed_chunk_states(x, dt, A, B, cu, None)
    query_seq = torch.tensor([0, 1, 2, 4, 4], device=device)
    query_pos = torch.tensor([5, 20, 0, 1, 33], device=device)
    dst = torch.empty(5, *chunk_states.shape[1:], device=device)
    mamba2_state_at_positions(
        x, dt, A, B, cu, chunk_states, query_seq, query_pos, dst, torch.arange(5, device=device),
        chunk_size=MAMBA_CHUNK,
    )
    expected = mamba2_state_at_positions_reference(x, dt, A, B, cu, None, query_seq, query_pos)
    assert torch.equal(dst[2], torch.zeros_like(dst[2])), "an empty prefix without initial state is zero"
    assert _relative_error(dst, expected) <= 1e-5


# ----------------------------------------------------------------------------- conv

CONV_LENS = [1, 2, 9, 5]
CONV_DIM, CONV_WIDTH = 10, 3


@pytest.mark.parametrize("with_initial", [True, False], ids=["initial_state", "zeros"])
def test_conv_state_at_positions_bit_exact(device, with_initial):
    gen = torch.Generator().manual_seed(5)
    total = sum(CONV_LENS)
    # SGLang keeps the pre-conv activations as (dim, T); pass the transposed view.
    x_dim_major = _random_bits((CONV_DIM, total), torch.bfloat16, gen, device)
    x = x_dim_major.t()
    cu = _cu_seqlens(CONV_LENS, device)
    seqs, positions = [], []
    for s, n in enumerate(CONV_LENS):
        for p in sorted({0, 1, 2, 3, n - 1, n}):
            if 0 <= p <= n:
                seqs.append(s)
                positions.append(p)
    query_seq = torch.tensor(seqs, device=device)
    query_pos = torch.tensor(positions, device=device)

    kwargs, initial_per_seq = {}, None
    if with_initial:
        initial_rows = _random_bits((3, CONV_DIM, CONV_WIDTH), torch.bfloat16, gen, device)
        initial_indices = torch.tensor([1, -1, 0, 2], device=device)
        kwargs = dict(initial_states=initial_rows, initial_state_indices=initial_indices)
        initial_per_seq = torch.stack([
            initial_rows[i] if i >= 0 else torch.zeros_like(initial_rows[0]) for i in initial_indices.tolist()
        ])

    num_slots = len(seqs) + 3
    sentinel = _random_bits((num_slots, CONV_DIM, CONV_WIDTH), torch.bfloat16, gen, device)
    dst = sentinel.clone()
    dst_slots = torch.arange(len(seqs), device=device).flip(0) + 3
    conv_state_at_positions(x, cu, query_seq, query_pos, dst, dst_slots, **kwargs)

    expected = conv_state_at_positions_reference(x, cu, initial_per_seq, query_seq, query_pos, CONV_WIDTH)
    assert torch.equal(_bits(dst[dst_slots]), _bits(expected))
    assert torch.equal(_bits(dst[:3]), _bits(sentinel[:3]))

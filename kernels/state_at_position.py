"""Recurrent state at arbitrary token positions inside one extend (prefill) batch.

A chunked scan already materialises the state at every chunk start.  The state after
consuming tokens ``[0, pos)`` of a sequence is that chunk-start state advanced over the
at most one chunk of tokens between the chunk start and ``pos``.  These kernels do that
advance and write the result straight into checkpoint slot rows, so a checkpoint at any
anchor costs one short recurrence instead of a separate forward.

Positions are relative to the sequence's tokens in this batch: ``pos = 0`` is the state
the sequence entered the batch with, ``pos = len`` the state after its last token.

Layouts (packed varlen batches; a leading batch dimension of 1, as the fla / SSD kernels
use, is accepted and dropped):

* Gated DeltaNet (fla ``chunk_gated_delta_rule``): ``k (T, HK, K)`` already l2-normalised,
  ``v (T, H, V)``, ``g (T, H)`` log decay, ``beta (T, H)``; ``chunk_states (NT, H, V, K)``,
  one state per 64-token chunk of each sequence (fla numbers chunks per sequence, so
  sequence ``i`` owns rows ``[sum_{j<i} ceil(len_j / 64), ...)`` and its first row is its
  initial state).  States are ``[V, K]`` as in SGLang's pool (``temporal = (HV, V, K)``).
  Recurrence (transformers ``torch_recurrent_gated_delta_rule`` transposed to ``[V, K]``):
  ``S *= exp(g_t); S += beta_t * (v_t - S k_t) k_t^T``.  Value head ``h`` reads key head
  ``h // (H // HK)``.
* Mamba2 / SSD (SGLang ``mamba_chunk_scan_combined``): ``x (T, H, P)``, ``dt (T, H)``
  after bias, softplus and clamping, ``A (H,)``, ``B (T, G, N)``; ``chunk_states (NC, H, P, N)``
  are the states at the starts of the *physical* chunks of the packed token stream
  (``chunk_size`` 256 for NemotronH), a sequence's entering state comes from
  ``initial_states``.  Recurrence: ``h = exp(dt_t A) h + dt_t x_t B_t^T``.  Head ``h`` reads
  group ``h // (H // G)``.
* Conv: ``x (T, dim)`` the pre-conv inputs; the conv state at ``pos`` is the last
  ``W = kernel - 1`` inputs before ``pos`` in SGLang's ``(dim, W)`` layout (oldest first),
  taken from the sequence's initial conv state where ``pos < W``.

Initial states are given as a tensor of rows plus one row index per sequence; an index
of -1 means "starts from zeros" (SGLang's ``has_initial_state == False``).  Outputs are
written to ``dst[dst_slots[q]]``: pass one layer of a pool, e.g. ``pool.temporal[layer]``
``(num_slots, H, V, K)`` or ``pool.conv[0][layer]`` ``(num_slots, dim, W)``.  Arithmetic is
fp32 whatever the input dtypes.
"""

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, on_device

GDN_CHUNK_SIZE = 64
NEMOTRON_H_CHUNK_SIZE = 256

# Register tile of a GPU program: rows of the state times the padded state width.  The
# interpreter takes whole states per program instead (fewer, larger programs).
_GPU_TILE_ELEMENTS = 4096
_GPU_CONV_BLOCK_DIM = 256


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _gdn_advance_kernel(
    k, v, g, beta, chunk_states, dst,
    base_rows, tok_starts, tok_ends, dst_slots,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_g_t, stride_g_h,
    stride_beta_t, stride_beta_h,
    stride_cs_r, stride_cs_h, stride_cs_v, stride_cs_k,
    stride_dst_s, stride_dst_h, stride_dst_v, stride_dst_k,
    V: tl.constexpr,
    K: tl.constexpr,
    HEADS_PER_K_HEAD: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
):
    # Rows of a delta-rule state evolve independently (S k_t and the rank-1 update act
    # row by row), so each program owns a block of V rows of one head of one query.
    query = tl.program_id(0)
    head = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_v = offs_v < V
    mask_k = offs_k < K
    mask = mask_v[:, None] & mask_k[None, :]

    row = tl.load(base_rows + query).to(tl.int64)
    state = tl.load(
        chunk_states + row * stride_cs_r + head * stride_cs_h
        + offs_v[:, None] * stride_cs_v + offs_k[None, :] * stride_cs_k,
        mask=mask, other=0.0,
    ).to(tl.float32)

    k_head = head // HEADS_PER_K_HEAD
    t_start = tl.load(tok_starts + query).to(tl.int64)
    t_end = tl.load(tok_ends + query).to(tl.int64)
    for t in range(t_start, t_end):
        k_t = tl.load(k + t * stride_k_t + k_head * stride_k_h + offs_k * stride_k_d,
                      mask=mask_k, other=0.0).to(tl.float32)
        v_t = tl.load(v + t * stride_v_t + head * stride_v_h + offs_v * stride_v_d,
                      mask=mask_v, other=0.0).to(tl.float32)
        g_t = tl.load(g + t * stride_g_t + head * stride_g_h).to(tl.float32)
        beta_t = tl.load(beta + t * stride_beta_t + head * stride_beta_h).to(tl.float32)
        state = state * tl.exp(g_t)
        predicted = tl.sum(state * k_t[None, :], axis=1)
        delta = (v_t - predicted) * beta_t
        state = state + delta[:, None] * k_t[None, :]

    slot = tl.load(dst_slots + query).to(tl.int64)
    tl.store(
        dst + slot * stride_dst_s + head * stride_dst_h
        + offs_v[:, None] * stride_dst_v + offs_k[None, :] * stride_dst_k,
        state.to(dst.dtype.element_ty), mask=mask,
    )


@triton.jit
def _mamba2_advance_kernel(
    x, dt, A, B, chunk_states, initial_states, dst,
    base_rows, initial_rows, tok_starts, tok_ends, dst_slots,
    stride_x_t, stride_x_h, stride_x_p,
    stride_dt_t, stride_dt_h,
    stride_b_t, stride_b_g, stride_b_n,
    stride_cs_r, stride_cs_h, stride_cs_p, stride_cs_n,
    stride_init_r, stride_init_h, stride_init_p, stride_init_n,
    stride_dst_s, stride_dst_h, stride_dst_p, stride_dst_n,
    P: tl.constexpr,
    N: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    # SSM rows (head_dim index p) are independent: one program per block of P rows.
    query = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask = mask_p[:, None] & mask_n[None, :]

    # base row >= 0: a chunk-start state; -1: the sequence's initial state (or zeros).
    row = tl.load(base_rows + query).to(tl.int64)
    from_chunk = row >= 0
    state = tl.load(
        chunk_states + tl.maximum(row, 0) * stride_cs_r + head * stride_cs_h
        + offs_p[:, None] * stride_cs_p + offs_n[None, :] * stride_cs_n,
        mask=mask & from_chunk, other=0.0,
    ).to(tl.float32)
    if HAS_INITIAL:
        init_row = tl.load(initial_rows + query).to(tl.int64)
        initial = tl.load(
            initial_states + tl.maximum(init_row, 0) * stride_init_r + head * stride_init_h
            + offs_p[:, None] * stride_init_p + offs_n[None, :] * stride_init_n,
            mask=mask & (row < 0) & (init_row >= 0), other=0.0,
        ).to(tl.float32)
        state = tl.where(from_chunk, state, initial)

    group = head // HEADS_PER_GROUP
    a = tl.load(A + head).to(tl.float32)
    t_start = tl.load(tok_starts + query).to(tl.int64)
    t_end = tl.load(tok_ends + query).to(tl.int64)
    for t in range(t_start, t_end):
        x_t = tl.load(x + t * stride_x_t + head * stride_x_h + offs_p * stride_x_p,
                      mask=mask_p, other=0.0).to(tl.float32)
        b_t = tl.load(B + t * stride_b_t + group * stride_b_g + offs_n * stride_b_n,
                      mask=mask_n, other=0.0).to(tl.float32)
        dt_t = tl.load(dt + t * stride_dt_t + head * stride_dt_h).to(tl.float32)
        state = state * tl.exp(dt_t * a) + (dt_t * x_t)[:, None] * b_t[None, :]

    slot = tl.load(dst_slots + query).to(tl.int64)
    tl.store(
        dst + slot * stride_dst_s + head * stride_dst_h
        + offs_p[:, None] * stride_dst_p + offs_n[None, :] * stride_dst_n,
        state.to(dst.dtype.element_ty), mask=mask,
    )


@triton.jit
def _conv_state_kernel(
    x, initial_states, dst,
    seq_starts, positions, initial_rows, dst_slots,
    stride_x_t, stride_x_d,
    stride_init_r, stride_init_d, stride_init_w,
    stride_dst_s, stride_dst_d, stride_dst_w,
    DIM: tl.constexpr,
    W: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
):
    query = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    offs_w = tl.arange(0, BW)
    mask = (offs_d < DIM)[:, None] & (offs_w < W)[None, :]

    seq_start = tl.load(seq_starts + query).to(tl.int64)
    pos = tl.load(positions + query).to(tl.int64)
    # Column w holds the input at position pos - W + w (oldest first).
    rel = pos - W + offs_w
    in_batch = (rel >= 0)[None, :]
    window = tl.load(
        x + (seq_start + tl.maximum(rel, 0))[None, :] * stride_x_t + offs_d[:, None] * stride_x_d,
        mask=mask & in_batch, other=0.0,
    ).to(dst.dtype.element_ty)
    if HAS_INITIAL:
        # Before the batch: column W + rel of the state the sequence entered with.
        init_row = tl.load(initial_rows + query).to(tl.int64)
        before = tl.load(
            initial_states + tl.maximum(init_row, 0) * stride_init_r
            + offs_d[:, None] * stride_init_d + tl.maximum(W + rel, 0)[None, :] * stride_init_w,
            mask=mask & (rel < 0)[None, :] & (init_row >= 0), other=0.0,
        ).to(dst.dtype.element_ty)
        # where, not +: a sum would turn a copied -0.0 into +0.0.
        window = tl.where(in_batch, window, before)

    slot = tl.load(dst_slots + query).to(tl.int64)
    tl.store(
        dst + slot * stride_dst_s + offs_d[:, None] * stride_dst_d + offs_w[None, :] * stride_dst_w,
        window, mask=mask,
    )


# --------------------------------------------------------------------------------------
# Input handling shared by the wrappers
# --------------------------------------------------------------------------------------


def _drop_unit_batch(t: torch.Tensor, dims: int, name: str) -> torch.Tensor:
    """Accept ``(1, *shape)`` (the fla / SSD calling convention) as well as ``shape``."""
    if t.dim() == dims + 1 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions (or a leading 1), got {tuple(t.shape)}")
    return t


def _check_index(name: str, t: torch.Tensor, length: int | None, device: torch.device) -> None:
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected a 1-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name}: expected {length} entries, got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name}: expected on {device}, got {t.device}")


def _check_queries(
    cu_seqlens: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    dst_slots: torch.Tensor,
    num_dst_slots: int,
    initial_rows: torch.Tensor | None,
    num_initial_rows: int,
    chunk_size: int,
) -> tuple[int, int]:
    """Range checks that need the index values (one device->host transfer).

    Returns (total tokens, total per-sequence chunks of ``chunk_size``) for the callers'
    row-count checks.
    """
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    seq = query_seq.long().clamp(0, lens.numel() - 1)
    q_lens = lens[seq]
    init_rows = initial_rows.long() if initial_rows is not None else lens.new_zeros(1)
    stats = torch.stack([
        query_seq.long().min(), query_seq.long().max(),
        (query_pos.long() < 0).sum(), (query_pos.long() > q_lens).sum(), (q_lens <= 0).sum(),
        dst_slots.long().min(), dst_slots.long().max(),
        torch.unique(dst_slots).numel() * torch.ones_like(lens[0]),
        (lens < 0).sum(), cu[0], cu[-1],
        init_rows.min(), init_rows.max(),
        ((lens + chunk_size - 1) // chunk_size).sum(),
    ]).tolist()
    (seq_min, seq_max, neg_pos, past_end, empty, slot_min, slot_max, distinct, neg_len,
     first, total, init_min, init_max, num_chunks) = stats
    num_seqs = lens.numel()
    if first != 0 or neg_len:
        raise ValueError("cu_seqlens must start at 0 and be non-decreasing")
    if seq_min < 0 or seq_max >= num_seqs:
        raise IndexError(f"query_seq must lie in [0, {num_seqs}), got range [{seq_min}, {seq_max}]")
    if neg_pos or past_end:
        raise IndexError(f"query_pos must lie in [0, len of its sequence]: {neg_pos + past_end} do not")
    if empty:
        raise ValueError(f"{empty} queries name a sequence with no tokens in this batch")
    if slot_min < 0 or slot_max >= num_dst_slots:
        raise IndexError(f"dst_slots must lie in [0, {num_dst_slots}), got range [{slot_min}, {slot_max}]")
    if distinct != dst_slots.numel():
        raise ValueError("dst_slots contains duplicates: two queries would write the same slot")
    if initial_rows is not None and (init_min < -1 or init_max >= num_initial_rows):
        raise IndexError(
            f"initial state indices must lie in [-1, {num_initial_rows}), got range [{init_min}, {init_max}]"
        )
    return total, num_chunks


def _check_common(cu_seqlens, query_seq, query_pos, dst_slots, device):
    _check_index("cu_seqlens", cu_seqlens, None, device)
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens needs at least one sequence (2 entries)")
    num_queries = query_seq.numel()
    _check_index("query_seq", query_seq, None, device)
    _check_index("query_pos", query_pos, num_queries, device)
    _check_index("dst_slots", dst_slots, num_queries, device)
    return num_queries


def _state_tile(rows: int, width: int) -> tuple[int, int]:
    """(row block, padded width) of one program's register tile."""
    padded_width = triton.next_power_of_2(width)
    if INTERPRET:
        return triton.next_power_of_2(rows), padded_width
    row_block = max(1, min(triton.next_power_of_2(rows), _GPU_TILE_ELEMENTS // padded_width))
    return row_block, padded_width


# --------------------------------------------------------------------------------------
# Gated DeltaNet
# --------------------------------------------------------------------------------------


def gdn_state_at_positions(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_states: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    chunk_size: int = GDN_CHUNK_SIZE,
    validate: bool = True,
) -> None:
    """Write the GDN state after tokens ``[0, query_pos[q])`` of sequence ``query_seq[q]``
    into ``dst[dst_slots[q]]`` (``dst``: ``(num_slots, H, V, K)``, e.g. ``pool.temporal[layer]``).

    ``chunk_states`` is the ``h`` returned by fla's ``chunk_gated_delta_rule``
    (``(1, NT, H, V, K)`` or ``(NT, H, V, K)``).  ``validate`` range-checks the index
    tensors, which reads them back to the host (a device sync).
    """
    k = _drop_unit_batch(k, 3, "k")
    v = _drop_unit_batch(v, 3, "v")
    g = _drop_unit_batch(g, 2, "g")
    beta = _drop_unit_batch(beta, 2, "beta")
    chunk_states = _drop_unit_batch(chunk_states, 4, "chunk_states")
    num_tokens, num_k_heads, head_k = k.shape
    _, num_heads, head_v = v.shape
    device = k.device
    if v.shape[0] != num_tokens or g.shape != (num_tokens, num_heads) or beta.shape != (num_tokens, num_heads):
        raise ValueError(
            f"token shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}"
        )
    if num_heads % num_k_heads:
        raise ValueError(f"{num_heads} value heads are not a multiple of {num_k_heads} key heads")
    if chunk_states.shape[1:] != (num_heads, head_v, head_k):
        raise ValueError(f"chunk_states: expected (NT, {num_heads}, {head_v}, {head_k}), got {tuple(chunk_states.shape)}")
    if dst.dim() != 4 or dst.shape[1:] != (num_heads, head_v, head_k):
        raise ValueError(f"dst: expected (num_slots, {num_heads}, {head_v}, {head_k}), got {tuple(dst.shape)}")
    num_queries = _check_common(cu_seqlens, query_seq, query_pos, dst_slots, device)
    if num_queries == 0:
        return
    if validate:
        total, num_chunks = _check_queries(
            cu_seqlens, query_seq, query_pos, dst_slots, dst.shape[0], None, 0, chunk_size
        )
        if total != num_tokens:
            raise ValueError(f"cu_seqlens covers {total} tokens but k has {num_tokens}")
        if num_chunks != chunk_states.shape[0]:
            raise ValueError(f"chunk_states has {chunk_states.shape[0]} rows, the batch has {num_chunks} chunks")

    # fla numbers chunks per sequence; a position on the last chunk's end (pos == len, len
    # a multiple of the chunk size) has no chunk-start row of its own, so it advances a
    # whole chunk from the last row.
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    num_chunks = (lens + chunk_size - 1) // chunk_size
    first_row = torch.cumsum(num_chunks, 0) - num_chunks
    seq = query_seq.long()
    pos = query_pos.long()
    chunk = torch.minimum(pos // chunk_size, num_chunks[seq] - 1)
    base_rows = first_row[seq] + chunk
    tok_starts = cu[seq] + chunk * chunk_size
    tok_ends = cu[seq] + pos

    block_v, block_k = _state_tile(head_v, head_k)
    grid = (num_queries, num_heads, triton.cdiv(head_v, block_v))
    with on_device(device):
        _gdn_advance_kernel[grid](
            k, v, g, beta, chunk_states, dst,
            base_rows, tok_starts, tok_ends, dst_slots,
            *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
            *chunk_states.stride(), *dst.stride(),
            V=head_v, K=head_k, HEADS_PER_K_HEAD=num_heads // num_k_heads,
            BV=block_v, BK=block_k, num_warps=4,
        )


def gdn_state_at_positions_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
) -> torch.Tensor:
    """Sequential fp32 recurrence from each sequence start; returns ``(Q, H, V, K)``.

    ``initial_states``: ``(num_seqs, H, V, K)`` or None for zeros.  Independent of any
    chunking: the token-by-token form of transformers' ``torch_recurrent_gated_delta_rule``.
    """
    k, v, g, beta = (_drop_unit_batch(t, d, n).float() for t, d, n in
                     ((k, 3, "k"), (v, 3, "v"), (g, 2, "g"), (beta, 2, "beta")))
    num_heads, head_v, head_k = v.shape[1], v.shape[2], k.shape[2]
    k = k.repeat_interleave(num_heads // k.shape[1], dim=1)

    def step(state, t):
        state = state * g[t].exp()[:, None, None]
        predicted = (state * k[t][:, None, :]).sum(-1)
        delta = (v[t] - predicted) * beta[t][:, None]
        return state + delta[:, :, None] * k[t][:, None, :]

    def zeros():
        return torch.zeros(num_heads, head_v, head_k, device=v.device)

    return _sequential_states(cu_seqlens, initial_states, query_seq, query_pos, step, zeros)


def _sequential_states(cu_seqlens, initial_states, query_seq, query_pos, step, zeros):
    """Run ``step`` token by token through every queried sequence, keeping queried states."""
    cu = cu_seqlens.tolist()
    seqs, positions = query_seq.tolist(), query_pos.tolist()
    out = [None] * len(seqs)
    for s in sorted(set(seqs)):
        wanted = {}
        for q, (qs, qp) in enumerate(zip(seqs, positions)):
            if qs == s:
                wanted.setdefault(qp, []).append(q)
        state = initial_states[s].float().clone() if initial_states is not None else zeros()
        for p in range(max(wanted) + 1):
            for q in wanted.get(p, ()):
                out[q] = state.clone()
            if p < max(wanted):
                state = step(state, cu[s] + p)
    return torch.stack(out)


# --------------------------------------------------------------------------------------
# Mamba2 (SSD)
# --------------------------------------------------------------------------------------


def mamba2_state_at_positions(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_states: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    initial_states: torch.Tensor | None = None,
    initial_state_indices: torch.Tensor | None = None,
    chunk_size: int = NEMOTRON_H_CHUNK_SIZE,
    validate: bool = True,
) -> None:
    """Write the SSM state after tokens ``[0, query_pos[q])`` of sequence ``query_seq[q]``
    into ``dst[dst_slots[q]]`` (``dst``: ``(num_slots, H, P, N)``, e.g. ``pool.temporal[layer]``).

    ``chunk_states``: the intermediate states of ``mamba_chunk_scan_combined``
    (``(1, NC, H, P, N)`` or ``(NC, H, P, N)``, ``NC = ceil(T / chunk_size)``), row ``c``
    being the state at packed token ``c * chunk_size`` of the sequence containing token
    ``c * chunk_size - 1``.  ``initial_states (R, H, P, N)`` with ``initial_state_indices
    (num_seqs,)`` (-1: zeros) give each sequence's entering state; omitted, all start from
    zeros.  ``dt`` must already carry bias, softplus and clamping.
    """
    x = _drop_unit_batch(x, 3, "x")
    dt = _drop_unit_batch(dt, 2, "dt")
    B = _drop_unit_batch(B, 3, "B")
    chunk_states = _drop_unit_batch(chunk_states, 4, "chunk_states")
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1], B.shape[2]
    device = x.device
    if dt.shape != (num_tokens, num_heads) or B.shape[0] != num_tokens or A.shape != (num_heads,):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}"
        )
    if num_heads % num_groups:
        raise ValueError(f"{num_heads} heads are not a multiple of {num_groups} groups")
    state_shape = (num_heads, head_dim, state_dim)
    if chunk_states.shape[1:] != state_shape or chunk_states.shape[0] != triton.cdiv(num_tokens, chunk_size):
        raise ValueError(
            f"chunk_states: expected ({triton.cdiv(num_tokens, chunk_size)}, {num_heads}, {head_dim}, "
            f"{state_dim}), got {tuple(chunk_states.shape)}"
        )
    if dst.dim() != 4 or dst.shape[1:] != state_shape:
        raise ValueError(f"dst: expected (num_slots, {num_heads}, {head_dim}, {state_dim}), got {tuple(dst.shape)}")
    num_queries = _check_common(cu_seqlens, query_seq, query_pos, dst_slots, device)
    has_initial = _check_initial(initial_states, initial_state_indices, state_shape, cu_seqlens, device)
    if num_queries == 0:
        return
    if validate:
        total, _ = _check_queries(
            cu_seqlens, query_seq, query_pos, dst_slots, dst.shape[0],
            initial_state_indices, initial_states.shape[0] if has_initial else 0, chunk_size,
        )
        if total != num_tokens:
            raise ValueError(f"cu_seqlens covers {total} tokens but x has {num_tokens}")

    # Physical chunks tile the packed stream; the chunk-start row at packed boundary b
    # belongs to this sequence only if the sequence started before b.  Otherwise the
    # advance starts from the sequence's entering state (at most chunk_size tokens either
    # way).  The boundary at the very end of the batch has no row: use the previous one.
    cu = cu_seqlens.long()
    seq = query_seq.long()
    seq_start = cu[seq]
    token = seq_start + query_pos.long()
    chunk = torch.clamp(token // chunk_size, max=chunk_states.shape[0] - 1)
    boundary = chunk * chunk_size
    from_chunk = boundary > seq_start
    base_rows = torch.where(from_chunk, chunk, -1)
    tok_starts = torch.where(from_chunk, boundary, seq_start)
    initial_rows = initial_state_indices[seq] if has_initial else base_rows
    init = initial_states if has_initial else chunk_states

    block_p, block_n = _state_tile(head_dim, state_dim)
    grid = (num_queries, num_heads, triton.cdiv(head_dim, block_p))
    with on_device(device):
        _mamba2_advance_kernel[grid](
            x, dt, A, B, chunk_states, init, dst,
            base_rows, initial_rows, tok_starts, token, dst_slots,
            *x.stride(), *dt.stride(), *B.stride(),
            *chunk_states.stride(), *init.stride(), *dst.stride(),
            P=head_dim, N=state_dim, HEADS_PER_GROUP=num_heads // num_groups,
            HAS_INITIAL=has_initial, BP=block_p, BN=block_n, num_warps=4,
        )


def _check_initial(initial_states, initial_state_indices, state_shape, cu_seqlens, device) -> bool:
    if (initial_states is None) != (initial_state_indices is None):
        raise ValueError("initial states and their indices must be given together")
    if initial_states is None:
        return False
    if initial_states.dim() != len(state_shape) + 1 or tuple(initial_states.shape[1:]) != tuple(state_shape):
        raise ValueError(f"initial states: expected (rows, {', '.join(map(str, state_shape))}), "
                         f"got {tuple(initial_states.shape)}")
    if initial_states.device != device:
        raise ValueError(f"initial states: expected on {device}, got {initial_states.device}")
    _check_index("initial_state_indices", initial_state_indices, cu_seqlens.numel() - 1, device)
    return True


def mamba2_state_at_positions_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
) -> torch.Tensor:
    """Sequential fp32 SSM recurrence from each sequence start; returns ``(Q, H, P, N)``.

    ``initial_states``: ``(num_seqs, H, P, N)`` or None for zeros.  The token-by-token
    form of transformers' NemotronH ``torch_forward`` cache update.
    """
    x, dt, B = (_drop_unit_batch(t, d, n).float() for t, d, n in ((x, 3, "x"), (dt, 2, "dt"), (B, 3, "B")))
    num_heads, head_dim, state_dim = x.shape[1], x.shape[2], B.shape[2]
    B = B.repeat_interleave(num_heads // B.shape[1], dim=1)
    A = A.float()

    def step(state, t):
        decay = torch.exp(dt[t] * A)[:, None, None]
        return state * decay + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]

    def zeros():
        return torch.zeros(num_heads, head_dim, state_dim, device=x.device)

    return _sequential_states(cu_seqlens, initial_states, query_seq, query_pos, step, zeros)


# --------------------------------------------------------------------------------------
# Conv state
# --------------------------------------------------------------------------------------


def conv_state_at_positions(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    initial_states: torch.Tensor | None = None,
    initial_state_indices: torch.Tensor | None = None,
    validate: bool = True,
) -> None:
    """Write the conv state at ``query_pos[q]`` of sequence ``query_seq[q]`` into ``dst[dst_slots[q]]``.

    ``x``: pre-conv inputs ``(T, dim)`` (any strides; SGLang's transposed ``(dim, T)``
    buffer can be passed as ``buf.t()``).  ``dst``: ``(num_slots, dim, W)``, e.g.
    ``pool.conv[0][layer]``.  ``initial_states (R, dim, W)`` with ``initial_state_indices
    (num_seqs,)`` (-1: zeros) supply the inputs before the batch; omitted, they are zeros.
    Values are copied, converted only if ``x`` and ``dst`` dtypes differ.
    """
    x = _drop_unit_batch(x, 2, "x")
    num_tokens, dim = x.shape
    if dst.dim() != 3 or dst.shape[1] != dim:
        raise ValueError(f"dst: expected (num_slots, {dim}, kernel - 1), got {tuple(dst.shape)}")
    width = dst.shape[2]
    device = x.device
    num_queries = _check_common(cu_seqlens, query_seq, query_pos, dst_slots, device)
    has_initial = _check_initial(initial_states, initial_state_indices, (dim, width), cu_seqlens, device)
    if num_queries == 0:
        return
    if validate:
        total, _ = _check_queries(
            cu_seqlens, query_seq, query_pos, dst_slots, dst.shape[0],
            initial_state_indices, initial_states.shape[0] if has_initial else 0, 1,
        )
        if total != num_tokens:
            raise ValueError(f"cu_seqlens covers {total} tokens but x has {num_tokens}")

    seq = query_seq.long()
    seq_starts = cu_seqlens.long()[seq]
    initial_rows = initial_state_indices[seq] if has_initial else seq_starts
    init = initial_states if has_initial else dst

    block_w = triton.next_power_of_2(width)
    block_d = triton.next_power_of_2(dim) if INTERPRET else min(_GPU_CONV_BLOCK_DIM, triton.next_power_of_2(dim))
    grid = (num_queries, triton.cdiv(dim, block_d))
    with on_device(device):
        _conv_state_kernel[grid](
            x, init, dst,
            seq_starts, query_pos, initial_rows, dst_slots,
            *x.stride(), *init.stride(), *dst.stride(),
            DIM=dim, W=width, HAS_INITIAL=has_initial, BD=block_d, BW=block_w, num_warps=4,
        )


def conv_state_at_positions_reference(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Window of the ``width`` inputs before each position; returns ``(Q, dim, width)``.

    ``initial_states``: ``(num_seqs, dim, width)`` or None for zeros.
    """
    x = _drop_unit_batch(x, 2, "x")
    cu = cu_seqlens.tolist()
    out = []
    for s, p in zip(query_seq.tolist(), query_pos.tolist()):
        before = (initial_states[s] if initial_states is not None
                  else x.new_zeros(x.shape[1], width))
        history = torch.cat([before.to(x.dtype), x[cu[s]:cu[s + 1]].t()], dim=1)
        out.append(history[:, p:p + width])
    return torch.stack(out)

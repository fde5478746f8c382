"""Torch-native Mamba2 (SSD) kernels for SGLang's ``MambaMixer2`` on a host without CUDA.

SGLang 0.5.23's ``layers/attention/mamba/mamba.py`` binds its causal conv1d only on CUDA, NPU
or XPU (elsewhere the mixer's prefill fails with a NameError), and its SSD prefill scan
(``mamba_chunk_scan_combined``) and decode step (``selective_state_update``) are Triton.
``cpu_fallbacks.install_cpu_fallbacks`` puts the plain-torch drop-ins below, and the conv1d
of ``cpu_fallbacks``, into that module on a host without CUDA only. They compute the SSD
recurrence token by token in fp32 (exact, and slow: for the tiny models a CPU test serves)

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t

with ``dt_t = softplus(dt_t + dt_bias)`` clamped to ``dt_limit``, states ``(H, P, N)`` as in
SGLang's pool, head ``h`` reading group ``h // (H / G)`` of B and C.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _step_sizes(dt, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    """The scan's dt: bias added, softplus, clamped to ``dt_limit`` (fp32)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt, beta=1.0, threshold=20.0)
    low, high = dt_limit
    if (low, high) != (0.0, float("inf")):
        dt = dt.clamp(min=low, max=high)
    return dt


def ssd_scan(x, dt, A, B, C, D, state, states_after=()) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The SSD recurrence over one sequence from ``state``, in fp32.

    x: [L, H, P]; dt: [L, H] (final step sizes); A: [H]; B, C: [L, G, N]; D: None, [H] or
    [H, P]; state: [H, P, N]. Returns the output [L, H, P], the final state, and the state
    after ``k`` tokens for each ``k`` in ``states_after`` (0 <= k <= L).
    """
    heads_per_group = x.shape[1] // B.shape[1]
    x, A = x.float(), A.float()
    B = B.float().repeat_interleave(heads_per_group, dim=1)
    C = C.float().repeat_interleave(heads_per_group, dim=1)
    decay = torch.exp(dt * A)
    inputs = dt[..., None] * x
    state = state.float().clone()
    wanted = set(states_after)
    kept = {0: state.clone()} if 0 in wanted else {}
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        state = state * decay[t, :, None, None] + inputs[t, :, :, None] * B[t, :, None, :]
        out[t] = (state * C[t, :, None, :]).sum(-1)
        if t + 1 in wanted:
            kept[t + 1] = state.clone()
    if D is not None:
        out = out + x * (D.float()[:, None] if D.dim() == 1 else D.float())
    return out, state, kept


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit=(0.0, float("inf")),
    out: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    return_intermediate_states: bool = False,
    state_dtype: Optional[torch.dtype] = None,
    return_track_states: bool = False,
    track_seq_idx: Optional[torch.Tensor] = None,
    track_end_locs: Optional[torch.Tensor] = None,
    **unused_kernel_options,  # seq_idx, chunk_indices, chunk_offsets: the Triton scan's
) -> tuple:
    """Drop-in for SGLang's ``mamba_chunk_scan_combined`` in the varlen form ``MambaMixer2``
    calls it: x [1, T, H, P], dt [1, T, H], B, C [1, T, G, N], sequences packed by
    ``cu_seqlens``, each from ``initial_states[i]`` (or zeros). The output goes into ``out``
    [1, T, H, P]. Returns, as the Triton scan does with ``return_track_states``, the state at
    the start of every ``chunk_size`` chunk of the packed stream (that of the sequence the
    chunk's first token belongs to) [1, NC, H, P, N], each sequence's final state
    [num_seqs, H, P, N], and the state after packed tokens [cu_seqlens[track_seq_idx[q]],
    track_end_locs[q]) for each q [1, Q, H, P, N] (None without queries)."""
    if not return_varlen_states or cu_seqlens is None or x.shape[0] != 1:
        raise NotImplementedError("the CPU SSD fallback runs the varlen (cu_seqlens) form only")
    if return_final_states or (return_intermediate_states and not return_track_states):
        raise NotImplementedError("the CPU SSD fallback returns chunk, varlen and track states only")
    if z is not None:
        raise NotImplementedError("the CPU SSD fallback does not gate its output (z)")
    num_tokens, num_heads, head_dim = x.shape[1:]
    state_dim = B.shape[-1]
    state_dtype = state_dtype or C.dtype
    steps = _step_sizes(dt[0], dt_bias, dt_softplus, dt_limit)
    starts = cu_seqlens.tolist()
    tracked: dict[int, list[tuple[int, int]]] = {}  # seq -> [(tokens into it, query)]
    if track_seq_idx is not None and track_end_locs is not None:
        for query, (seq, end) in enumerate(zip(track_seq_idx.tolist(), track_end_locs.tolist())):
            tracked.setdefault(seq, []).append((end - starts[seq], query))
    num_queries = 0 if track_end_locs is None else track_end_locs.numel()
    shape = (num_heads, head_dim, state_dim)
    chunk_states = x.new_zeros((-(-num_tokens // chunk_size), *shape), dtype=state_dtype)
    final_states = x.new_zeros((len(starts) - 1, *shape), dtype=state_dtype)
    track_states = x.new_zeros((num_queries, *shape), dtype=state_dtype)
    result = torch.zeros(x.shape[1:], dtype=torch.float32)
    for seq, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        entering = initial_states[seq] if initial_states is not None else x.new_zeros(shape)
        chunk_offsets = range(-start % chunk_size, end - start, chunk_size)
        wanted = {*(k for k, _ in tracked.get(seq, ())), *chunk_offsets}
        seq_out, final, kept = ssd_scan(
            x[0, start:end], steps[start:end], A, B[0, start:end], C[0, start:end], D, entering,
            wanted,
        )  # fmt: skip
        result[start:end] = seq_out
        final_states[seq] = final.to(state_dtype)
        for offset in chunk_offsets:
            chunk_states[(start + offset) // chunk_size] = kept[offset].to(state_dtype)
        for tokens, query in tracked.get(seq, ()):
            track_states[query] = kept[tokens].to(state_dtype)
    if out is not None:
        out.copy_(result.view(out.shape).to(out.dtype))
    return chunk_states.unsqueeze(0), final_states, (track_states.unsqueeze(0) if num_queries else None)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    state_batch_indices: Optional[torch.Tensor] = None,
    pad_slot_id: int = -1,
    out: Optional[torch.Tensor] = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: Optional[torch.Tensor] = None,
    **unused_kernel_options,
) -> None:
    """Drop-in for SGLang's decode ``selective_state_update``: one SSD step per row.

    x, dt: [B, H, P] (dt and dt_bias broadcast over P, as the mixer expands them); A: [H, P,
    N]; B, C: [B, G, N]; D: [H, P]. Row i steps ``state[state_batch_indices[i]]`` in place
    (rows at ``pad_slot_id`` are padding) and writes its output to ``out[i]``.
    """
    if disable_state_update or intermediate_states_buffer is not None or z is not None:
        raise NotImplementedError("the CPU SSD fallback does not support speculative decoding or z")
    slots = (
        torch.arange(x.shape[0]) if state_batch_indices is None else state_batch_indices.long()
    )
    rows = (slots != pad_slot_id).nonzero().flatten()
    steps = _step_sizes(dt[rows, :, 0], None if dt_bias is None else dt_bias[:, 0], dt_softplus,
                        (0.0, float("inf")))  # fmt: skip
    for row, step in zip(rows.tolist(), steps):
        slot = int(slots[row])
        seq_out, final, _ = ssd_scan(
            x[row][None], step[None], A[:, 0, 0], B[row][None], C[row][None],
            None if D is None else D, state[slot],
        )  # fmt: skip
        state[slot] = final.to(state.dtype)
        out[row] = seq_out[0].to(out.dtype)

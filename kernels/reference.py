"""Plain-torch references of the kernels: the definitions the kernels are tested against.

Each is the simplest correct form (sequential recurrences in fp32, gathers), independent of
the chunking and tiling the kernels use. ``copy_states_reference`` also serves as the copy
on a CPU process whose kernels were not decorated under the interpreter.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._launch import drop_unit_batch

# fla's key normalisation epsilon (``l2norm_fwd``).
L2NORM_EPS = 1e-6


def copy_states_reference(
    src_conv: list[torch.Tensor],
    src_temporal: torch.Tensor,
    dst_conv: list[torch.Tensor],
    dst_temporal: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """``copy_states``: for every layer, slot ``src_slots[i]`` into ``dst_slots[i]``."""
    for src, dst in zip([*src_conv, src_temporal], [*dst_conv, dst_temporal]):
        dst.index_copy_(1, dst_slots.long(), src.index_select(1, src_slots.long()))


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """fla's key normalisation (``use_qk_l2norm_in_kernel``), in fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_states_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: Optional[torch.Tensor],
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule token by token in fp32 from each sequence's start; returns the
    state after ``query_pos[q]`` tokens of sequence ``query_seq[q]``, ``(Q, H, V, K)``.

    ``k`` raw keys (normalised here, as the scan does); ``initial_states (num_seqs, H, V, K)``
    or None for zeros.
    """
    k = l2_normalize(drop_unit_batch(k, 3, "k"))
    v, g, beta = (drop_unit_batch(t, d, n).float() for t, d, n in ((v, 3, "v"), (g, 2, "g"), (beta, 2, "beta")))
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


def mamba2_states_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: Optional[torch.Tensor],
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
) -> torch.Tensor:
    """The SSM recurrence token by token in fp32 from each sequence's start, ``(Q, H, P, N)``.

    ``initial_states (num_seqs, H, P, N)`` or None for zeros. The token-by-token form of
    transformers' NemotronH ``torch_forward`` cache update.
    """
    x, dt, B = (drop_unit_batch(t, d, n).float() for t, d, n in ((x, 3, "x"), (dt, 2, "dt"), (B, 3, "B")))
    num_heads, head_dim, state_dim = x.shape[1], x.shape[2], B.shape[2]
    B = B.repeat_interleave(num_heads // B.shape[1], dim=1)
    A = A.float()

    def step(state, t):
        decay = torch.exp(dt[t] * A)[:, None, None]
        return state * decay + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]

    def zeros():
        return torch.zeros(num_heads, head_dim, state_dim, device=x.device)

    return _sequential_states(cu_seqlens, initial_states, query_seq, query_pos, step, zeros)


def conv_states_reference(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: Optional[torch.Tensor],
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """The ``width`` pre-conv inputs before each position, ``(Q, dim, width)``, oldest first.

    ``initial_states (num_seqs, dim, width)`` or None for zeros.
    """
    x = drop_unit_batch(x, 2, "x")
    cu = cu_seqlens.tolist()
    out = []
    for s, p in zip(query_seq.tolist(), query_pos.tolist()):
        before = initial_states[s] if initial_states is not None else x.new_zeros(x.shape[1], width)
        history = torch.cat([before.to(x.dtype), x[cu[s]:cu[s + 1]].t()], dim=1)
        out.append(history[:, p:p + width])
    return torch.stack(out)


def _sequential_states(cu_seqlens, initial_states, query_seq, query_pos, step, zeros):
    """Run ``step`` token by token through every queried sequence, keeping queried states."""
    cu = cu_seqlens.tolist()
    seqs, positions = query_seq.tolist(), query_pos.tolist()
    out = [None] * len(seqs)
    for s in sorted(set(seqs)):
        wanted: dict[int, list[int]] = {}
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

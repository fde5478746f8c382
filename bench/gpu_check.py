"""GPU figures for the state kernels (run through bench/gpu_check.sh).

Prints one ``name: value`` line per figure:

* snapshot / restore bandwidth of ``copy_states`` as a fraction of a device-to-device
  ``Tensor.copy_`` of the same number of bytes (Qwen3-Next-80B-like pools: 36 GDN layers,
  conv (8192, 3) bf16 and temporal (32, 128, 128) fp32 per slot, 8 (src, dst) pairs);
* host tier: demotion (device -> pinned host) and promotion of one such checkpoint, done
  the way ``HostCheckpointTier`` copies, as a fraction of one pinned copy of the same bytes;
* time of ``gdn_state_at_positions`` / ``mamba2_state_at_positions`` for 8 checkpoints at
  the worst in-chunk offset (a full chunk minus one token to advance) against a chunked
  scan of the same extend.  The scans are plain-torch chunked implementations written
  here for timing (the WY form of transformers' ``torch_chunk_gated_delta_rule`` with the
  output, and the ``ssd_minimal`` SSD form with the output), not SGLang's fused Triton
  scans, so the ratio overstates what the checkpoint costs relative to SGLang's prefill;
* the relative error of ``gdn_state_at_positions`` at production head sizes against the
  sequential reference, starting from the torch chunked scan's chunk states.

Needs torch and triton only (no sglang): ``sglang_hybrid.kernels`` must be importable.
"""

import argparse

import torch
import torch.nn.functional as F

from sglang_hybrid.kernels import (
    GDN_CHUNK_SIZE,
    NEMOTRON_H_CHUNK_SIZE,
    conv_state_at_positions,
    copy_states,
    gdn_state_at_positions,
    gdn_state_at_positions_reference,
    mamba2_state_at_positions,
)

DEVICE = torch.device("cuda")


def _time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median of per-call CUDA-event timings."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def report(name: str, value) -> None:
    print(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}", flush=True)


# ----------------------------------------------------------------------------- copy


def bench_copy(num_layers: int, work_slots: int, ckpt_slots: int, pairs: int) -> None:
    conv_shape, temporal_shape = (8192, 3), (32, 128, 128)

    def pool(slots):
        conv = torch.randn(num_layers, slots, *conv_shape, device=DEVICE).to(torch.bfloat16)
        temporal = torch.randn(num_layers, slots, *temporal_shape, device=DEVICE)
        return [conv], temporal

    work_conv, work_temporal = pool(work_slots)
    ckpt_conv, ckpt_temporal = pool(ckpt_slots)
    gen = torch.Generator().manual_seed(0)
    src = torch.randperm(work_slots, generator=gen)[:pairs].to(DEVICE)
    dst = torch.randperm(ckpt_slots, generator=gen)[:pairs].to(DEVICE)

    copied_bytes = pairs * num_layers * (
        work_conv[0][0, 0].numel() * 2 + work_temporal[0, 0].numel() * 4
    )
    flat_src = torch.empty(copied_bytes, dtype=torch.uint8, device=DEVICE)
    flat_dst = torch.empty_like(flat_src)
    copy_ms = _time_ms(lambda: flat_dst.copy_(flat_src))
    snapshot_ms = _time_ms(
        lambda: copy_states(work_conv, work_temporal, ckpt_conv, ckpt_temporal, src, dst, check_slots=False)
    )
    restore_ms = _time_ms(
        lambda: copy_states(ckpt_conv, ckpt_temporal, work_conv, work_temporal, dst, src, check_slots=False)
    )
    copy_states(work_conv, work_temporal, ckpt_conv, ckpt_temporal, src, dst)
    exact = torch.equal(ckpt_temporal[:, dst], work_temporal[:, src]) and torch.equal(
        ckpt_conv[0][:, dst].view(torch.int16), work_conv[0][:, src].view(torch.int16)
    )
    report("copy_bytes_per_call_MiB", copied_bytes / 2**20)
    report("d2d_copy_GBps", copied_bytes / copy_ms / 1e6)
    report("snapshot_GBps", copied_bytes / snapshot_ms / 1e6)
    report("snapshot_fraction_of_d2d_copy", copy_ms / snapshot_ms)
    report("restore_fraction_of_d2d_copy", copy_ms / restore_ms)
    report("snapshot_bit_exact", exact)


# ----------------------------------------------------------------------------- host tier


def bench_host_tier(num_layers: int, slots: int) -> None:
    """Demotion (device -> pinned host) and promotion of one checkpoint, done as
    ``HostCheckpointTier._copy_rows`` does it (one ``copy_`` of the slot's row per state
    tensor, non-blocking, on a side stream; that class needs sglang, so its two lines are
    repeated here), against one pinned copy of the same bytes."""
    conv_shape, temporal_shape = (8192, 3), (32, 128, 128)
    device_conv = torch.randn(num_layers, slots, *conv_shape, device=DEVICE).to(torch.bfloat16)
    device_temporal = torch.randn(num_layers, slots, *temporal_shape, device=DEVICE)
    host_conv = torch.empty(device_conv.shape, dtype=device_conv.dtype, pin_memory=True)
    host_temporal = torch.empty(device_temporal.shape, dtype=device_temporal.dtype, pin_memory=True)
    side = torch.cuda.Stream()

    def move(src_tensors, dst_tensors, src_row, dst_row):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for src, dst in zip(src_tensors, dst_tensors):
                dst[:, dst_row].copy_(src[:, src_row], non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    device_tensors, host_tensors = (device_conv, device_temporal), (host_conv, host_temporal)
    checkpoint_bytes = num_layers * (device_conv[0, 0].numel() * 2 + device_temporal[0, 0].numel() * 4)
    flat_device = torch.empty(checkpoint_bytes, dtype=torch.uint8, device=DEVICE)
    flat_host = torch.empty(checkpoint_bytes, dtype=torch.uint8, pin_memory=True)
    d2h_plain_ms = _time_ms(lambda: flat_host.copy_(flat_device, non_blocking=True))
    h2d_plain_ms = _time_ms(lambda: flat_device.copy_(flat_host, non_blocking=True))
    demote_ms = _time_ms(lambda: move(device_tensors, host_tensors, 1, 2))
    promote_ms = _time_ms(lambda: move(host_tensors, device_tensors, 2, 3))
    torch.cuda.synchronize()
    exact = torch.equal(device_temporal[:, 3], device_temporal[:, 1]) and torch.equal(
        device_conv[:, 3].view(torch.int16), device_conv[:, 1].view(torch.int16)
    )
    report("host_checkpoint_MiB", checkpoint_bytes / 2**20)
    report("demote_GBps", checkpoint_bytes / demote_ms / 1e6)
    report("demote_fraction_of_pinned_copy", d2h_plain_ms / demote_ms)
    report("promote_GBps", checkpoint_bytes / promote_ms / 1e6)
    report("promote_fraction_of_pinned_copy", h2d_plain_ms / promote_ms)
    report("host_round_trip_bit_exact", exact)


# ----------------------------------------------------------------------------- GDN


def torch_chunked_gdn(k, v, g, beta, q, chunk=GDN_CHUNK_SIZE):
    """Chunked gated delta rule over equal-length sequences (B, T, H, D) in fp32.

    Returns (output, chunk-start states (B, NT, H, V, K)).  Same algorithm as
    transformers' torch_chunk_gated_delta_rule (which keeps states as [K, V]).
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    nt = t // chunk
    q, k, v, beta, g = (x.transpose(1, 2).float() for x in (q, k, v, beta, g))
    q = q * dk**-0.5
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, v_beta, k_beta = (x.reshape(b, h, nt, chunk, -1) for x in (q, k, v_beta, k_beta))
    g = g.reshape(b, h, nt, chunk).cumsum(-1)
    upper_incl = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=k.device))
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(upper_incl, 0)
    for i in range(1, chunk):
        attn[..., i, :i] = attn[..., i, :i] + (attn[..., i, :i, None] * attn[..., :i, :i]).sum(-2)
    attn = attn + torch.eye(chunk, device=k.device)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp()[..., None])
    strict_upper = torch.triu(upper_incl, diagonal=1)
    state = torch.zeros(b, h, dk, dv, device=k.device)
    out = torch.empty(b, h, nt, chunk, dv, device=k.device)
    states = torch.empty(b, nt, h, dv, dk, device=k.device)
    for i in range(nt):
        states[:, i] = state.transpose(-1, -2)
        q_i, k_i, g_i = q[:, :, i], k[:, :, i], g[:, :, i]
        attn_i = (q_i @ k_i.transpose(-1, -2) * decay[:, :, i]).masked_fill(strict_upper, 0)
        v_new = value[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = (q_i * g_i[..., None].exp()) @ state + attn_i @ v_new
        state = state * g_i[..., -1, None, None].exp() + (
            k_i * (g_i[..., -1, None] - g_i).exp()[..., None]
        ).transpose(-1, -2) @ v_new
    return out, states


def bench_gdn(num_seqs: int, seq_len: int) -> None:
    heads, k_heads, dk, dv, chunk = 32, 16, 128, 128, GDN_CHUNK_SIZE
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    total = num_seqs * seq_len
    q = torch.randn(num_seqs, seq_len, heads, dk, device=DEVICE, generator=gen).to(torch.bfloat16)
    k = F.normalize(torch.randn(num_seqs, seq_len, k_heads, dk, device=DEVICE, generator=gen), dim=-1)
    k = k.to(torch.bfloat16)
    v = torch.randn(num_seqs, seq_len, heads, dv, device=DEVICE, generator=gen).to(torch.bfloat16)
    g = F.logsigmoid(torch.randn(num_seqs, seq_len, heads, device=DEVICE, generator=gen) + 3.0)
    beta = torch.rand(num_seqs, seq_len, heads, device=DEVICE, generator=gen).to(torch.bfloat16)

    k_full = k.repeat_interleave(heads // k_heads, dim=2)
    scan_ms = _time_ms(lambda: torch_chunked_gdn(k_full, v, g, beta, q, chunk), iters=5, warmup=1)
    _, states = torch_chunked_gdn(k_full, v, g, beta, q, chunk)
    chunk_states = states.reshape(num_seqs * (seq_len // chunk), heads, dv, dk)

    cu = torch.arange(num_seqs + 1, device=DEVICE, dtype=torch.int32) * seq_len
    packed = [x.reshape(total, *x.shape[2:]) for x in (k, v, g, beta)]
    # Two checkpoints per sequence, one token before a chunk end: 63 tokens to advance.
    query_seq = torch.arange(num_seqs, device=DEVICE).repeat_interleave(2)
    query_pos = torch.tensor([seq_len // 2 - 1, seq_len - 1] * num_seqs, device=DEVICE)
    dst = torch.empty(query_seq.numel(), heads, dv, dk, device=DEVICE)
    slots = torch.arange(query_seq.numel(), device=DEVICE)
    at_ms = _time_ms(
        lambda: gdn_state_at_positions(*packed, cu, chunk_states, query_seq, query_pos, dst, slots, validate=False)
    )
    gdn_state_at_positions(*packed, cu, chunk_states, query_seq, query_pos, dst, slots)
    expected = gdn_state_at_positions_reference(*packed, cu, None, query_seq, query_pos)
    err = ((dst - expected).abs().max() / expected.abs().max()).item()

    conv_dim, width = 8192, 3
    x = torch.randn(total, conv_dim, device=DEVICE).to(torch.bfloat16)
    conv_dst = torch.empty(query_seq.numel(), conv_dim, width, device=DEVICE, dtype=torch.bfloat16)
    conv_ms = _time_ms(
        lambda: conv_state_at_positions(x, cu, query_seq, query_pos, conv_dst, slots, validate=False)
    )
    report("gdn_extend_tokens", total)
    report("gdn_checkpoints", query_seq.numel())
    report("gdn_state_at_position_us", at_ms * 1e3)
    report("gdn_torch_chunked_scan_us", scan_ms * 1e3)
    report("gdn_state_at_position_over_scan", at_ms / scan_ms)
    report("gdn_state_at_position_max_rel_err", err)
    report("conv_state_at_position_us", conv_ms * 1e3)


# ----------------------------------------------------------------------------- Mamba2


def torch_chunked_ssd(x, dt, A, B, C, chunk):
    """ssd_minimal (Mamba2 paper, listing 1) for one packed sequence (T, H, P), fp32.

    Returns (output, chunk-start states (NC, H, P, N)).
    """
    t, h, p = x.shape
    nc = t // chunk
    groups = B.shape[1]
    B = B.repeat_interleave(h // groups, dim=1).float()
    C = C.repeat_interleave(h // groups, dim=1).float()
    x = (x.float() * dt[..., None]).reshape(nc, chunk, h, p)
    B, C = B.reshape(nc, chunk, h, -1), C.reshape(nc, chunk, h, -1)
    a = (dt * A).reshape(nc, chunk, h).permute(2, 0, 1)  # (H, NC, L)
    a_cumsum = a.cumsum(-1)

    def segsum(z):
        n = z.shape[-1]
        z = z[..., None].expand(*z.shape, n)
        z = z.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=z.device), -1), 0)
        s = z.cumsum(-2)
        return s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=z.device), 0), -torch.inf)

    decay_in = torch.exp(segsum(a))  # (H, NC, L, L)
    y_diag = torch.einsum("clhn,cshn,hcls,cshp->clhp", C, B, decay_in, x)
    decay_states = torch.exp(a_cumsum[..., -1:] - a_cumsum)
    states = torch.einsum("clhn,hcl,clhp->chpn", B, decay_states, x)
    states = torch.cat([torch.zeros_like(states[:1]), states])
    chunk_decay = torch.exp(segsum(F.pad(a_cumsum[..., -1], (1, 0))))  # (H, NC+1, NC+1)
    states = torch.einsum("hzc,chpn->zhpn", chunk_decay, states)[:-1]
    y_off = torch.einsum("clhn,chpn,hcl->clhp", C, states, torch.exp(a_cumsum))
    return (y_diag + y_off).reshape(t, h, p), states


def bench_mamba2(num_seqs: int, seq_len: int) -> None:
    heads, groups, head_dim, state_dim, chunk = 128, 8, 64, 128, NEMOTRON_H_CHUNK_SIZE
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    total = num_seqs * seq_len
    x = torch.randn(total, heads, head_dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    dt = F.softplus(torch.randn(total, heads, device=DEVICE, generator=gen) - 2.0)
    A = -torch.rand(heads, device=DEVICE, generator=gen)
    B = torch.randn(total, groups, state_dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    C = torch.randn(total, groups, state_dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    # Each sequence spans whole chunks, so one packed scan over the batch equals the
    # per-sequence scans for timing purposes.
    scan_ms = _time_ms(lambda: torch_chunked_ssd(x, dt, A, B, C, chunk), iters=5, warmup=1)
    _, chunk_states = torch_chunked_ssd(x, dt, A, B, C, chunk)

    cu = torch.arange(num_seqs + 1, device=DEVICE, dtype=torch.int32) * seq_len
    query_seq = torch.arange(num_seqs, device=DEVICE).repeat_interleave(2)
    query_pos = torch.tensor([seq_len // 2 - 1, seq_len - 1] * num_seqs, device=DEVICE)
    dst = torch.empty(query_seq.numel(), heads, head_dim, state_dim, device=DEVICE)
    slots = torch.arange(query_seq.numel(), device=DEVICE)
    at_ms = _time_ms(
        lambda: mamba2_state_at_positions(
            x, dt, A, B, cu, chunk_states, query_seq, query_pos, dst, slots, chunk_size=chunk, validate=False
        )
    )
    report("mamba2_extend_tokens", total)
    report("mamba2_state_at_position_us", at_ms * 1e3)
    report("mamba2_torch_chunked_scan_us", scan_ms * 1e3)
    report("mamba2_state_at_position_over_scan", at_ms / scan_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--work-slots", type=int, default=32)
    parser.add_argument("--checkpoint-slots", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device")
    report("device", torch.cuda.get_device_name().replace(" ", "_"))
    bench_copy(args.layers, args.work_slots, args.checkpoint_slots, args.pairs)
    bench_host_tier(args.layers, slots=4)
    bench_gdn(args.seqs, args.seq_len)
    bench_mamba2(args.seqs, args.seq_len)


if __name__ == "__main__":
    main()

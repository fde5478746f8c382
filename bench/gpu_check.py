"""GPU figures of the state kernels, measured against SGLang's own kernels (bench/gpu_check.sh).

Baselines are the real thing: SGLang 0.5.23's Triton GDN prefill ``chunk_gated_delta_rule``
(what ``TritonGDNKernel.extend`` runs) and its Mamba2 ``mamba_chunk_scan_combined`` (what
``MambaMixer2`` runs in prefill), from the copy bench/gpu_ops.py makes, with patches/
applied. Figures, one ``name: value`` line each, all written to one JSON:

* ``copy_states`` snapshot / restore between SGLang's live pool and the checkpoint pool
  (Qwen3-Next-80B layers), as a fraction of a device-to-device copy of the same bytes;
* host tier: demotion / promotion of one checkpoint as ``HostCheckpointTier`` does them (a
  gather into a contiguous staging copy on the device and one DMA, on a side stream) as a
  fraction of a plain pinned copy of the same bytes; bit-exact round trip;
* GDN, per batch shape of the table in issue 20 (Qwen3-Next-80B layer: 32 value heads, 16
  key heads, head dim 128): the scan, the scan writing the anchor states into checkpoint
  slots (``snapshot_*``, patches/0002) and the conv capture, anchors at the worst in-chunk
  offset (63 tokens past a chunk start); the capture's cost is ``(scan with snapshots -
  scan) + conv capture`` as a fraction of the scan (scan pairs timed interleaved, the conv
  capture's device time from a CUDA graph replay), beside the floor of writing the states;
* GDN exactness: captured states and separate prefills of the same prefixes, against each
  other (bit-equal?) and against the fp32 token-by-token reference;
* Mamba2 (Nemotron-H layer: 128 heads x 64 x 128, 8 groups, chunk 256): the scan, and the
  capture the server runs (``runtime/mamba2_hooks.py``): the scan with SGLang's own
  ``track_end_locs`` at the anchors plus the copy into slots, and the conv capture; its cost
  ``(tracked scan - scan) + conv capture`` over the scan (``mamba2_capture_over_scan_worst``
  over the shapes of issue 23), beside our matrix-form capture kernel from the scan's chunk
  states; anchors 255 tokens into a chunk; exactness of both.

``--smoke`` runs every section at toy sizes on the CPU under the Triton interpreter (fp16,
which the interpreter computes correctly): it checks the script, not the numbers.
The last line is the headline: the worst GDN capture cost over SGLang's scan.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sglang_hybrid.kernels import (
    CaptureIndex,
    conv_capture_states,
    copy_states,
    mamba2_capture_states,
    slot_major_pool,
)
from sglang_hybrid.kernels.reference import gdn_states_reference, mamba2_states_reference

RESULTS: dict = {}
OUT_PATH = Path("results/bench/gpu_check.json")
START = time.monotonic()
BUDGET_S = 400.0


def report(name: str, value) -> None:
    RESULTS[name] = value
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    print(f"{name}: {text}", flush=True)
    OUT_PATH.write_text(json.dumps(RESULTS, indent=1))


def section(fn):
    """Run one section; an error is reported and the next section still runs."""
    def run(*args, **kwargs):
        if time.monotonic() - START > BUDGET_S:
            report(f"{fn.__name__}_skipped", "time budget spent")
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # a failed section must not lose the others' figures
            traceback.print_exc()
            report(f"{fn.__name__}_error", f"{type(error).__name__}: {error}"[:300])
            return None
    return run


class Timer:
    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup

    def us(self, fn) -> float:
        """Median time of one call in microseconds (CUDA events; wall clock on CPU)."""
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.iters):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            return float(np.median(times))
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return float(np.median([s.elapsed_time(e) for s, e in events]) * 1e3)


    def pair_us(self, fn_a, fn_b) -> tuple[float, float]:
        """Median times of two calls measured alternately, so clock drift hits both alike."""
        a, b = [], []
        for _ in range(max(1, self.iters // 4)):
            a.append(self.us_once(fn_a))
            b.append(self.us_once(fn_b))
        return float(np.median(a)), float(np.median(b))

    def us_once(self, fn) -> float:
        saved = self.iters
        self.iters = 4
        try:
            return self.us(fn)
        finally:
            self.iters = saved

    def graph_us(self, fn) -> float:
        """Device time of ``fn`` replayed from a CUDA graph: no host launch cost in it."""
        if self.device.type != "cuda":
            return self.us(fn)
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.us(graph.replay)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- copies


def state_specs(cfg):
    return [((cfg.conv_dim, cfg.conv_width), torch.bfloat16), ((cfg.heads, cfg.head_v, cfg.head_k), torch.float32)]


def layer_major_pool(cfg, slots, device, fill=torch.randn):
    """SGLang's MambaPool layout, which the checkpoint pool shares: (layers, slots, *shape)."""
    conv = fill(cfg.layers, slots, cfg.conv_dim, cfg.conv_width, device=device).to(torch.bfloat16)
    temporal = fill(cfg.layers, slots, cfg.heads, cfg.head_v, cfg.head_k, device=device)
    return [conv], temporal


@section
def bench_copy(cfg, device, timer, pairs=8):
    live_conv, live_temporal = layer_major_pool(cfg, 4 * pairs, device)
    ckpt_conv, ckpt_temporal = layer_major_pool(cfg, 2 * pairs + 1, device)
    gen = torch.Generator().manual_seed(0)
    src = torch.randperm(4 * pairs, generator=gen)[:pairs].to(device)
    dst = (torch.randperm(2 * pairs, generator=gen)[:pairs] + 1).to(device)
    nbytes = pairs * cfg.layers * (cfg.conv_dim * cfg.conv_width * 2 + cfg.heads * cfg.head_v * cfg.head_k * 4)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    copy_us = timer.us(lambda: flat_dst.copy_(flat_src))
    report("copy_bytes_per_call_MiB", nbytes / 2**20)
    report("d2d_copy_GBps", nbytes / copy_us / 1e3)

    def snapshot():
        copy_states(live_conv, live_temporal, ckpt_conv, ckpt_temporal, src, dst, check_slots=False)

    def restore():
        copy_states(ckpt_conv, ckpt_temporal, live_conv, live_temporal, dst, src, check_slots=False)

    snap_us, rest_us = timer.us(snapshot), timer.us(restore)
    snapshot()
    sync(device)
    exact = torch.equal(ckpt_temporal[:, dst], live_temporal[:, src]) and torch.equal(
        ckpt_conv[0][:, dst].view(torch.int16), live_conv[0][:, src].view(torch.int16))
    report("snapshot_fraction_of_d2d_copy", copy_us / snap_us)
    report("restore_fraction_of_d2d_copy", copy_us / rest_us)
    report("snapshot_bit_exact", exact)


@section
def bench_host_tier(cfg, device, timer):
    if device.type != "cuda":
        report("host_tier", "needs CUDA (pinned memory, side stream)")
        return
    device_conv, device_temporal = layer_major_pool(cfg, 4, device)
    host_storage, _, _ = slot_major_pool(cfg.layers, state_specs(cfg), 4, "cpu", pin_memory=True)
    side = torch.cuda.Stream()
    nbytes = host_storage.shape[1]

    def slot(i):
        return torch.full((1,), i, dtype=torch.int64, device=device)

    def demote(device_slot, host_row):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            staging, staged_conv, staged_temporal = slot_major_pool(
                cfg.layers, state_specs(cfg), 1, device, zeroed=False)
            copy_states(device_conv, device_temporal, staged_conv, staged_temporal, slot(device_slot), slot(0),
                        check_slots=False)
            host_storage[host_row].copy_(staging[0], non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    def promote(host_row, device_slot):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            staging, staged_conv, staged_temporal = slot_major_pool(
                cfg.layers, state_specs(cfg), 1, device, zeroed=False)
            staging[0].copy_(host_storage[host_row], non_blocking=True)
            copy_states(staged_conv, staged_temporal, device_conv, device_temporal, slot(0), slot(device_slot),
                        check_slots=False)
        torch.cuda.current_stream().wait_stream(side)

    flat_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h_us = timer.us(lambda: flat_host.copy_(flat_device, non_blocking=True))
    h2d_us = timer.us(lambda: flat_device.copy_(flat_host, non_blocking=True))
    demote_us = timer.us(lambda: demote(1, 2))
    promote_us = timer.us(lambda: promote(2, 3))
    torch.cuda.synchronize()
    exact = torch.equal(device_temporal[:, 3], device_temporal[:, 1]) and torch.equal(
        device_conv[0][:, 3].view(torch.int16), device_conv[0][:, 1].view(torch.int16))
    report("host_checkpoint_MiB", nbytes / 2**20)
    report("demote_GBps", nbytes / demote_us / 1e3)
    report("demote_fraction_of_pinned_copy", d2h_us / demote_us)
    report("promote_GBps", nbytes / promote_us / 1e3)
    report("promote_fraction_of_pinned_copy", h2d_us / promote_us)
    report("host_round_trip_bit_exact", exact)


# ----------------------------------------------------------------------------- GDN


def gdn_inputs(cfg, num_seqs, seq_len, device, dtype, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    total = num_seqs * seq_len
    q = torch.randn(1, total, cfg.k_heads, cfg.head_k, device=device, generator=gen).to(dtype)
    k = torch.randn(1, total, cfg.k_heads, cfg.head_k, device=device, generator=gen).to(dtype)
    v = torch.randn(1, total, cfg.heads, cfg.head_v, device=device, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(1, total, cfg.heads, device=device, generator=gen) + 4.0)
    beta = torch.rand(1, total, cfg.heads, device=device, generator=gen)
    initial = torch.randn(num_seqs, cfg.heads, cfg.head_v, cfg.head_k, device=device, generator=gen) * 0.1
    cu = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * seq_len
    return q, k, v, g, beta, initial, cu


def worst_offset_positions(seq_len, anchors, chunk, offset):
    """``anchors`` positions spread over a sequence, each ``offset`` tokens into its chunk."""
    chunks = max(1, seq_len // chunk)
    picks = sorted({min(chunks - 1, (j * chunks) // anchors) for j in range(anchors)})
    return [min(seq_len, c * chunk + offset) for c in picks]


def gdn_batch(cfg, num_seqs, seq_len, anchors, device, dtype, offset=63, seed=0):
    q, k, v, g, beta, initial, cu = gdn_inputs(cfg, num_seqs, seq_len, device, dtype, seed)
    per_seq = worst_offset_positions(seq_len, anchors, 64, offset)
    seqs = [s for s in range(num_seqs) for _ in per_seq]
    positions = per_seq * num_seqs
    conv, temporal = layer_major_pool(cfg, len(seqs) + 1, device, fill=torch.empty)
    index = CaptureIndex.build([seq_len] * num_seqs, [True] * num_seqs, seqs, positions,
                               range(1, len(seqs) + 1), device)
    return q, k, v, g, beta, initial, cu, seqs, positions, index, conv, temporal


def run_scan(chunk_gated_delta_rule, q, k, v, g, beta, pool, cu, **track):
    return chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=pool,
        initial_state_indices=torch.arange(1, cu.numel(), device=q.device, dtype=torch.int32),
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True, **track,
    )


@section
def bench_gdn_row(cfg, device, timer, dtype, chunk_gated_delta_rule, num_seqs, seq_len, anchors):
    label = f"gdn_{num_seqs}x{seq_len}_a{anchors}"
    q, k, v, g, beta, initial, cu, seqs, _, index, conv, temporal = gdn_batch(
        cfg, num_seqs, seq_len, anchors, device, dtype)
    pool = torch.cat([torch.zeros_like(initial[:1]), initial])
    x = torch.randn(num_seqs * seq_len, cfg.conv_dim, device=device).to(dtype)
    live_conv = torch.randn(num_seqs + 1, cfg.conv_dim, cfg.conv_width, device=device).to(dtype)
    live_rows = torch.arange(1, num_seqs + 1, device=device, dtype=torch.int32)

    def scan():
        run_scan(chunk_gated_delta_rule, q, k, v, g, beta, pool, cu)

    def scan_with_snapshots():
        run_scan(chunk_gated_delta_rule, q, k, v, g, beta, pool, cu, **snapshot_args(index, temporal[0]))

    scan_us, snapshot_us = timer.pair_us(scan, scan_with_snapshots)
    conv_eager_us = timer.us(lambda: conv_capture_states(x, index, conv[0][0], live_conv, live_rows))
    conv_us = timer.graph_us(lambda: conv_capture_states(x, index, conv[0][0], live_conv, live_rows))
    total = max(0.0, snapshot_us - scan_us) + conv_us
    report(f"{label}_checkpoints", len(seqs))
    report(f"{label}_scan_us", scan_us)
    report(f"{label}_scan_with_snapshots_us", snapshot_us)
    report(f"{label}_conv_capture_us", conv_us)
    report(f"{label}_conv_capture_eager_us", conv_eager_us)
    if device.type == "cuda":
        # Any capture writes one fp32 state per anchor: that write is its floor.
        scratch = torch.empty(len(seqs), cfg.heads * cfg.head_v * cfg.head_k, device=device)
        floor_us = timer.us(lambda: scratch.fill_(1.0))
        report(f"{label}_state_write_floor_us", floor_us)
        report(f"{label}_state_write_floor_over_scan", floor_us / scan_us)
    report(f"{label}_capture_over_scan", total / scan_us)
    return total / scan_us


def snapshot_args(index, states):
    return dict(snapshot_states=states, snapshot_chunk_ptr=index.snapshot_chunk_ptr,
                snapshot_offsets=index.snapshot_offsets, snapshot_rows=index.snapshot_rows,
                snapshots_per_chunk=index.snapshots_per_chunk)


@section
def gdn_exactness(cfg, device, dtype, chunk_gated_delta_rule, num_seqs=2, seq_len=1024):
    """Captured states vs separate prefills of the same prefixes vs the fp32 reference."""
    q, k, v, g, beta, initial, cu = gdn_inputs(cfg, num_seqs, seq_len, device, dtype, seed=2)
    offsets = [p for p in (1, 17, 63, 64, 100, 511, 700) if p < seq_len] + [seq_len]
    seqs = [s for s in range(num_seqs) for _ in offsets]
    positions = offsets * num_seqs
    _, temporal = layer_major_pool(cfg, len(seqs) + 1, device, fill=torch.zeros)
    index = CaptureIndex.build([seq_len] * num_seqs, [True] * num_seqs, seqs, positions,
                               range(1, len(seqs) + 1), device)
    pool = torch.cat([torch.zeros_like(initial[:1]), initial])
    run_scan(chunk_gated_delta_rule, q, k, v, g, beta, pool, cu, **snapshot_args(index, temporal[0]))
    captured = temporal[0][1:len(seqs) + 1].clone()

    expected = gdn_states_reference(k, v, g, beta, cu, initial, torch.tensor(seqs), torch.tensor(positions))
    capture_errors, prefill_errors, differences = [], [], []
    for i, (s, p) in enumerate(zip(seqs, positions)):
        alone = initial[s:s + 1].clone()
        sl = slice(s * seq_len, s * seq_len + p)
        chunk_gated_delta_rule(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=alone,
            initial_state_indices=torch.zeros(1, dtype=torch.int32, device=device),
            cu_seqlens=torch.tensor([0, p], dtype=torch.int32, device=device), use_qk_l2norm_in_kernel=True,
        )
        capture_errors.append(relative_error(captured[i], expected[i]))
        prefill_errors.append(relative_error(alone[0], expected[i]))
        differences.append(relative_error(captured[i], alone[0]))
    report("gdn_capture_max_rel_err", max(capture_errors))
    report("gdn_separate_prefill_max_rel_err", max(prefill_errors))
    report("gdn_capture_err_over_prefill_err", max(capture_errors) / max(prefill_errors))
    report("gdn_capture_vs_prefill_max_rel_diff", max(differences))
    report("gdn_captures_bit_equal_to_prefill", f"{sum(d == 0.0 for d in differences)}/{len(differences)}")


# ----------------------------------------------------------------------------- Mamba2


def chunk_indices_offsets(cu: list[int], chunk: int, device):
    """The logical-chunk metadata SGLang's Mamba2Metadata builds for a batch with initial states."""
    total = cu[-1]
    indices, offsets = [], []
    for s, e in zip(cu[:-1], cu[1:]):
        for c in range(s // chunk, -(-e // chunk)):
            indices.append(c)
            offsets.append(s % chunk if c == s // chunk else 0)
    assert len(indices) == math.ceil(total / chunk) + sum(1 for s in cu[1:-1] if s % chunk), "metadata"
    return (torch.tensor(indices, dtype=torch.int32, device=device),
            torch.tensor(offsets, dtype=torch.int32, device=device))


def mamba_batch(cfg, num_seqs, seq_len, anchors, device, dtype, offset=255, seed=1):
    gen = torch.Generator(device=device).manual_seed(seed)
    total = num_seqs * seq_len
    m = cfg.mamba
    x = torch.randn(1, total, m.heads, m.head_dim, device=device, generator=gen).to(dtype)
    dt = (torch.randn(1, total, m.heads, device=device, generator=gen) - 2.0).to(dtype)
    dt_bias = torch.randn(m.heads, device=device, generator=gen) * 0.1
    A = -torch.rand(m.heads, device=device, generator=gen) * 4
    B = torch.randn(1, total, m.groups, m.state, device=device, generator=gen).to(dtype)
    C = torch.randn(1, total, m.groups, m.state, device=device, generator=gen).to(dtype)
    D = torch.randn(m.heads, device=device, generator=gen)
    initial = torch.randn(num_seqs, m.heads, m.head_dim, m.state, device=device, generator=gen) * 0.1
    cu_list = [i * seq_len for i in range(num_seqs + 1)]
    per_seq = worst_offset_positions(seq_len, anchors, m.chunk, offset)
    seqs = [s for s in range(num_seqs) for _ in per_seq]
    positions = per_seq * num_seqs
    return x, dt, dt_bias, A, B, C, D, initial, cu_list, seqs, positions


def run_ssd(mamba_chunk_scan_combined, cfg, x, dt, dt_bias, A, B, C, D, initial, cu_list, out, track=None):
    device = x.device
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    lens = torch.tensor(np.diff(cu_list), device=device)
    seq_idx = torch.repeat_interleave(torch.arange(len(cu_list) - 1, device=device, dtype=torch.int32), lens)[None]
    chunk_indices, chunk_offsets = chunk_indices_offsets(cu_list, cfg.mamba.chunk, device)
    track_seq_idx, track_end_locs = track if track is not None else (None, None)
    return mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size=cfg.mamba.chunk, D=D, z=None, dt_bias=dt_bias, seq_idx=seq_idx,
        chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, cu_seqlens=cu, initial_states=initial,
        return_varlen_states=True, return_final_states=False, return_track_states=True,
        track_seq_idx=track_seq_idx, track_end_locs=track_end_locs, dt_softplus=True,
        dt_limit=(0.0, float("inf")), out=out, state_dtype=torch.float32,
    )


@section
def bench_mamba2_row(cfg, device, timer, dtype, mamba_chunk_scan_combined, num_seqs, seq_len, anchors):
    """The capture the server runs (runtime/mamba2_hooks.py): the anchors ride along as the
    scan's tracked end positions, the tracked states go into checkpoint slots, and the conv
    capture gathers the conv states; its cost is ``(tracked scan - scan) + conv capture``
    over the scan. Beside it, our matrix-form kernel from the scan's chunk states."""
    label = f"mamba2_{num_seqs}x{seq_len}_a{anchors}"
    m = cfg.mamba
    x, dt, dt_bias, A, B, C, D, initial, cu_list, seqs, positions = mamba_batch(
        cfg, num_seqs, seq_len, anchors, device, dtype)
    out = torch.empty_like(x)
    dst = torch.empty(len(seqs) + 1, m.heads, m.head_dim, m.state, device=device)
    slots = list(range(1, len(seqs) + 1))
    index = CaptureIndex.build([seq_len] * num_seqs, [True] * num_seqs, seqs, positions, slots, device=device)
    conv_dim = m.heads * m.head_dim + 2 * m.groups * m.state
    pre_conv = torch.randn(num_seqs * seq_len, conv_dim, device=device).to(dtype)
    live_conv = torch.randn(num_seqs + 1, conv_dim, cfg.conv_width, device=device).to(dtype)
    conv_dst = torch.empty(len(seqs) + 1, conv_dim, cfg.conv_width, device=device, dtype=dtype)
    live_rows = torch.arange(1, num_seqs + 1, device=device, dtype=torch.int32)

    def scan():
        return run_ssd(mamba_chunk_scan_combined, cfg, x, dt, dt_bias, A, B, C, D, initial, cu_list, out)

    def scan_tracked():
        _, _, tracked = run_ssd(mamba_chunk_scan_combined, cfg, x, dt, dt_bias, A, B, C, D, initial, cu_list,
                                out, (index.seq.long(), index.end))
        dst[index.slot.long()] = tracked[0]

    states, _, _ = scan()

    def matrix_capture():
        mamba2_capture_states(x, dt, A, B, cu_list, states, seqs, positions, dst, slots,
                              initial_states=initial, initial_rows=range(num_seqs), dt_bias=dt_bias,
                              dt_softplus=True, chunk_size=m.chunk)

    scan_us, tracked_us = timer.pair_us(scan, scan_tracked)
    conv_us = timer.graph_us(lambda: conv_capture_states(pre_conv, index, conv_dst, live_conv, live_rows))
    matrix_us = timer.us(matrix_capture)  # eager: includes building its index on the host
    total = max(0.0, tracked_us - scan_us) + conv_us
    report(f"{label}_checkpoints", len(seqs))
    report(f"{label}_scan_us", scan_us)
    report(f"{label}_scan_tracked_us", tracked_us)
    report(f"{label}_conv_capture_us", conv_us)
    report(f"{label}_sglang_track_over_scan", max(0.0, tracked_us - scan_us) / scan_us)
    report(f"{label}_matrix_capture_us", matrix_us)
    report(f"{label}_matrix_capture_over_scan", matrix_us / scan_us)
    report(f"{label}_capture_over_scan", total / scan_us)
    return total / scan_us


@section
def mamba2_exactness(cfg, device, dtype, mamba_chunk_scan_combined, num_seqs=2, seq_len=1024):
    m = cfg.mamba
    x, dt, dt_bias, A, B, C, D, initial, cu_list, _, _ = mamba_batch(cfg, num_seqs, seq_len, 1, device, dtype)
    offsets = [p for p in (1, 100, 255, 256, 300, 700) if p < seq_len] + [seq_len]
    seqs = [s for s in range(num_seqs) for _ in offsets]
    positions = offsets * num_seqs
    out = torch.empty_like(x)
    ends = torch.tensor([cu_list[s] + p for s, p in zip(seqs, positions)], dtype=torch.int32, device=device)
    states, _, tracked = run_ssd(mamba_chunk_scan_combined, cfg, x, dt, dt_bias, A, B, C, D, initial, cu_list, out,
                                 (torch.tensor(seqs, dtype=torch.int32, device=device), ends))
    dst = torch.empty(len(seqs), m.heads, m.head_dim, m.state, device=device)
    mamba2_capture_states(x, dt, A, B, cu_list, states, seqs, positions, dst, range(len(seqs)),
                          initial_states=initial, initial_rows=range(num_seqs), dt_bias=dt_bias,
                          dt_softplus=True, chunk_size=m.chunk)
    dt_used = F.softplus(dt[0].float() + dt_bias)
    expected = mamba2_states_reference(x, dt_used, A, B, torch.tensor(cu_list), initial,
                                       torch.tensor(seqs), torch.tensor(positions))
    report("mamba2_capture_max_rel_err", max(relative_error(dst[i], expected[i]) for i in range(len(seqs))))
    report("mamba2_sglang_track_max_rel_err",
           max(relative_error(tracked[0][i], expected[i]) for i in range(len(seqs))))


# ----------------------------------------------------------------------------- main


class Shapes:
    """Layer shapes: Qwen3-Next-80B's GDN layer and Nemotron-H's Mamba2 layer (or toys)."""

    def __init__(self, smoke: bool):
        self.layers = 2 if smoke else 36
        self.heads, self.k_heads = (4, 2) if smoke else (32, 16)
        self.head_k = self.head_v = 32 if smoke else 128
        self.conv_dim = 2 * self.k_heads * self.head_k + self.heads * self.head_v
        self.conv_width = 3
        self.mamba = argparse.Namespace(
            heads=8 if smoke else 128, head_dim=16 if smoke else 64, state=16 if smoke else 128,
            groups=2 if smoke else 8, chunk=64 if smoke else 256,
        )


def load_sglang_kernels(smoke: bool):
    from sglang_gpu_ops.fla.chunk import chunk_gated_delta_rule
    from sglang_gpu_ops.mamba.ssd_combined import mamba_chunk_scan_combined

    if smoke:
        # Device contexts the kernels enter do not exist for CPU tensors.
        import contextlib
        import types

        import sglang_gpu_ops.fla.utils as fla_utils

        fla_utils.custom_device_ctx = lambda index: contextlib.nullcontext()
        device_module = torch.get_device_module
        cpu_module = types.SimpleNamespace(device=lambda index: contextlib.nullcontext())
        torch.get_device_module = lambda device=None: (
            cpu_module if torch.device(device or "cpu").type == "cpu" else device_module(device))
        # The autotuners would benchmark on a driver the interpreter does not have.
        from triton.runtime.autotuner import Autotuner

        prune = Autotuner.prune_configs
        Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
        # fla binds tl.exp & co. at import; the interpreter patches only tl's own.
        import triton.language as tl

        for name, module in list(sys.modules.items()):
            if name.startswith("sglang_gpu_ops."):
                for builtin in ("exp", "exp2", "log", "log2"):
                    if getattr(module, builtin, None) is getattr(tl, builtin):
                        setattr(module, builtin, (lambda n: lambda *a, **kw: getattr(tl, n)(*a, **kw))(builtin))
    return chunk_gated_delta_rule, mamba_chunk_scan_combined


def warm_up(device, seconds: float = 2.0) -> None:
    """Bring the GPU's clocks up before the first timing."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def plot(path: Path) -> None:
    """Capture cost over the scan, per batch shape, GDN and Mamba2 side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "GDN capture": [(k[4:-len("_capture_over_scan")], v) for k, v in RESULTS.items()
                        if k.startswith("gdn_") and k.endswith("_capture_over_scan")],
        "Mamba2 capture": [(k[7:-len("_capture_over_scan")], v) for k, v in RESULTS.items()
                           if k.startswith("mamba2_") and k.endswith("_capture_over_scan")
                           and not k.endswith("_matrix_capture_over_scan") and "worst" not in k],
        "Mamba2 matrix kernel": [(k[7:-len("_matrix_capture_over_scan")], v) for k, v in RESULTS.items()
                                 if k.startswith("mamba2_") and k.endswith("_matrix_capture_over_scan")],
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, names in zip(axes, (["GDN capture"], ["Mamba2 capture", "Mamba2 matrix kernel"])):
        for offset, name in enumerate(names):
            labels = [label for label, _ in series[name]]
            ax.bar(np.arange(len(labels)) + 0.4 * offset, [v for _, v in series[name]], width=0.4, label=name)
            ax.set_xticks(np.arange(len(labels)), labels, rotation=30, fontsize=7)
        ax.axhline(0.05, color="red", linestyle="--", linewidth=1, label="0.05 target")
        ax.set_ylabel("cost / SGLang's prefill scan")
        ax.legend(fontsize=7)
    fig.suptitle(f"anchor capture cost per layer ({RESULTS.get('device', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


GDN_ROWS = [(4, 4096, 2), (4, 4096, 8), (1, 32768, 8), (16, 1024, 2), (32, 512, 4)]
MAMBA_ROWS = [(4, 4096, 2), (4, 4096, 8), (1, 32768, 8), (16, 1024, 2)]


def main() -> None:
    global OUT_PATH, BUDGET_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU interpreter")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="skip sections started after this")
    args = parser.parse_args()
    OUT_PATH, BUDGET_S = args.out, args.budget_s
    OUT_PATH.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs under the interpreter: set TRITON_INTERPRET=1")
        device, dtype, timer = torch.device("cpu"), torch.float16, Timer(torch.device("cpu"), 1, 0)
        gdn_rows, mamba_rows = [(2, 128, 2)], [(2, 128, 2)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check needs a CUDA device (or --smoke)")
        device, dtype, timer = torch.device("cuda"), torch.bfloat16, Timer(torch.device("cuda"), 20, 3)
        gdn_rows, mamba_rows = GDN_ROWS, MAMBA_ROWS
    cfg = Shapes(args.smoke)
    report("device", torch.cuda.get_device_name() if device.type == "cuda" else "cpu-interpreter")
    chunk_gated_delta_rule, mamba_chunk_scan_combined = load_sglang_kernels(args.smoke)

    warm_up(device)
    bench_copy(cfg, device, timer)
    bench_host_tier(cfg, device, timer)
    ratios = [bench_gdn_row(cfg, device, timer, dtype, chunk_gated_delta_rule, *row) for row in gdn_rows]
    gdn_exactness(cfg, device, dtype, chunk_gated_delta_rule, seq_len=256 if args.smoke else 1024)
    mamba_ratios = [bench_mamba2_row(cfg, device, timer, dtype, mamba_chunk_scan_combined, *row)
                    for row in mamba_rows]
    mamba2_exactness(cfg, device, dtype, mamba_chunk_scan_combined, seq_len=256 if args.smoke else 1024)
    report("elapsed_s", time.monotonic() - START)
    plot(OUT_PATH.with_suffix(".png"))
    mamba_measured = [r for r in mamba_ratios if r is not None]
    report("mamba2_capture_over_scan_worst", max(mamba_measured) if mamba_measured else "not measured")
    measured = [r for r in ratios if r is not None]
    report("gdn_capture_over_scan_worst", max(measured) if measured else "not measured")


if __name__ == "__main__":
    main()

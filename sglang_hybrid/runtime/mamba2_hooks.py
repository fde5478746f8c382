"""Hooks that make SGLang's Mamba2 prefill capture the planned anchor states (Nemotron-H,
Granite-4.0-H, Falcon-H1), registered by the plugin beside the GDN ones (``hooks.py``).

* ``Mamba2AttnBackend.forward`` (every Mamba2 layer of a forward whose captures the scheduler
  planned, ``anchor_capture``): names this layer's checkpoint tensors for the two calls
  inside ``MambaMixer2.forward`` below, then runs the layer as usual;
* the mixer's prefill conv1d (``causal_conv1d_fn``, or its Triton twin, whichever the model
  picks): before the convolution overwrites the entering conv states, the conv state at each
  queried position is gathered from its pre-conv inputs (``conv_capture_states``,
  bit-exact);
* the mixer's SSD scan (``mamba_chunk_scan_combined``): the queried positions ride along as
  the scan's own tracked end positions (``track_seq_idx`` / ``track_end_locs``, which SGLang
  0.5.23 already offers for its ``extra_buffer`` strategy, unused under ``no_buffer``). The
  scan then computes each state from its chunk-start state and the chunk's inputs up to the
  position in matrix form (``chunk_state_varlen``), exactly what it does for a sequence's
  final state, so a capture is the state a separate prefill of the prefix ends with. The
  states come back with the scan's result and go into the layer's checkpoint slots; the
  tracked positions SGLang asked for itself, if any, are returned to it untouched.

The forward's ``CaptureIndex`` already holds what the scan needs on the device (each capture's
sequence and packed end), so no layer does host work or waits for the device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_hybrid.kernels import conv_capture_states
from sglang_hybrid.runtime.anchor_capture import layer_captured
from sglang_hybrid.runtime.hooks import _queries_for

if TYPE_CHECKING:
    from sglang_hybrid.runtime.anchor_capture import CaptureQueries

MAMBA2_FORWARD_TARGET = (
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.Mamba2AttnBackend.forward"
)
_MIXER_MODULE = "sglang.srt.layers.attention.mamba.mamba"
# The mixer looks these up by module-level name at every call (mamba.py, MambaMixer2.forward).
MAMBA2_CONV_TARGETS = (f"{_MIXER_MODULE}.causal_conv1d_fn", f"{_MIXER_MODULE}.causal_conv1d_fn_triton")
MAMBA2_SCAN_TARGET = f"{_MIXER_MODULE}.mamba_chunk_scan_combined"


@dataclass
class _LayerCapture:
    queries: "CaptureQueries"
    conv_dst: torch.Tensor  # this layer's checkpoint conv states (num_slots, dim, W)
    temporal_dst: torch.Tensor  # this layer's checkpoint SSM states (num_slots, H, P, N)


# The Mamba2 layer being captured, between its backend forward and the mixer's calls inside.
_layer_capture = threading.local()


def capture_around_mamba2_forward(
    original, backend, mixer, hidden_states, output=None, layer_id=None, forward_batch=None, **kwargs
):
    # Nemotron-H and Granite pass everything by keyword, Falcon-H1 the first three by position.
    def run_layer():
        return original(
            backend, mixer=mixer, hidden_states=hidden_states, output=output, layer_id=layer_id,
            forward_batch=forward_batch, **kwargs,
        )  # fmt: skip

    queries = _queries_for(backend, forward_batch)
    if queries is None:
        return run_layer()
    checkpoints = backend.req_to_token_pool.mamba_ckpt_pool
    layer_index = backend.req_to_token_pool.mamba2_layer_index(layer_id)
    _layer_capture.target = _LayerCapture(
        queries, checkpoints.conv[0][layer_index], checkpoints.temporal[layer_index]
    )
    try:
        result = run_layer()
    finally:
        _layer_capture.target = None
    layer_captured(checkpoints, layer_index)
    return result


def capture_around_mamba2_conv(original, *args, **kwargs):
    # Arguments pass through as given: the same function may be bound elsewhere and called
    # positionally. Inside a captured Mamba2 layer the mixer passes x first and the rest by
    # keyword.
    target = getattr(_layer_capture, "target", None)
    if target is not None:
        # x is the mixer's (dim, tokens) view of the pre-conv inputs; the sequences continue
        # from conv_states[cache_indices[seq]] (their live slots).
        conv_capture_states(
            args[0].t(), target.queries.index, target.conv_dst, kwargs["conv_states"], kwargs["cache_indices"]
        )
    return original(*args, **kwargs)


def capture_around_mamba2_scan(original, *args, **kwargs):
    target = getattr(_layer_capture, "target", None)
    if target is None or not kwargs.get("return_track_states"):
        return original(*args, **kwargs)
    index = target.queries.index
    track_seq_idx, track_end_locs = kwargs.get("track_seq_idx"), kwargs.get("track_end_locs")
    own = 0 if track_end_locs is None else track_end_locs.numel()
    if own:
        seqs = torch.cat([track_seq_idx.long(), index.seq.long()])
        ends = torch.cat([track_end_locs.to(index.end.dtype), index.end])
    else:
        seqs, ends = index.seq.long(), index.end
    chunk_states, final_states, tracked = original(
        *args, **{**kwargs, "track_seq_idx": seqs, "track_end_locs": ends}
    )
    target.temporal_dst[index.slot.long()] = tracked[0, own:].to(target.temporal_dst.dtype)
    return chunk_states, final_states, (tracked[:, :own] if own else None)


def install_mamba2_capture_hooks() -> None:
    """Register the hooks in this process; effective once SGLang's ``load_plugins`` applies
    hooks. They do nothing for a tree cache that plans no checkpoints."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(MAMBA2_FORWARD_TARGET, capture_around_mamba2_forward, HookType.AROUND)
    for target in MAMBA2_CONV_TARGETS:
        HookRegistry.register(target, capture_around_mamba2_conv, HookType.AROUND)
    HookRegistry.register(MAMBA2_SCAN_TARGET, capture_around_mamba2_scan, HookType.AROUND)

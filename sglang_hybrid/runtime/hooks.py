"""Hooks that make SGLang's prefill capture the planned anchor states, registered by the plugin.

* ``ScheduleBatch.prepare_for_extend`` (scheduler, before each prefill forward): the batch's
  new requests are planned and the forward's capture queries set
  (``anchor_capture.plan_around_prepare``, the step a request served outside a server takes
  too).
* ``GDNAttnBackend.forward_extend`` (every Gated DeltaNet layer of that forward): before the
  layer's convolution overwrites the entering conv states, the conv state at each queried
  position is gathered from the pre-conv inputs (``conv_state_at_positions``); the layer then
  runs as usual, and
* ``GDNKernelDispatcher.extend`` (inside it): once the chunked scan has returned its
  chunk-start states ``h``, the recurrent state at each queried position is that chunk's
  start advanced over the few tokens before the position (``gdn_state_at_positions``),
  written straight into the checkpoint slot of this layer.

One forward thus captures every anchor of every request it computes, whatever their number,
for the cost of one partial-chunk recurrence per anchor. The scheduler and the model runner
share a process (SGLang's TP worker runs in the scheduler process; ``no_buffer`` requires
the overlap scheduler off), which is what lets the forward read what the scheduler planned.
Models whose recurrent layers are not Gated DeltaNet get no in-prefill captures (the plugin
builds their cache without a planning); they keep the request-end checkpoints.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from sglang_hybrid.kernels import conv_state_at_positions, gdn_state_at_positions
from sglang_hybrid.runtime.anchor_capture import layer_captured, plan_around_prepare, queries_for_forward

if TYPE_CHECKING:
    from sglang_hybrid.runtime.anchor_capture import CaptureQueries

PREPARE_FOR_EXTEND_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
GDN_FORWARD_EXTEND_TARGET = (
    "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.forward_extend"
)
GDN_KERNEL_EXTEND_TARGET = (
    "sglang.srt.layers.attention.linear.gdn_backend.GDNKernelDispatcher.extend"
)
# fla's in-kernel q/k normalisation (``use_qk_l2norm_in_kernel=True``) uses this epsilon.
L2NORM_EPS = 1e-6

# The GDN layer being captured, between its forward_extend and the kernel call inside it.
_layer_capture = threading.local()


def plan_captures_around_prepare_for_extend(original, batch, *args, **kwargs):
    result, _ = plan_around_prepare(batch.tree_cache, batch.reqs, lambda: original(batch, *args, **kwargs))
    return result


def capture_around_gdn_forward_extend(
    original, backend, layer=None, forward_batch=None, mixed_qkv=None, a=None, b=None, **kwargs
):
    # SGLang's hybrid backend passes everything by keyword.
    def run_layer():
        return original(
            backend, layer=layer, forward_batch=forward_batch, mixed_qkv=mixed_qkv, a=a, b=b, **kwargs
        )

    queries = _queries_for(backend, forward_batch)
    if queries is None:
        return run_layer()
    pool = backend.req_to_token_pool
    checkpoints = pool.mamba_ckpt_pool
    layer_index = pool.mamba2_layer_index(layer.layer_id)
    live_conv = pool.mamba2_layer_cache(layer.layer_id).conv[0]
    num_seqs = len(queries.prefix_lens)
    metadata = backend.forward_metadata
    live_rows = metadata.mamba_cache_indices[:num_seqs].to(torch.int64)
    # A request without a prefix starts from zeros, whatever its live slot holds.
    entering_rows = torch.where(
        forward_batch.extend_prefix_lens[:num_seqs].to(live_rows.device) > 0,
        live_rows,
        torch.full_like(live_rows, -1),
    )
    conv_state_at_positions(
        mixed_qkv, metadata.query_start_loc, queries.seq, queries.pos,
        checkpoints.conv[0][layer_index], queries.slots,
        initial_states=live_conv, initial_state_indices=entering_rows, validate=False,
    )  # fmt: skip
    _layer_capture.target = (queries, checkpoints.temporal[layer_index])
    try:
        output = run_layer()
    finally:
        _layer_capture.target = None
    layer_captured(checkpoints, layer_index)
    return output


def capture_around_gdn_kernel_extend(original, dispatcher, q, k, v, g, beta, **kwargs):
    result = original(dispatcher, q, k, v, g, beta, **kwargs)
    target = getattr(_layer_capture, "target", None)
    if target is None:
        return result
    queries, temporal_dst = target
    chunk_states = result[2]
    if chunk_states is None:
        raise RuntimeError(
            f"{type(dispatcher.extend_kernel).__name__}.extend returned no chunk states; "
            "in-prefill checkpoints need them (use the Triton GDN prefill kernel)"
        )
    unit_k = F.normalize(k.float(), p=2, dim=-1, eps=L2NORM_EPS)
    gdn_state_at_positions(
        unit_k, v, g, beta, kwargs["query_start_loc"], chunk_states,
        queries.seq, queries.pos, temporal_dst, queries.slots, validate=False,
    )  # fmt: skip
    return result


def _queries_for(backend, forward_batch) -> Optional["CaptureQueries"]:
    if (
        forward_batch.forward_mode.is_target_verify()
        or getattr(backend, "mis_metadata", None) is not None
        or forward_batch.extend_prefix_lens_cpu is None
    ):
        return None
    checkpoints = getattr(backend.req_to_token_pool, "mamba_ckpt_pool", None)
    if checkpoints is None:
        return None
    return queries_for_forward(
        checkpoints, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
    )


def install_anchor_capture_hooks() -> None:
    """Register the hooks in this process; effective once SGLang's ``load_plugins`` applies
    hooks. They do nothing for a tree cache that plans no checkpoints."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        PREPARE_FOR_EXTEND_TARGET, plan_captures_around_prepare_for_extend, HookType.AROUND
    )
    HookRegistry.register(
        GDN_FORWARD_EXTEND_TARGET, capture_around_gdn_forward_extend, HookType.AROUND
    )
    HookRegistry.register(GDN_KERNEL_EXTEND_TARGET, capture_around_gdn_kernel_extend, HookType.AROUND)

"""Hooks that make SGLang's prefill capture the planned anchor states, registered by the plugin.

* ``ScheduleBatch.prepare_for_extend`` (scheduler, before each prefill forward): the batch's
  new requests are planned and the forward's capture queries set
  (``anchor_capture.plan_around_prepare``, the step a request served outside a server takes
  too).
* ``GDNAttnBackend.forward_extend`` (every Gated DeltaNet layer of that forward): before the
  layer's convolution overwrites the entering conv states, the conv state at each queried
  position is gathered from the pre-conv inputs (``conv_capture_states``); the layer then
  runs as usual, and
* ``GDNKernelDispatcher.extend`` (inside it): SGLang's chunked scan is asked to write the
  state at each queried position straight into its checkpoint slot of this layer
  (``snapshot_*``, patches/0002), exactly as a prefill that ended there would leave it.

One forward thus captures every anchor of every request it computes, whatever their number,
for about the cost of writing the checkpoints; the index arithmetic is done once per forward,
on the host (``CaptureIndex``), and no layer waits for the device. The scheduler and the model runner
share a process (SGLang's TP worker runs in the scheduler process; ``no_buffer`` requires
the overlap scheduler off), which is what lets the forward read what the scheduler planned.
Mamba2 layers capture through ``mamba2_hooks.py``; models of other recurrent layer types get
no in-prefill captures (the plugin builds their cache without a planning); they keep the
request-end checkpoints.

Beside them, ``Scheduler.close_session`` (``/close_session``): a session id that names an
agent session (its requests' ``checkpoint_session``) ends it in the cache's planning
(``SemanticStateCache.end_session``); SGLang then closes its own session of that id, or logs
that it has none.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

from sglang_hybrid.cache.semantic_cache import SemanticStateCache
from sglang_hybrid.kernels import conv_capture_states
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
CLOSE_SESSION_TARGET = "sglang.srt.managers.scheduler.Scheduler.close_session"
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
    # The live slots the batch's sequences run in: where a continuing one's state entered.
    live_rows = backend.forward_metadata.mamba_cache_indices
    conv_capture_states(
        mixed_qkv, queries.index, checkpoints.conv[0][layer_index],
        pool.mamba2_layer_cache(layer.layer_id).conv[0], live_rows,
    )  # fmt: skip
    _layer_capture.target = (queries, checkpoints.temporal[layer_index])
    try:
        output = run_layer()
    finally:
        _layer_capture.target = None
    layer_captured(checkpoints, layer_index)
    return output


def capture_around_gdn_kernel_extend(original, dispatcher, q, k, v, g, beta, **kwargs):
    target = getattr(_layer_capture, "target", None)
    if target is None:
        return original(dispatcher, q, k, v, g, beta, **kwargs)
    queries, temporal_dst = target
    if not getattr(dispatcher.extend_kernel, "supports_position_snapshots", False):
        raise RuntimeError(
            f"{type(dispatcher.extend_kernel).__name__} cannot write states at anchor "
            "positions; the semantic backend plans in-prefill checkpoints only with the "
            "Triton GDN prefill kernel and sglang-hybrid's patches installed"
        )
    index = queries.index
    return original(
        dispatcher, q, k, v, g, beta, **kwargs,
        snapshot_states=temporal_dst, snapshot_chunk_ptr=index.snapshot_chunk_ptr,
        snapshot_offsets=index.snapshot_offsets, snapshot_rows=index.snapshot_rows,
        snapshots_per_chunk=index.snapshots_per_chunk,
    )  # fmt: skip


def end_checkpoint_session_around_close_session(original, scheduler, recv_req, *args, **kwargs):
    if isinstance(scheduler.tree_cache, SemanticStateCache):
        scheduler.tree_cache.end_session(recv_req.session_id)
    return original(scheduler, recv_req, *args, **kwargs)


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
    HookRegistry.register(CLOSE_SESSION_TARGET, end_checkpoint_session_around_close_session, HookType.AROUND)

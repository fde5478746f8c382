"""SGLang plugin: registers the ``semantic`` radix cache backend.

SGLang calls ``register`` in every process that may build a tree cache (the scheduler of
each TP rank, the engine), through the ``sglang.srt.plugins`` entry point; a server then
selects the backend with ``--radix-cache-backend semantic``.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    create_unified_radix_cache,
    register_radix_cache_backend,
    registered_radix_cache_backends,
)
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from sglang_hybrid import patches
from sglang_hybrid.planning.anchor_planning import AnchorPlanning
from sglang_hybrid.anchors.detector import NO_ANCHORS, AnchorDetector
from sglang_hybrid.planning.planner import CheckpointPlanner
from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool, StateLayout
from sglang_hybrid.cache.planning import CheckpointPlanning
from sglang_hybrid.cache.semantic_cache import SemanticStateCache
from sglang_hybrid.cache.semantic_component import SemanticMambaComponent
from sglang_hybrid.compatibility import REQUIRED_MAMBA_STRATEGY, REQUIRED_PAGE_SIZE, unsupported_options
from sglang_hybrid.config import AUTO_TEMPLATE_FAMILY, SemanticCacheConfig
from sglang_hybrid.cpu_fallbacks import install_cpu_fallbacks
from sglang_hybrid.metrics import install_request_info_hook, subscribe_metrics
from sglang_hybrid.request_validation import install_request_validation_hook
from sglang_hybrid.runtime.hooks import install_anchor_capture_hooks
from sglang_hybrid.runtime.mamba2_hooks import install_mamba2_capture_hooks
from sglang_hybrid.session_routing import install_session_routing_hook

logger = logging.getLogger(__name__)

BACKEND_NAME = "semantic"
# Models whose prefill captures anchor states: recurrent layers of Gated DeltaNet
# (runtime/hooks.py) or Mamba2 run by SGLang's Mamba2AttnBackend (runtime/mamba2_hooks.py);
# others keep only the checkpoints SGLang's caching takes.
GDN_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})
MAMBA2_MODEL_TYPES = frozenset({"nemotron_h", "granitemoehybrid", "falcon_h1"})
CAPTURING_MODEL_TYPES = GDN_MODEL_TYPES | MAMBA2_MODEL_TYPES


def register() -> None:
    # Before any model is built: the modules patches/ changes load patched from here on.
    patches.install()
    # On a host without CUDA (tests, the CPU reference server) SGLang needs torch-native
    # fallbacks for kernels that do not run there; on a GPU host this does nothing.
    install_cpu_fallbacks()
    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, build_semantic_state_cache)
        install_request_validation_hook()
        install_request_info_hook()
        install_anchor_capture_hooks()
        install_session_routing_hook()
        install_mamba2_capture_hooks()


def build_semantic_state_cache(ctx: TreeCacheBuildContext) -> SemanticStateCache:
    """The backend factory: our flags from ``SGLANG_HYBRID_CONFIG``, the planning they say."""
    config = SemanticCacheConfig.from_env()
    return semantic_state_cache(ctx, config, _checkpoint_planning(ctx, config))


def semantic_state_cache(
    ctx: TreeCacheBuildContext, config: SemanticCacheConfig, planning: Optional[CheckpointPlanning]
) -> SemanticStateCache:
    """The cache for ``ctx``: a checkpoint pool sized by ``config`` installed where SGLang
    looks for a checkpoint store, ``planning`` given to the cache, the metrics subscribed."""
    _check_supported(ctx)
    req_to_token_pool = ctx.params.req_to_token_pool
    mamba_pool = req_to_token_pool.mamba_pool
    layout = StateLayout.of_mamba_pool(mamba_pool)
    num_slots = config.checkpoint_slots(layout.bytes_per_slot)
    checkpoint_pool = StateCheckpointPool(
        layout, num_slots, mamba_pool.device, host_slots=config.state_checkpoint_host_slots
    )
    req_to_token_pool.mamba_ckpt_pool = checkpoint_pool
    logger.info(
        "semantic state cache: %d checkpoint slots of %.1f MiB (%.2f GiB), "
        "separate from the %d live-request state slots; %d host-tier slots",
        num_slots,
        layout.bytes_per_slot / (1 << 20),
        num_slots * layout.bytes_per_slot / (1 << 30),
        mamba_pool.size,
        config.state_checkpoint_host_slots,
    )
    ctx.params.component_registry_override = {
        **(ctx.params.component_registry_override or {}),
        ComponentType.MAMBA: SemanticMambaComponent,
    }
    cache = create_unified_radix_cache(
        ctx, cache_class=functools.partial(SemanticStateCache, planning=planning)
    )
    subscribe_metrics(cache)
    return cache


def _checkpoint_planning(
    ctx: TreeCacheBuildContext, config: SemanticCacheConfig
) -> Optional[AnchorPlanning]:
    """The planning of checkpoints inside prefills; None where the model's forward cannot
    capture them.

    A server's forward captures Gated DeltaNet states (``runtime/hooks.py``) and Mamba2
    states (``runtime/mamba2_hooks.py``), the GDN ones with the Triton prefill kernel. A cache
    built without a model (``harness/``: the replay, the CPU engine, the tests) is driven by a
    caller that writes the staged states itself, whatever the layer type.
    """
    hf_config = getattr(ctx.model_config, "hf_config", None)
    model_type = getattr(hf_config, "model_type", None)
    if ctx.model_config is not None and model_type not in CAPTURING_MODEL_TYPES:
        logger.info(
            "semantic state cache: no in-prefill anchor checkpoints for model type %s "
            "(captured for %s); checkpoints at request ends and prefill chunk ends only",
            model_type,
            ", ".join(sorted(CAPTURING_MODEL_TYPES)),
        )
        return None
    prefill_backend = _gdn_prefill_backend(ctx)
    if model_type in GDN_MODEL_TYPES and prefill_backend is not None and not prefill_backend.is_triton():
        logger.warning(
            "semantic state cache: no in-prefill anchor checkpoints with the %s GDN prefill "
            "kernel (the Triton kernel writes them, patches/0002); checkpoints at request "
            "ends and prefill chunk ends only",
            prefill_backend,
        )
        return None
    if config.anchor_template_family != AUTO_TEMPLATE_FAMILY:
        detector = AnchorDetector.for_family(config.anchor_template_family)
    elif hf_config is not None:
        detector = AnchorDetector.from_model_config(hf_config.to_dict())
    else:
        detector = AnchorDetector.for_family(NO_ANCHORS)
    planner = CheckpointPlanner() if config.checkpoint_planner == "adaptive" else None
    logger.info(
        "semantic state cache: %s checkpoints inside prefill (anchors: %s), %s eviction",
        config.checkpoint_planner,
        detector.family,
        config.checkpoint_eviction,
    )
    return AnchorPlanning(
        detector,
        config.checkpoint_planner,
        planner,
        evict_by_value=config.checkpoint_eviction == "expected-saving",
    )


def _gdn_prefill_backend(ctx: TreeCacheBuildContext):
    """The linear-attention prefill kernel the model runner chose (None outside a server)."""
    model_runner = getattr(ctx.tp_worker, "model_runner", None)
    backends = getattr(model_runner, "linear_attn_backends", None)
    return None if backends is None else backends.prefill


def _check_supported(ctx: TreeCacheBuildContext) -> None:
    if not ctx.is_hybrid_ssm:
        raise ValueError(
            "--radix-cache-backend semantic caches recurrent-state checkpoints and needs a "
            "hybrid model with Mamba/GDN layers; drop the flag for this model"
        )
    # The strategy and page size as the scheduler resolved them.
    if ctx.params.enable_mamba_extra_buffer or ctx.params.page_size != REQUIRED_PAGE_SIZE:
        raise ValueError(
            f"--radix-cache-backend semantic needs --mamba-radix-cache-strategy "
            f"{REQUIRED_MAMBA_STRATEGY} and --page-size {REQUIRED_PAGE_SIZE}: checkpoints sit at "
            "anchor positions, which a page or track grid would round away"
        )
    refusals = unsupported_options(ctx.server_args)
    if refusals:
        raise ValueError(f"--radix-cache-backend semantic cannot serve with {refusals[0]}")

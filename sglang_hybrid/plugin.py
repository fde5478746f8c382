"""SGLang plugin: registers the ``semantic`` radix cache backend.

SGLang calls ``register`` in every process that may build a tree cache (the scheduler of
each TP rank, the engine), through the ``sglang.srt.plugins`` entry point; a server then
selects the backend with ``--radix-cache-backend semantic``.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    create_unified_radix_cache,
    register_radix_cache_backend,
    registered_radix_cache_backends,
)
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.runtime_context import get_exec

from sglang_hybrid.anchors.detector import AnchorDetector
from sglang_hybrid.anchors.planner import CheckpointPlanner
from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool, StateLayout
from sglang_hybrid.cache.semantic_cache import SemanticMambaComponent, SemanticStateCache
from sglang_hybrid.config import AUTO_TEMPLATE_FAMILY, SemanticCacheConfig
from sglang_hybrid.cpu_fallbacks import install_cpu_fallbacks
from sglang_hybrid.request_hints import install_checkpoint_hint_hook
from sglang_hybrid.metrics import install_request_info_hook
from sglang_hybrid.runtime.anchor_capture import AnchorCapture
from sglang_hybrid.runtime.hooks import install_anchor_capture_hooks

logger = logging.getLogger(__name__)

BACKEND_NAME = "semantic"
# Models whose recurrent layers are Gated DeltaNet, the layer type whose prefill captures
# anchor states (runtime/hooks.py); others keep only the checkpoints SGLang's caching takes.
GDN_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})


def register() -> None:
    # On a host without CUDA (tests, the CPU reference server) SGLang needs torch-native
    # fallbacks for kernels that do not run there; on a GPU host this does nothing.
    install_cpu_fallbacks()
    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, build_semantic_state_cache)
        install_checkpoint_hint_hook()
        install_request_info_hook()
        install_anchor_capture_hooks()


def build_semantic_state_cache(ctx: TreeCacheBuildContext) -> SemanticStateCache:
    _check_supported(ctx)
    config = SemanticCacheConfig.from_env()
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
    cache = create_unified_radix_cache(ctx, cache_class=SemanticStateCache)
    checkpoint_pool.anchor_capture = _anchor_capture(ctx, config, cache)
    return cache


def _anchor_capture(
    ctx: TreeCacheBuildContext, config: SemanticCacheConfig, cache: SemanticStateCache
) -> Optional[AnchorCapture]:
    hf_config = getattr(ctx.model_config, "hf_config", None)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in GDN_MODEL_TYPES:
        logger.info(
            "semantic state cache: no in-prefill anchor checkpoints for model type %s "
            "(captured for %s); checkpoints at request ends and prefill chunk ends only",
            model_type,
            ", ".join(sorted(GDN_MODEL_TYPES)),
        )
        return None
    if config.anchor_template_family == AUTO_TEMPLATE_FAMILY:
        detector = AnchorDetector.from_model_config(hf_config.to_dict())
    else:
        detector = AnchorDetector.for_family(config.anchor_template_family)
    planner = CheckpointPlanner() if config.checkpoint_planner == "adaptive" else None
    logger.info(
        "semantic state cache: %s checkpoints inside prefill (anchors: %s), %s eviction",
        config.checkpoint_planner,
        detector.family,
        config.checkpoint_eviction,
    )
    return AnchorCapture(
        cache,
        detector,
        config.checkpoint_planner,
        planner,
        evict_by_value=config.checkpoint_eviction == "expected-saving",
    )


def _check_supported(ctx: TreeCacheBuildContext) -> None:
    if not ctx.is_hybrid_ssm:
        raise ValueError(
            "--radix-cache-backend semantic caches recurrent-state checkpoints and needs a "
            "hybrid model with Mamba/GDN layers; drop the flag for this model"
        )
    if ctx.enable_hierarchical_cache:
        raise ValueError(
            "--radix-cache-backend semantic does not support --enable-hierarchical-cache yet"
        )
    if ctx.params.enable_session_radix_cache:
        raise ValueError(
            "--radix-cache-backend semantic does not support --enable-session-radix-cache"
        )
    if getattr(ctx.params.req_to_token_pool, "mamba_ckpt_pool", None) is not None:
        raise ValueError(
            "--radix-cache-backend semantic keeps its own checkpoint pool; "
            "drop --enable-int8-mamba-checkpoint"
        )
    if ctx.params.enable_mamba_extra_buffer or ctx.params.page_size != 1:
        raise ValueError(
            "--radix-cache-backend semantic needs --mamba-radix-cache-strategy no_buffer and "
            "--page-size 1: checkpoints sit at anchor positions, which a page or track grid "
            "would round away"
        )
    mamba = get_exec().mamba
    if mamba.mamba_max_states_per_path >= 0:
        raise ValueError(
            "--mamba-max-states-per-path prunes checkpoints by depth; the semantic backend "
            "sizes them with --state-checkpoint-slots instead"
        )

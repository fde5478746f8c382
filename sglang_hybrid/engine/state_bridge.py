"""Mapping between a transformers hybrid-model cache and SGLang's state and KV pools.

transformers keeps, per recurrent layer, ``conv_states[0]`` of shape ``(batch, conv_dim, K)``
(the last K conv inputs, newest last) and ``recurrent_states[0]``: for a gated delta-net
(Qwen3-Next) ``(batch, HV, K_head, V_head)``, for Mamba2 (GraniteMoeHybrid, NemotronH)
``(batch, heads, head_dim, state_size)``. Per attention layer it keeps keys and values of
shape ``(batch, kv_heads, seq, head_dim)`` after RoPE. SGLang's MambaPool keeps, per slot,
``conv[0][layer, slot]`` of shape ``(conv_dim, K - 1)`` and ``temporal[layer, slot]`` of
shape ``(heads, head_dim, state_size)``, i.e. ``(HV, V_head, K_head)`` for a gated
delta-net, the transpose of transformers' layout; its KV pool keeps
``(tokens, kv_heads, head_dim)`` per attention layer. Only the newest K - 1 conv inputs influence any later output (the causal
conv of width K sees the current input plus K - 1 past ones), so the oldest column that
transformers keeps is dropped on the way out and zero-filled on the way in without
changing any result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache, PretrainedConfig

from sglang_hybrid.harness.pools import HybridPoolSpec, hybrid_pool_spec


@dataclass(frozen=True)
class HybridStateBridge:
    """For a transformers config whose ``layer_types`` name ``linear_attention`` (recurrent)
    and ``full_attention`` layers: Qwen3-Next, GraniteMoeHybrid and NemotronH (whose MLP/MoE
    blocks hold no state and appear in neither list)."""

    config: PretrainedConfig

    SUPPORTED_MODEL_TYPES = ("qwen3_next", "granitemoehybrid", "nemotron_h")

    def __post_init__(self):
        if self.config.model_type not in self.SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"no state mapping for model type {self.config.model_type!r}; "
                f"supported: {self.SUPPORTED_MODEL_TYPES}"
            )

    @property
    def _recurrent_state_transposed(self) -> bool:
        """Whether SGLang's temporal state is the transpose of transformers' (gated delta-net)."""
        return self.config.model_type == "qwen3_next"

    @property
    def kv_head_dim(self) -> int:
        head_dim = getattr(self.config, "head_dim", None)
        return head_dim or self.config.hidden_size // self.config.num_attention_heads

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.config.layer_types) if kind == "linear_attention"]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.config.layer_types) if kind == "full_attention"]

    def _state_dims(self) -> dict[str, object]:
        """The recurrent state's dimensions as SGLang derives them (as its own model configs do)."""
        c = self.config
        if c.model_type == "qwen3_next":
            key_dim = c.linear_key_head_dim * c.linear_num_key_heads
            value_dim = c.linear_value_head_dim * c.linear_num_value_heads
            return dict(
                intermediate_size=value_dim,
                n_groups=c.linear_num_key_heads,
                num_heads=c.linear_num_value_heads,
                head_dim=c.linear_value_head_dim,
                state_size=c.linear_key_head_dim,
                conv_kernel=c.linear_conv_kernel_dim,
                conv_shard_groups=[key_dim, key_dim, value_dim],
            )
        if c.model_type == "nemotron_h":
            # As SGLang's NemotronHConfig.mamba2_cache_params: the Mamba width is heads x head_dim.
            return dict(
                intermediate_size=c.mamba_num_heads * c.mamba_head_dim,
                n_groups=c.n_groups,
                num_heads=c.mamba_num_heads,
                head_dim=c.mamba_head_dim,
                state_size=c.ssm_state_size,
                conv_kernel=c.conv_kernel,
            )
        return dict(
            intermediate_size=int(c.mamba_expand * c.hidden_size),
            n_groups=c.mamba_n_groups,
            num_heads=c.mamba_n_heads,
            head_dim=c.mamba_d_head,
            state_size=c.mamba_d_state,
            conv_kernel=c.mamba_d_conv,
        )

    def pool_spec(self, *, kv_size: int, max_num_reqs: int, max_context_len: int) -> HybridPoolSpec:
        # fp32 conv and temporal state: a restored state must be bit-equal to the computed one.
        return hybrid_pool_spec(
            recurrent_layers=self.linear_layer_ids,
            attention_layers=self.attention_layer_ids,
            **self._state_dims(),
            kv_head_num=self.config.num_key_value_heads,
            kv_head_dim=self.kv_head_dim,
            kv_size=kv_size,
            max_num_reqs=max_num_reqs,
            max_context_len=max_context_len,
        )

    # ---- pools -> transformers cache ----

    def load_cache(
        self,
        conv: Sequence[torch.Tensor],
        temporal: torch.Tensor,
        state_row: int,
        kv_pool,
        kv_indices: torch.Tensor,
    ) -> DynamicCache:
        """A transformers cache holding the state in ``state_row`` of ``conv``/``temporal``
        (MambaPool or checkpoint pool layout) and the KV at ``kv_indices``."""
        (conv_buffer,) = conv  # one conv buffer per layer: the mixer's concatenated inputs
        cache = DynamicCache(config=self.config)
        for pool_layer, layer_id in enumerate(self.linear_layer_ids):
            layer = cache.layers[layer_id]
            saved_conv = conv_buffer[pool_layer, state_row]
            kernel = saved_conv.shape[-1] + 1
            conv_states = torch.zeros((1, saved_conv.shape[0], kernel), dtype=saved_conv.dtype)
            conv_states[0, :, 1:] = saved_conv
            recurrent = self._to_model_layout(temporal[pool_layer, state_row]).unsqueeze(0)
            layer.lazy_initialization(
                conv_states=conv_states, recurrent_states=recurrent, conv_kernel_size=kernel
            )
            layer.conv_states[0].copy_(conv_states)
            layer.recurrent_states[0].copy_(recurrent)
            layer.has_previous_state[0] = True
        for layer_id in self.attention_layer_ids:
            keys = kv_pool.get_key_buffer(layer_id)[kv_indices]
            values = kv_pool.get_value_buffer(layer_id)[kv_indices]
            cache.layers[layer_id].update(
                keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
            )
        return cache

    def _to_model_layout(self, state: torch.Tensor) -> torch.Tensor:
        """One layer's recurrent state, pool <-> model layout (the mapping is its own inverse)."""
        return state.transpose(-1, -2) if self._recurrent_state_transposed else state

    # ---- transformers cache -> pools ----

    def store_state(
        self, cache: DynamicCache, conv: Sequence[torch.Tensor], temporal: torch.Tensor, state_row: int
    ) -> None:
        """Write the cache's recurrent state into ``state_row`` of ``conv``/``temporal``."""
        (conv_buffer,) = conv
        kept_inputs = conv_buffer.shape[-1]
        for pool_layer, layer_id in enumerate(self.linear_layer_ids):
            layer = cache.layers[layer_id]
            conv_buffer[pool_layer, state_row].copy_(layer.conv_states[0][0, :, -kept_inputs:])
            temporal[pool_layer, state_row].copy_(
                self._to_model_layout(layer.recurrent_states[0][0])
            )

    def store_kv(self, cache: DynamicCache, kv_pool, kv_indices: torch.Tensor, start: int) -> None:
        """Write the cache's KV of positions ``start:`` to ``kv_indices`` (one per position)."""
        for layer_id in self.attention_layer_ids:
            layer = cache.layers[layer_id]
            keys = layer.keys[0, :, start:].transpose(0, 1)
            values = layer.values[0, :, start:].transpose(0, 1)
            if keys.shape[0] != kv_indices.numel():
                raise ValueError(
                    f"layer {layer_id}: {keys.shape[0]} new positions, {kv_indices.numel()} KV slots"
                )
            kv_pool.get_key_buffer(layer_id)[kv_indices] = keys
            kv_pool.get_value_buffer(layer_id)[kv_indices] = values

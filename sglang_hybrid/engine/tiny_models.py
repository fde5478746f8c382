"""Small random-weight hybrid models for the CPU reference engine.

The engine checks that serving through the semantic cache gives the same logits as a plain
full prefill; that needs a real hybrid forward (gated delta-net layers with conv and
recurrent state, attention layers with KV), not trained weights. Weights are drawn from a
fixed seed so every run, and the cached and uncached paths, use the same model. The builders
import transformers and torch themselves, so the registry of names (``TINY_MODELS``, which the
command line lists) loads neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from transformers import (
        GraniteMoeHybridForCausalLM,
        NemotronHForCausalLM,
        PretrainedConfig,
        Qwen3NextForCausalLM,
    )

# Vocabulary of the tiny model. Token ids from real traces (e.g. Qwen's 151936-entry
# vocabulary) are folded into it with ``id % vocab_size`` at the model input only; the
# cache keys on the original ids.
TINY_VOCAB_SIZE = 1024


def tiny_qwen3_next(seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE) -> Qwen3NextForCausalLM:
    """A 4-layer Qwen3-Next (linear, full, linear, full attention), dense MLPs, fp32.

    Key and value head dims differ (16, 8) so a transposed state cannot pass unseen. The MLPs
    are dense (``mlp_only_layers``): with top-k expert routing, the ~1e-7 differences between
    a prefill split at checkpoints and a whole one can pick another expert at a near-tie,
    which would test the router's tie-breaking, not the restored state.
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        mlp_only_layers=list(range(4)),
        max_position_embeddings=1 << 15,
    )
    return _seeded(Qwen3NextForCausalLM, config, seed)


def tiny_granite_moe_hybrid(
    seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE
) -> GraniteMoeHybridForCausalLM:
    """A 4-layer GraniteMoeHybrid (Mamba2, attention, Mamba2, attention) with a small MoE, fp32.

    Mamba head_dim (8) and state size (16) differ so a transposed state cannot pass unseen.
    """
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["mamba", "attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        position_embedding_type="rope",
        max_position_embeddings=1 << 15,
    )
    return _seeded(GraniteMoeHybridForCausalLM, config, seed)


def tiny_nemotron_h(seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE) -> NemotronHForCausalLM:
    """A 6-block NemotronH (Mamba2, MLP, attention, Mamba2, MLP, attention), fp32.

    NemotronH interleaves mixer-only blocks: Mamba2 and attention blocks carry state, MLP
    blocks carry none, so the recurrent and attention layer ids are not contiguous -- the
    bridge must map pool layers to model layers by id. Mamba head_dim (8) and state size (16)
    differ so a transposed state cannot pass unseen; two groups exercise grouped B/C. MLP
    rather than MoE blocks for the reason given for Qwen3-Next (router near-ties).
    """
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        layers_block_type=["linear_attention", "mlp", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
        max_position_embeddings=1 << 15,
    )
    return _seeded(NemotronHForCausalLM, config, seed)


def _seeded(model_class, config: PretrainedConfig, seed: int):
    import torch

    # Eager attention: the reference must not depend on which SDPA backend torch picks.
    config._attn_implementation = "eager"
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return model_class(config).to(torch.float32).eval()
    finally:
        torch.random.set_rng_state(generator_state)


# The tiny models by the name of the architecture each stands in for (``--model``).
TINY_MODELS: dict[str, Callable[..., Any]] = {
    "qwen3-next": tiny_qwen3_next,
    "nemotron-h": tiny_nemotron_h,
    "granite-moe-hybrid": tiny_granite_moe_hybrid,
}
DEFAULT_TINY_MODEL = "qwen3-next"

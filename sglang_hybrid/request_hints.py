"""Checkpoint hints on SGLang's request APIs (native ``/generate`` and OpenAI-compatible).

A request asks for checkpoints in ``sampling_params.custom_params["checkpoint_hints"]``
(OpenAI clients: ``extra_body={"custom_params": {...}}``, which SGLang forwards): explicit
token positions, or a mode (``"messages"``, ``"none"``, ``"auto"``). The hint is validated
where SGLang tokenizes the request, the first point where the prompt length is known
(``anchors.hints.validate_request_hint``); a bad hint raises ``InvalidCheckpointHint``, which
SGLang's HTTP routes answer with status 400 and the message of ``validate_hints``. A valid one
is rewritten in canonical form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_hybrid.anchors.hints import validate_request_hint

if TYPE_CHECKING:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

TOKENIZE_TARGET = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
)


def _validate_hint_at_tokenization(
    original, manager: "TokenizerManager", obj, input_text, input_ids, *args, **kwargs
):
    from sglang.srt.managers.io_struct import GenerateReqInput

    if isinstance(obj, GenerateReqInput) and obj.sampling_params:
        # A request given as embeddings has no token ids; its length is the prompt's all
        # the same, and SGLang passes the embeddings as the next positional argument.
        embeds = args[0] if args else kwargs.get("input_embeds")
        prompt_len = len(input_ids) if input_ids is not None else len(embeds or ())
        obj.sampling_params = validate_request_hint(obj.sampling_params, prompt_len)
    return original(manager, obj, input_text, input_ids, *args, **kwargs)


def install_checkpoint_hint_hook() -> None:
    """Register, in this process, hint validation on SGLang's tokenization of a request;
    effective once SGLang's ``load_plugins`` applies hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TOKENIZE_TARGET, _validate_hint_at_tokenization, HookType.AROUND)

"""Requests checked where SGLang tokenizes them, so that none can fail inside the scheduler.

Every request of SGLang's native ``/generate`` and OpenAI-compatible routes passes
``TokenizerManager._create_tokenized_object`` once its prompt is token ids (after the chat
template), the first point where the prompt length is known and the last before the request
reaches the scheduler, where an exception stops the whole server. Raising a ``ValueError``
there answers the one request with HTTP 400 and the message. Checked:

* the prompt: not empty, and, as token ids, integers within the model's vocabulary (stock
  SGLang lets both reach the forward, where they raise);
* what our code reads of the request: ``custom_params`` (a JSON object), the agent session
  and the checkpoint hint in it (``anchors.hints.validate_request_hint``), the hint rewritten
  in canonical form.

A request asks for checkpoints in ``sampling_params.custom_params["checkpoint_hints"]``
(OpenAI clients: ``extra_body={"custom_params": {...}}``, which SGLang forwards): explicit
token positions, or a mode (``"messages"``, ``"none"``, ``"auto"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from sglang_hybrid.anchors.hints import validate_request_hint

if TYPE_CHECKING:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

TOKENIZE_TARGET = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
)


class InvalidPrompt(ValueError):
    """A prompt no forward can run; a client error (HTTP 400), never a server fault."""


def validate_prompt(input_ids: Optional[Sequence[int]], prompt_len: int, vocab_size: int) -> None:
    """Refuse an empty prompt and token ids that are not integers in ``[0, vocab_size)``."""
    if prompt_len == 0:
        raise InvalidPrompt("the prompt is empty (after the chat template, if any): nothing to prefill")
    if input_ids is None:
        return
    ids = np.asarray(input_ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidPrompt("input_ids must be a flat list of integer token ids")
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.any():
        index = int(np.flatnonzero(outside)[0])
        raise InvalidPrompt(
            f"input_ids[{index}] = {int(ids[index])} is not a token id of this model's "
            f"vocabulary [0, {vocab_size})"
        )


def _validate_at_tokenization(
    original, manager: "TokenizerManager", obj, input_text, input_ids, *args, **kwargs
):
    from sglang.srt.managers.io_struct import GenerateReqInput

    if isinstance(obj, GenerateReqInput):
        # A request given as embeddings has no token ids; its length is the prompt's all
        # the same, and SGLang passes the embeddings as the next positional argument.
        embeds = args[0] if args else kwargs.get("input_embeds")
        prompt_len = len(input_ids) if input_ids is not None else len(embeds or ())
        validate_prompt(input_ids, prompt_len, manager.model_config.vocab_size)
        if obj.sampling_params:
            obj.sampling_params = validate_request_hint(obj.sampling_params, prompt_len)
    return original(manager, obj, input_text, input_ids, *args, **kwargs)


def install_request_validation_hook() -> None:
    """Register, in this process, the request checks on SGLang's tokenization of a request;
    effective once SGLang's ``load_plugins`` applies hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TOKENIZE_TARGET, _validate_at_tokenization, HookType.AROUND)

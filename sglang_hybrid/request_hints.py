"""Checkpoint hints on SGLang's request APIs (native ``/generate`` and OpenAI-compatible).

A request asks for checkpoints in ``sampling_params.custom_params["checkpoint_hints"]``
(OpenAI clients: ``extra_body={"custom_params": {...}}``, which SGLang forwards): explicit
token positions, or a mode (``"messages"``, ``"none"``, ``"auto"``). The hint is validated
where SGLang tokenizes the request, the first point where the prompt length is known; a bad
hint raises ``InvalidCheckpointHint``, which SGLang's HTTP routes answer with status 400 and
the message of ``validate_hints``. A valid one is rewritten in canonical form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from sglang_hybrid.anchors.hints import HintMode, InvalidCheckpointHint, validate_hints

if TYPE_CHECKING:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

# The keys in a request's sampling_params.custom_params (OpenAI: extra_body.custom_params).
CHECKPOINT_HINT_PARAM = "checkpoint_hints"
# The agent session a request belongs to: the planner learns where each session's edits
# land. Without it a request joins the session whose checkpoint it restored.
SESSION_PARAM = "checkpoint_session"
MAX_SESSION_ID_CHARS = 256
# Explicit positions one request may ask for; more could not be held by a pool of the
# default size anyway, and the bound keeps validation and planning cheap.
MAX_HINT_POSITIONS = 64
TOKENIZE_TARGET = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
)


def validate_request_hint(sampling_params: Optional[dict], prompt_len: int) -> Optional[dict]:
    """``sampling_params`` with its checkpoint hint checked against the prompt and put in
    canonical form (a mode name, or a list of ints); unchanged when it carries none.

    Raises ``InvalidCheckpointHint`` (a ``ValueError``, which SGLang's HTTP routes answer
    with status 400 and the message).
    """
    custom_params = (sampling_params or {}).get("custom_params")
    if not isinstance(custom_params, dict):
        return sampling_params
    session = custom_params.get(SESSION_PARAM)
    if session is not None and (
        not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_ID_CHARS
    ):
        raise InvalidCheckpointHint(
            f"{SESSION_PARAM} must be a string of 1 to {MAX_SESSION_ID_CHARS} characters, "
            f"got {session!r:.80}"
        )
    if CHECKPOINT_HINT_PARAM not in custom_params:
        return sampling_params
    hint = validate_hints(custom_params[CHECKPOINT_HINT_PARAM], prompt_len, MAX_HINT_POSITIONS)
    canonical = hint.positions.tolist() if hint.mode is HintMode.EXPLICIT else hint.mode.value
    return {**sampling_params, "custom_params": {**custom_params, CHECKPOINT_HINT_PARAM: canonical}}


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

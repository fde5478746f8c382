"""Client checkpoint hints on SGLang's request APIs: transport, validation, HTTP 400."""

from __future__ import annotations

import inspect
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
from sglang.srt.entrypoints.http_server import _create_error_response
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_hybrid.anchors.hints import (
    CHECKPOINT_HINT_PARAM,
    MAX_HINT_POSITIONS,
    MAX_SESSION_ID_CHARS,
    SESSION_PARAM,
    InvalidCheckpointHint,
    validate_request_hint,
)
from sglang_hybrid.request_validation import (
    InvalidPrompt,
    _validate_at_tokenization,
    install_request_validation_hook,
    validate_prompt,
)

PROMPT_IDS = list(range(1000, 1100))
VOCAB_SIZE = 2048


def with_hint(hint, **other) -> dict:
    return {"temperature": 0.0, "custom_params": {CHECKPOINT_HINT_PARAM: hint, **other}}


@pytest.mark.parametrize(
    "hint, canonical",
    [
        ([10, 50, 100], [10, 50, 100]),
        ("messages", "messages"),
        ("none", "none"),
        ("auto", "auto"),
        (None, "auto"),
    ],
)
def test_valid_hints_are_kept_in_canonical_form(hint, canonical):
    params = validate_request_hint(with_hint(hint, thinking_budget=64), len(PROMPT_IDS))
    assert params == with_hint(canonical, thinking_budget=64)


@pytest.mark.parametrize("params", [None, {}, {"temperature": 0.5}, {"custom_params": {"thinking_budget": 8}}])
def test_requests_without_a_hint_pass_untouched(params):
    assert validate_request_hint(params, len(PROMPT_IDS)) is params


@pytest.mark.parametrize(
    "hint, message",
    [
        ([0, 10], "out of range [1, 100]"),
        ([101], "position 101 at index 0 is out of range"),
        ([30, 20], "not sorted"),
        ([20, 20], "duplicated"),
        ([10.0], "must be an integer, got float"),
        ([True], "must be an integer, got bool"),
        ("everything", "unknown checkpoint hint mode 'everything'"),
        ({"at": 3}, "must be a mode name or a list of token positions, got dict"),
        (list(range(1, MAX_HINT_POSITIONS + 2)), "too many checkpoint positions"),
    ],
)
def test_invalid_hints_are_client_errors(hint, message):
    with pytest.raises(InvalidCheckpointHint, match=message.replace("[", r"\[")):
        validate_request_hint(with_hint(hint), len(PROMPT_IDS))


def test_a_session_id_passes_alone_or_beside_a_hint():
    alone = {"custom_params": {SESSION_PARAM: "agent-7"}}
    assert validate_request_hint(alone, len(PROMPT_IDS)) is alone
    both = with_hint([10], **{SESSION_PARAM: "agent-7"})
    assert validate_request_hint(both, len(PROMPT_IDS)) == both


@pytest.mark.parametrize("session", ["", 7, ["a"], "x" * (MAX_SESSION_ID_CHARS + 1)])
def test_invalid_session_ids_are_client_errors(session):
    with pytest.raises(InvalidCheckpointHint, match=f"{SESSION_PARAM} must be a string"):
        validate_request_hint({"custom_params": {SESSION_PARAM: session}}, len(PROMPT_IDS))


def test_sglang_answers_an_invalid_hint_with_400_and_the_message():
    error = None
    try:
        validate_request_hint(with_hint([5, 500]), len(PROMPT_IDS))
    except ValueError as raised:  # the exception type SGLang's routes turn into a 400
        error = raised
    response = _create_error_response(error)
    assert response.status_code == 400
    assert b"checkpoint position 500 at index 1 is out of range" in response.body


def test_openai_extra_body_reaches_the_sampling_params():
    # The OpenAI client sends extra_body fields as top-level request fields.
    request = ChatCompletionRequest(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        custom_params={CHECKPOINT_HINT_PARAM: "messages"},
    )
    params = request.to_sampling_params(stop=[], model_generation_config={})
    assert params["custom_params"] == {CHECKPOINT_HINT_PARAM: "messages"}


def test_valid_hint_goes_on_to_sglangs_tokenization_in_canonical_form():
    received = []

    def sglang_tokenization(manager, obj, input_text, input_ids, *args):
        received.append((obj.sampling_params, input_ids, args))
        return "tokenized"

    request = GenerateReqInput(input_ids=PROMPT_IDS, sampling_params=with_hint(np.array([3, 7])))
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB_SIZE))
    result = _validate_at_tokenization(
        sglang_tokenization, manager, request, None, PROMPT_IDS, None, None, None
    )
    assert result == "tokenized"
    [(params, input_ids, rest)] = received
    assert params == with_hint([3, 7])
    assert type(params["custom_params"][CHECKPOINT_HINT_PARAM][0]) is int  # JSON/msgpack-safe
    assert input_ids is PROMPT_IDS and rest == (None, None, None)


@pytest.fixture
def hooked_tokenizer_manager(monkeypatch):
    """TokenizerManager with the hint hook applied through SGLang's HookRegistry, undone
    after the test."""
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(
        TokenizerManager, "_create_tokenized_object", TokenizerManager._create_tokenized_object
    )
    install_request_validation_hook()
    HookRegistry.apply_hooks()
    return TokenizerManager


def _manager_failing_in_the_hook(manager_class):
    """A manager with only what the hook reads: the request must fail before SGLang's code."""
    manager = object.__new__(manager_class)
    manager.model_config = SimpleNamespace(vocab_size=VOCAB_SIZE)
    return manager


def test_hook_target_has_the_arguments_the_hook_reads():
    names = list(inspect.signature(TokenizerManager._create_tokenized_object).parameters)
    assert names[:5] == ["self", "obj", "input_text", "input_ids", "input_embeds"]


def test_hooked_tokenization_refuses_an_invalid_hint(hooked_tokenizer_manager):
    manager = _manager_failing_in_the_hook(hooked_tokenizer_manager)
    request = GenerateReqInput(input_ids=PROMPT_IDS, sampling_params=with_hint([50, 40]))
    with pytest.raises(InvalidCheckpointHint, match="not sorted"):
        manager._create_tokenized_object(request, None, PROMPT_IDS)


def test_hooked_tokenization_measures_embedding_prompts(hooked_tokenizer_manager):
    manager = _manager_failing_in_the_hook(hooked_tokenizer_manager)
    embeds = [[0.0] * 4] * 8
    request = GenerateReqInput(input_embeds=embeds, sampling_params=with_hint([9]))
    with pytest.raises(InvalidCheckpointHint, match=r"out of range \[1, 8\]"):
        manager._create_tokenized_object(request, None, None, embeds)


@pytest.mark.parametrize("custom_params", ["x", [1], 3, True])
def test_custom_params_that_is_not_an_object_is_a_client_error(custom_params):
    with pytest.raises(InvalidCheckpointHint, match="custom_params must be a JSON object"):
        validate_request_hint({"custom_params": custom_params}, len(PROMPT_IDS))


@pytest.mark.parametrize(
    "input_ids, prompt_len, message",
    [
        ([], 0, "the prompt is empty"),
        (None, 0, "the prompt is empty"),
        ([5, VOCAB_SIZE], 2, rf"input_ids\[1\] = {VOCAB_SIZE} is not a token id"),
        ([5, -1, 7], 3, r"input_ids\[1\] = -1 is not a token id"),
        ([5, 2.0], 2, "flat list of integer token ids"),
        ([True, False], 2, "flat list of integer token ids"),
        ([[1, 2]], 1, "flat list of integer token ids"),
    ],
)
def test_prompts_no_forward_can_run_are_client_errors(input_ids, prompt_len, message):
    with pytest.raises(InvalidPrompt, match=message):
        validate_prompt(input_ids, prompt_len, VOCAB_SIZE)
    assert issubclass(InvalidPrompt, ValueError)  # what SGLang's routes answer with 400


def test_prompts_within_the_vocabulary_pass():
    validate_prompt(PROMPT_IDS, len(PROMPT_IDS), VOCAB_SIZE)
    validate_prompt([0, VOCAB_SIZE - 1], 2, VOCAB_SIZE)
    validate_prompt(None, 8, VOCAB_SIZE)  # embeddings: nothing to look up


@pytest.mark.parametrize(
    "input_ids, sampling_params",
    [([], {}), ([1, VOCAB_SIZE + 5], {}), (PROMPT_IDS, {"custom_params": "x"})],
)
def test_hooked_tokenization_refuses_what_would_fail_in_the_scheduler(
    hooked_tokenizer_manager, input_ids, sampling_params
):
    manager = _manager_failing_in_the_hook(hooked_tokenizer_manager)
    request = GenerateReqInput(input_ids=input_ids, sampling_params=sampling_params)
    with pytest.raises(ValueError):
        manager._create_tokenized_object(request, None, input_ids)

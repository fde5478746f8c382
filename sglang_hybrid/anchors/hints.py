"""Client checkpoint hints: where a client asks the server to keep recurrent-state checkpoints.

A hint is either a list of token positions (position ``p`` = the state after the first ``p``
prompt tokens) or a named mode. It travels in a request's
``sampling_params.custom_params["checkpoint_hints"]`` (OpenAI clients:
``extra_body={"custom_params": {...}}``), beside the agent session the request belongs to.
Hints arrive from untrusted requests, so validation is strict and its errors are meant to be
returned to the client as HTTP 400 with the message as is. The server validates where it
tokenizes a request (``request_validation.py``); a request served outside a server
(``harness/lifecycle.py``) passes the same validation.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Optional

import numpy as np

# The keys in a request's sampling_params.custom_params (OpenAI: extra_body.custom_params).
CHECKPOINT_HINT_PARAM = "checkpoint_hints"
# The agent session a request belongs to: the planner learns where each session's edits
# land. Without it a request joins the session whose checkpoint it restored.
SESSION_PARAM = "checkpoint_session"
MAX_SESSION_ID_CHARS = 256
# Explicit positions one request may ask for; more could not be held by a pool of the
# default size anyway, and the bound keeps validation and planning cheap.
MAX_HINT_POSITIONS = 64


class HintMode(str, Enum):
    AUTO = "auto"  # the server's detector and planner decide
    MESSAGES = "messages"  # a checkpoint at every detected message start, as budget allows
    NONE = "none"  # this request asks for no checkpoints
    EXPLICIT = "explicit"  # exactly the positions the client listed


NAMED_MODES: tuple[str, ...] = (HintMode.AUTO.value, HintMode.MESSAGES.value, HintMode.NONE.value)


class InvalidCheckpointHint(ValueError):
    """A malformed client hint; a client error (HTTP 400), never a server fault."""


@dataclass(frozen=True, eq=False)
class ValidatedHint:
    mode: HintMode
    positions: np.ndarray  # int64, strictly increasing, in [1, prompt_len]; empty unless EXPLICIT


def validate_hints(hint: Any, prompt_len: int, max_count: int = MAX_HINT_POSITIONS) -> ValidatedHint:
    """Check a client hint against the request's prompt length and the per-request limit.

    ``None`` means no hint (``auto``). Positions must be integers (bools and floats are
    rejected, even integral floats, so a client bug is reported rather than rounded), strictly
    increasing, within ``[1, prompt_len]`` (0 is the empty prefix, which needs no checkpoint),
    and at most ``max_count`` of them.
    """
    if hint is None:
        return ValidatedHint(HintMode.AUTO, np.empty(0, dtype=np.int64))
    if isinstance(hint, str):
        if hint not in NAMED_MODES:
            raise InvalidCheckpointHint(
                f"unknown checkpoint hint mode {hint!r}; expected one of {', '.join(NAMED_MODES)} "
                "or a list of token positions"
            )
        return ValidatedHint(HintMode(hint), np.empty(0, dtype=np.int64))
    if isinstance(hint, (bytes, dict)) or not hasattr(hint, "__len__") or not hasattr(hint, "__iter__"):
        raise InvalidCheckpointHint(
            f"checkpoint hint must be a mode name or a list of token positions, got {type(hint).__name__}"
        )
    if len(hint) > max_count:
        raise InvalidCheckpointHint(f"too many checkpoint positions: {len(hint)} given, at most {max_count} allowed")

    positions = np.empty(len(hint), dtype=np.int64)
    for index, value in enumerate(hint):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise InvalidCheckpointHint(
                f"checkpoint position at index {index} must be an integer, got {type(value).__name__} {value!r}"
            )
        if not 1 <= value <= prompt_len:
            raise InvalidCheckpointHint(
                f"checkpoint position {value} at index {index} is out of range [1, {prompt_len}] "
                f"for a prompt of {prompt_len} tokens"
            )
        positions[index] = value

    steps = np.diff(positions)
    if steps.size and (steps <= 0).any():
        index = int(np.flatnonzero(steps <= 0)[0]) + 1
        problem = "duplicated" if steps[index - 1] == 0 else "not sorted"
        raise InvalidCheckpointHint(
            f"checkpoint positions must be strictly increasing: position {int(positions[index])} at index "
            f"{index} is {problem} (previous is {int(positions[index - 1])})"
        )
    return ValidatedHint(HintMode.EXPLICIT, positions)


# sglang-router's header for ``--policy manual``: requests with the same key go to the same
# worker, so a session's turns reach the worker holding its checkpoints.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def session_routing_headers(session: Optional[str]) -> dict[str, str]:
    """The HTTP headers a client sends so that a router keeps ``session`` on one worker."""
    return {} if session is None else {ROUTING_KEY_HEADER: session}


def checkpoint_params(hint: Any = None, session: Optional[str] = None) -> dict[str, Any]:
    """The ``custom_params`` a client sends to ask for ``hint`` (None: none) in ``session``."""
    params: dict[str, Any] = {}
    if session is not None:
        params[SESSION_PARAM] = session
    if hint is not None:
        params[CHECKPOINT_HINT_PARAM] = hint
    return params


def validate_request_hint(sampling_params: Optional[dict], prompt_len: int) -> Optional[dict]:
    """``sampling_params`` with its checkpoint hint checked against the prompt and put in
    canonical form (a mode name, or a list of ints); unchanged when it carries none.

    Raises ``InvalidCheckpointHint`` (a ``ValueError``, which SGLang's HTTP routes answer
    with status 400 and the message).
    """
    custom_params = (sampling_params or {}).get("custom_params")
    if custom_params is None:
        return sampling_params
    if not isinstance(custom_params, dict):
        raise InvalidCheckpointHint(
            f"custom_params must be a JSON object, got {type(custom_params).__name__} {custom_params!r:.80}"
        )
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
    hint = validate_hints(custom_params[CHECKPOINT_HINT_PARAM], prompt_len)
    canonical = hint.positions.tolist() if hint.mode is HintMode.EXPLICIT else hint.mode.value
    return {**sampling_params, "custom_params": {**custom_params, CHECKPOINT_HINT_PARAM: canonical}}


@dataclass(frozen=True)
class RequestHints:
    """What a validated request asks of the checkpoint planning."""

    hint: Optional[ValidatedHint]
    session: Optional[str]

    @classmethod
    def of(cls, custom_params: Optional[Mapping[str, Any]], prompt_len: int) -> "RequestHints":
        """Read from the ``custom_params`` of a request ``validate_request_hint`` accepted."""
        custom_params = custom_params or {}
        raw = custom_params.get(CHECKPOINT_HINT_PARAM)
        hint = validate_hints(raw, prompt_len) if raw is not None else None
        return cls(hint, custom_params.get(SESSION_PARAM))

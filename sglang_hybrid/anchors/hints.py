"""Client checkpoint hints: where a client asks the server to keep recurrent-state checkpoints.

A hint is either a list of token positions (position ``p`` = the state after the first ``p``
prompt tokens) or a named mode. Hints arrive from untrusted requests, so validation is strict
and its errors are meant to be returned to the client as HTTP 400 with the message as is.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np


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


def validate_hints(hint: Any, prompt_len: int, max_count: int) -> ValidatedHint:
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

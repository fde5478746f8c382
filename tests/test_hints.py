import numpy as np
import pytest

from sglang_hybrid.anchors.hints import HintMode, InvalidCheckpointHint, validate_hints


def test_explicit_positions_are_kept_in_order():
    hint = validate_hints([1, 5, np.int32(9), 100], prompt_len=100, max_count=8)
    assert hint.mode is HintMode.EXPLICIT
    assert hint.positions.dtype == np.int64 and hint.positions.tolist() == [1, 5, 9, 100]


def test_numpy_array_hint():
    assert validate_hints(np.array([3, 4]), prompt_len=10, max_count=2).positions.tolist() == [3, 4]


@pytest.mark.parametrize("mode", ["auto", "messages", "none"])
def test_named_modes(mode):
    hint = validate_hints(mode, prompt_len=10, max_count=4)
    assert hint.mode.value == mode and hint.positions.size == 0


def test_missing_hint_means_auto():
    assert validate_hints(None, prompt_len=10, max_count=4).mode is HintMode.AUTO


def test_empty_list_is_explicit_and_empty():
    hint = validate_hints([], prompt_len=10, max_count=4)
    assert hint.mode is HintMode.EXPLICIT and hint.positions.size == 0


@pytest.mark.parametrize(
    "hint, message",
    [
        ([5, 3], "position 3 at index 1 is not sorted (previous is 5)"),
        ([2, 4, 4], "position 4 at index 2 is duplicated (previous is 4)"),
        ([0, 3], "position 0 at index 0 is out of range [1, 10]"),
        ([3, 11], "position 11 at index 1 is out of range [1, 10]"),
        ([-1], "position -1 at index 0 is out of range"),
        ([1, 2.0], "index 1 must be an integer, got float 2.0"),
        (["3"], "index 0 must be an integer, got str '3'"),
        ([True], "index 0 must be an integer, got bool True"),
        ([None], "index 0 must be an integer, got NoneType None"),
        ([1, 2, 3, 4, 5], "too many checkpoint positions: 5 given, at most 4 allowed"),
        ("everything", "unknown checkpoint hint mode 'everything'"),
        ("", "unknown checkpoint hint mode ''"),
        (7, "must be a mode name or a list of token positions, got int"),
        ({"positions": [1]}, "got dict"),
    ],
)
def test_invalid_hints_say_exactly_what_is_wrong(hint, message):
    with pytest.raises(InvalidCheckpointHint) as error:
        validate_hints(hint, prompt_len=10, max_count=4)
    assert message in str(error.value)
    assert isinstance(error.value, ValueError)

"""prefix_digests: every prefix and message digest of a prompt from one compiled pass, equal to
the polynomial they are defined as."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hybrid.planning.following import MULTIPLIER, prefix_digests

MODULUS = 1 << 64


def polynomial(tokens) -> int:
    return sum((int(token) + 1) * pow(MULTIPLIER, i, MODULUS) for i, token in enumerate(tokens)) % MODULUS


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_digests_are_the_polynomial_of_each_prefix_and_message(dtype):
    rng = np.random.default_rng(7)
    messages = [rng.integers(0, 151_000, n).astype(dtype) for n in (40, 1, 25, 60)]
    prompt = np.concatenate(messages)
    ends = np.cumsum([len(m) for m in messages]).tolist()
    digests, by_end = prefix_digests(prompt, ends)
    assert digests == [polynomial(prompt[:end]) for end in ends]
    # Each message's digest is its content's alone; the prompt's end has none.
    assert by_end == {end: polynomial(m) for end, m in zip(ends[:-1], messages[:-1])}


def test_a_message_has_one_digest_wherever_it_sits_and_a_trailing_token_zero_counts():
    rng = np.random.default_rng(8)
    a, b, c = (rng.integers(0, 151_000, n).astype(np.int32) for n in (50, 30, 40))
    _, first = prefix_digests(np.concatenate([a, b, c]), [50, 80, 120])
    _, moved = prefix_digests(np.concatenate([c, b, a]), [40, 70, 120])
    assert first[80] == moved[70]
    (short,), _ = prefix_digests(a, [50])
    (longer,), _ = prefix_digests(np.concatenate([a, [0]]).astype(np.int32), [51])
    assert short != longer


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8), wide=st.booleans(), seed=st.integers(0, 2**16))
def test_digests_of_messages_of_any_length(lengths, wide, seed):
    """Messages shorter and longer than the compiled loop's lanes, starting anywhere in them."""
    rng = np.random.default_rng(seed)
    messages = [rng.integers(0, 151_000, n).astype(np.int64 if wide else np.int32) for n in lengths]
    prompt = np.concatenate(messages)
    ends = np.cumsum(lengths).tolist()
    digests, by_end = prefix_digests(prompt, ends)
    assert digests == [polynomial(prompt[:end]) for end in ends]
    assert by_end == {end: polynomial(m) for end, m in zip(ends[:-1], messages[:-1])}

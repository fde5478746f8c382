"""prefix_digests: every prefix and message digest of a prompt from one compiled pass, equal to
the polynomial they are defined as, and the same when they start from another prompt's.
PrefixProducers: each prefix's first sender, the least recently sent forgotten first."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hybrid.planning.following import MULTIPLIER, PrefixProducers, prefix_digests
from sglang_hybrid.planning.state import Follow

MODULUS = 1 << 64


def polynomial(tokens) -> int:
    return sum((int(token) + 1) * pow(MULTIPLIER, i, MODULUS) for i, token in enumerate(tokens)) % MODULUS


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_digests_are_the_polynomial_of_each_prefix_and_message(dtype):
    rng = np.random.default_rng(7)
    messages = [rng.integers(0, 151_000, n).astype(dtype) for n in (40, 1, 25, 60)]
    prompt = np.concatenate(messages)
    ends = np.cumsum([len(m) for m in messages]).tolist()
    digests = prefix_digests(prompt, ends)
    assert digests.sums.tolist() == [polynomial(prompt[:end]) for end in ends]
    by_end = digests.message_ends()
    # Each message's digest is its content's alone; the prompt's end has none.
    assert by_end == {end: polynomial(m) for end, m in zip(ends[:-1], messages[:-1])}


def test_a_message_has_one_digest_wherever_it_sits_and_a_trailing_token_zero_counts():
    rng = np.random.default_rng(8)
    a, b, c = (rng.integers(0, 151_000, n).astype(np.int32) for n in (50, 30, 40))
    first = prefix_digests(np.concatenate([a, b, c]), [50, 80, 120]).message_ends()
    moved = prefix_digests(np.concatenate([c, b, a]), [40, 70, 120]).message_ends()
    assert first[80] == moved[70]
    (short,) = prefix_digests(a, [50]).sums.tolist()
    (longer,) = prefix_digests(np.concatenate([a, [0]]).astype(np.int32), [51]).sums.tolist()
    assert short != longer


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=8), wide=st.booleans(), seed=st.integers(0, 2**16))
def test_digests_of_messages_of_any_length(lengths, wide, seed):
    """Messages shorter than the compiled loop's rows of lanes (32 tokens), of several rows,
    and of rows and a remainder."""
    rng = np.random.default_rng(seed)
    messages = [rng.integers(0, 151_000, n).astype(np.int64 if wide else np.int32) for n in lengths]
    prompt = np.concatenate(messages)
    ends = np.cumsum(lengths).tolist()
    digests = prefix_digests(prompt, ends)
    assert digests.sums.tolist() == [polynomial(prompt[:end]) for end in ends]
    assert digests.message_ends() == {end: polynomial(m) for end, m in zip(ends[:-1], messages[:-1])}


@settings(max_examples=300, deadline=None)
@given(previous=st.lists(st.integers(1, 30), min_size=1, max_size=8), kept=st.integers(0, 250),
       appended=st.lists(st.integers(1, 30), max_size=4), moved=st.integers(-3, 3), seed=st.integers(0, 2**16),
       with_tokens=st.booleans())
def test_digests_started_from_a_previous_prompt_are_those_of_the_prompt_alone(previous, kept, appended, moved, seed,
                                                                              with_tokens):
    """The next prompt keeps the previous one up to any token (an edit anywhere, or the whole
    of it) and appends messages; its boundaries may move near the kept end. Starting from the
    previous prompt's digests (and tokens) changes no digest, whatever the common length told."""
    rng = np.random.default_rng(seed)
    before = rng.integers(0, 151_000, sum(previous))
    known = prefix_digests(before, np.cumsum(previous).tolist())
    kept = min(kept, before.shape[0])
    edited = rng.integers(0, 151_000, rng.integers(0, 20))
    prompt = np.concatenate([before[:kept], edited, rng.integers(0, 151_000, sum(appended))]).astype(np.int64)
    if prompt.shape[0] == 0:
        return
    # Its boundaries: the previous ones it kept (the last of them moved by ``moved``), then new ones.
    ends = [end for end in np.cumsum(previous).tolist() if end <= kept]
    if ends:
        ends[-1] = max(ends[-1] + moved, (ends[-2] if len(ends) > 1 else 0) + 1)
    ends = sorted({end for end in [*ends, *rng.integers(1, prompt.shape[0] + 1, 3).tolist(), prompt.shape[0]]
                   if 0 < end <= prompt.shape[0]})
    common = int(np.argmin(np.append(before[:prompt.shape[0]] == prompt[:before.shape[0]], False)))
    alone = prefix_digests(prompt, ends)
    started = prefix_digests(prompt, ends, known, common, before if with_tokens else None)
    assert started.sums.tolist() == alone.sums.tolist() == [polynomial(prompt[:end]) for end in ends]
    assert started.messages.tolist() == alone.messages.tolist()
    assert started.boundaries.tolist() == ends and started.length == alone.length


@settings(max_examples=300, deadline=None)
@given(previous=st.lists(st.integers(1, 80), min_size=1, max_size=8), edited=st.integers(0, 7),
       edited_length=st.integers(1, 80), same_length=st.booleans(), appended=st.lists(st.integers(1, 30), max_size=3),
       wide=st.booleans(), seed=st.integers(0, 2**16))
def test_messages_moved_by_an_earlier_edit_keep_their_digests(previous, edited, edited_length, same_length, appended,
                                                              wide, seed):
    """One message of the previous prompt is rewritten (to another length, or to the same
    length with other tokens) and messages are appended: the messages after it, moved, are
    compared with their counterparts in the previous request's sequence (its prompt and
    output) instead of hashed, and every digest is still that of the prompt alone."""
    rng = np.random.default_rng(seed)
    dtype = np.int64 if wide else np.int32
    messages = [rng.integers(0, 151_000, n).astype(dtype) for n in previous]
    before = np.concatenate(messages)
    known = prefix_digests(before, np.cumsum(previous).tolist())
    edited %= len(messages)
    rewritten = list(messages)
    rewritten[edited] = rng.integers(0, 151_000, previous[edited] if same_length else edited_length).astype(dtype)
    rewritten += [rng.integers(0, 151_000, n).astype(dtype) for n in appended]
    prompt = np.concatenate(rewritten)
    ends = np.cumsum([len(m) for m in rewritten]).tolist()
    common = int(np.argmin(np.append(before[:prompt.shape[0]] == prompt[:before.shape[0]], False)))
    sequence = np.concatenate([before, rng.integers(0, 151_000, 5)]).astype(np.int64)
    started = prefix_digests(prompt, ends, known, common, sequence)
    assert started.sums.tolist() == [polynomial(prompt[:end]) for end in ends]
    assert started.messages.tolist() == [polynomial(m) for m in rewritten]


def test_prefix_producers_keep_each_first_sender_and_forget_the_least_recently_sent():
    producers = PrefixProducers(capacity=3)
    producers.remember([1, 2], "a", clock=1)
    producers.remember([1, 3], "b", clock=2)  # 1 stays a's, sent again: now more recent than 2
    producers.remember([4], "c", clock=3)  # one over the capacity: 2 is forgotten
    assert producers.leader("d", [10], [1, 3], {10: 7}) == Follow("b", 2, True, 7)
    assert producers.leader("d", [10], [1, 4], {10: 7}) == Follow("c", 3, True, 7)
    assert producers.leader("d", [10], [1, 2], {10: 7}) is None
    assert producers.leader("d", [10, 20], [4, 1, 9], {10: 7, 20: 8}) == Follow("a", 1, False, 8)
    assert producers.leader("a", [10], [3, 1], {10: 7}) is None  # its own prompt

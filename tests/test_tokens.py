"""common_prefix_length, equal_spans and positions_at_least: compiled, reading blocks of tokens
at once; the same as comparing token by token."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hybrid.anchors.special_tokens import QWEN3_SPECIAL_IDS
from sglang_hybrid.tokens import common_prefix_length, equal_spans, positions_at_least


@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 300), kept=st.integers(0, 300), extra=st.integers(0, 70),
       dtypes=st.sampled_from([(np.int32, np.int32), (np.int64, np.int64), (np.int32, np.int64)]),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_common_prefix_length_is_where_the_first_token_differs(length, kept, extra, dtypes, strided, seed):
    """Differences inside a block of comparisons, at its edges, past the shorter array's end;
    mixed dtypes and strided views."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 4, length)
    b = np.concatenate([a[:kept], 4 + rng.integers(0, 4, min(extra, 1)), rng.integers(0, 4, extra)])
    a, b = a.astype(dtypes[0]), b.astype(dtypes[1])
    if strided:
        a, b = np.repeat(a, 2)[::2], np.repeat(b, 2)[::2]
    shorter = min(a.shape[0], b.shape[0])
    expected = next((i for i in range(shorter) if a[i] != b[i]), shorter)
    assert common_prefix_length(a, b) == common_prefix_length(b, a) == expected


@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 400), specials=st.lists(st.integers(0, 399), max_size=20),
       dtype=st.sampled_from([np.int32, np.int64]), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_special_tokens_are_found_wherever_they_sit(length, specials, dtype, strided, seed):
    """The compiled scan reads blocks of tokens at once: special tokens at a block's edges, in
    the last partial block, several in one block, none at all; either dtype, any stride."""
    rng = np.random.default_rng(seed)
    lo = QWEN3_SPECIAL_IDS["<|im_start|>"]
    ids = rng.integers(0, lo, length)
    at = [s for s in specials if s < length]
    ids[at] = rng.integers(lo, lo + 20, len(at))
    ids = ids.astype(dtype)
    if strided:
        ids = np.repeat(ids, 2)[::2]
    assert positions_at_least(ids, lo).tolist() == np.flatnonzero(ids >= lo).tolist()


@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 300), a_start=st.integers(0, 80), b_start=st.integers(0, 80),
       differ_at=st.one_of(st.none(), st.integers(0, 299)), dtype=st.sampled_from([np.int32, np.int64]),
       seed=st.integers(0, 2**16))
def test_equal_spans_is_whether_every_token_matches(length, a_start, b_start, differ_at, dtype, seed):
    """Spans at any offsets of two arrays, equal or differing at one token: inside a block of
    comparisons, at its edges, in the last partial block."""
    rng = np.random.default_rng(seed)
    span = rng.integers(0, 4, length)
    a = np.concatenate([rng.integers(0, 4, a_start), span, rng.integers(0, 4, 7)]).astype(dtype)
    b = np.concatenate([rng.integers(0, 4, b_start), span, rng.integers(0, 4, 3)]).astype(dtype)
    if differ_at is not None and differ_at < length:
        b[b_start + differ_at] += 4
    expected = np.array_equal(a[a_start:a_start + length], b[b_start:b_start + length])
    assert equal_spans(a, a_start, b, b_start, length) == expected
    assert expected == (differ_at is None or differ_at >= length)

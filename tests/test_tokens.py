"""common_prefix_length: compiled, compared in blocks; the same as comparing token by token."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hybrid.tokens import common_prefix_length


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

"""Helpers on token-id arrays shared by the planning and the replay's policies."""

from __future__ import annotations

import numba
import numpy as np

# Tokens read at once: a block's comparisons carry no branch, so they run as vector
# instructions; only a block holding what is sought (the first difference, a special token)
# is then read token by token.
_BLOCK = 64


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    if a.dtype != b.dtype or a.dtype not in (np.int32, np.int64):
        a, b = a.astype(np.int64, copy=False), b.astype(np.int64, copy=False)
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return int(_first_difference(a, b, min(a.shape[0], b.shape[0])))


@numba.njit(["i8(i4[::1], i4[::1], i8)", "i8(i8[::1], i8[::1], i8)"], cache=True)
def _first_difference(a, b, n):
    """The first index below ``n`` at which ``a`` and ``b`` differ, else ``n``. Compiled,
    reading no further than the first difference: numpy's comparison of two whole 128k-token
    prompts and search of the result cost ~40 us on the scheduler thread whatever the edit's
    depth, this at most ~22 (~1 us when the edit lies near the start)."""
    whole = n // _BLOCK * _BLOCK
    start = 0
    while start < whole:
        differ = False
        for i in range(start, start + _BLOCK):
            differ |= a[i] != b[i]
        if differ:
            break
        start += _BLOCK
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


@numba.njit(["b1(i4[::1], i8, i4[::1], i8, i8)", "b1(i8[::1], i8, i8[::1], i8, i8)"], cache=True)
def equal_spans(a, a_start, b, b_start, length):
    """Whether ``a[a_start:a_start + length]`` equals ``b[b_start:b_start + length]``
    (both within bounds), for compiled callers: the two slices compared as whole arrays run
    as vector instructions (~27 us for 128k int64 tokens), where indexing the arrays at two
    offsets does not (~160 us)."""
    return _first_difference(a[a_start:a_start + length], b[b_start:b_start + length], length) == length


def positions_at_least(ids: np.ndarray, lo: int) -> np.ndarray:
    """``np.flatnonzero(ids >= lo)``: where a prompt has a token of a template's special range
    (above every ordinary word's id, in every family whose range does not start at 0)."""
    if ids.dtype != np.int32 and ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    return _positions_at_least(np.ascontiguousarray(ids), lo)


@numba.njit(["i8[::1](i4[::1], i8)", "i8[::1](i8[::1], i8)"], cache=True)
def _positions_at_least(ids, lo):
    """Compiled: numpy's comparison and ``flatnonzero`` (slow on a sparse mask) cost ~90 us at
    128k tokens, this ~36; about the same (~8 us) at 8k, where most blocks hold a special
    token. A hit block's positions are all written and kept by advancing the count: no branch
    to mispredict at each special token. ``hit`` is an int: numba vectorizes an int's
    or-reduction, not a bool's (58 us)."""
    n = ids.shape[0]
    whole = n // _BLOCK * _BLOCK
    found = np.empty(4 * _BLOCK, dtype=np.int64)
    count = 0
    start = 0
    while start < n:
        hit = 0
        if start < whole:
            for offset in range(_BLOCK):
                hit |= ids[start + offset] >= lo
        else:
            hit = 1  # the last, partial block is read token by token
        if hit:
            if count + _BLOCK > found.shape[0]:
                grown = np.empty(2 * found.shape[0], dtype=np.int64)
                grown[:count] = found[:count]
                found = grown
            for i in range(start, min(start + _BLOCK, n)):
                found[count] = i
                count += ids[i] >= lo
        start += _BLOCK
    return found[:count].copy()

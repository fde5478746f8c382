"""Which session a request follows: trials of one task, run one after another, send the same
prompts until their outputs differ. The planner remembers which request first sent each prompt
prefix ending at a message start; a prompt that repeats another session's (whole, or up to a
message start, beyond the first message) names the session it follows."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np

from sglang_hybrid.planning.state import MAX_REMEMBERED_PREFIXES, Follow

# Digests are polynomial hashes modulo 2**64 of (token id + 1) -- so a trailing token 0 still
# counts -- with an odd multiplier. A prefix's digest is a cumulative sum, so one pass over the
# prompt gives every boundary's; a message's (its content alone, wherever it sits) is the
# difference of two, scaled back by the inverse power of its start. Not collision resistant:
# a collision only misleads a placement estimate.
MULTIPLIER = 0x9E3779B97F4A7C15
INVERSE = pow(MULTIPLIER, -1, 1 << 64)
_powers = np.ones(1, dtype=np.uint64)  # MULTIPLIER ** i, grown on demand
_inverse_powers = np.ones(1, dtype=np.uint64)
# The prefix sums of the latest prompt, reused: a fresh buffer of a 128k-token prompt (1 MiB)
# costs more in page faults than the hashing itself. The planner runs on one thread.
_sums = np.zeros(1, dtype=np.uint64)


def _power_tables(length: int) -> tuple[np.ndarray, np.ndarray]:
    global _powers, _inverse_powers
    if _powers.shape[0] < length:
        size = max(length, 2 * _powers.shape[0], 1 << 14)
        tables = []
        for base in (MULTIPLIER, INVERSE):
            table = np.full(size, base, dtype=np.uint64)
            table[0] = 1
            tables.append(np.multiply.accumulate(table))
        _powers, _inverse_powers = tables
    return _powers, _inverse_powers


def prefix_digests(prompt: np.ndarray, boundaries: list[int]) -> tuple[list[int], dict[int, int]]:
    """Digests of the prompt's prefixes ending at ``boundaries`` (ascending, each > 0), and
    depth -> digest of the message ending there (for each boundary but the prompt's end),
    the message starting at the boundary before.

    Vectorized over the prompt: hashing each message with SHA-256 cost ~2 us of call overhead
    per message (~200 us per 100-message prompt at any length) on the scheduler thread."""
    global _sums
    length = int(prompt.shape[0])
    powers, inverse_powers = _power_tables(length)
    if _sums.shape[0] <= length:
        _sums = np.zeros(max(length + 1, 2 * _sums.shape[0]), dtype=np.uint64)
    sums = _sums[: length + 1]
    terms = sums[1:]
    np.add(prompt, 1, out=terms, dtype=np.uint64, casting="unsafe")
    np.multiply(terms, powers[:length], out=terms)
    np.cumsum(terms, out=terms)
    ends = np.asarray(boundaries, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    prefixes = sums[ends]
    messages = (prefixes - sums[starts]) * inverse_powers[starts]
    return prefixes.tolist(), {
        depth: message for depth, message in zip(boundaries, messages.tolist()) if depth < length}


class PrefixProducers:
    """Digest of a prompt prefix ending at a message start (or of a whole prompt) -> the session
    and clock of the request that sent it first; the oldest are forgotten first."""

    def __init__(self, capacity: int = MAX_REMEMBERED_PREFIXES):
        self.capacity = capacity
        self._first: OrderedDict[int, tuple[str, int]] = OrderedDict()

    def leader(self, session: str, starts: list[int], digests: list[int],
               messages: dict[int, int]) -> Optional[Follow]:
        """The session whose earlier prompt this one (of ``session``, message starts
        ``starts``, prefix ``digests`` at ``[*starts, len(prompt)]``) repeats beyond its first
        message: the one that first sent the deepest such prefix, or the whole prompt."""
        matched = 0
        while matched < len(digests) and digests[matched] in self._first:
            matched += 1
        if matched < 2:
            return None
        leader, lead_clock = self._first[digests[matched - 1]]
        if leader == session:
            return None
        whole = matched == len(digests)
        last_shared = starts[-1] if whole else starts[matched - 1]
        return Follow(leader, lead_clock, whole, messages[last_shared])

    def remember(self, digests: list[int], session: str, clock: int) -> None:
        for digest in digests:
            if digest in self._first:
                self._first.move_to_end(digest)
            else:
                self._first[digest] = (session, clock)
        while len(self._first) > self.capacity:
            self._first.popitem(last=False)

"""Which session a request follows: trials of one task, run one after another, send the same
prompts until their outputs differ. The planner remembers which request first sent each prompt
prefix ending at a message start; a prompt that repeats another session's (whole, or up to a
message start, beyond the first message) names the session it follows."""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Optional

import numpy as np

from sglang_hybrid.anchors.detector import AnchorKind, Anchors
from sglang_hybrid.planning.state import MAX_REMEMBERED_PREFIXES, Follow, Session, StreamStats

# Digests are polynomial hashes modulo 2**64 of (token id + 1) -- so a trailing token 0 still
# counts -- with an odd multiplier. A prefix's digest is the sum of its messages' terms, so one
# pass over the prompt gives every boundary's; a message's (its content alone, wherever it
# sits) is the sum of its terms scaled back by the inverse power of its start. Not collision
# resistant: a collision only misleads a placement estimate.
MULTIPLIER = 0x9E3779B97F4A7C15
INVERSE = pow(MULTIPLIER, -1, 1 << 64)
_powers = np.ones(1, dtype=np.uint64)  # MULTIPLIER ** i, grown on demand
_inverse_powers = np.ones(1, dtype=np.uint64)
# The terms of the latest prompt, reused: a fresh buffer of a 128k-token prompt (1 MiB) costs
# more in page faults than the hashing itself. The planner runs on one thread.
_terms = np.zeros(1, dtype=np.uint64)


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
    """Digests of the prompt's prefixes ending at ``boundaries`` (strictly ascending, each > 0),
    and depth -> digest of the message ending there (for each boundary but the prompt's end),
    the message starting at the boundary before.

    Vectorized over the prompt: hashing each message with SHA-256 cost ~2 us of call overhead
    per message (~200 us per 100-message prompt at any length) on the scheduler thread. Each
    message's terms are summed apart (``add.reduceat``) and the prefixes are sums of those: a
    running sum over the whole prompt cost 5x more (75 us at 128k tokens)."""
    global _terms
    ends = np.asarray(boundaries, dtype=np.int64)
    hashed = int(ends[-1])
    powers, inverse_powers = _power_tables(hashed)
    if _terms.shape[0] < hashed:
        _terms = np.zeros(max(hashed, 2 * _terms.shape[0]), dtype=np.uint64)
    terms = _terms[:hashed]
    tokens = prompt[:hashed]
    if tokens.dtype == np.int64:
        # Token ids are non-negative: the same bits as uint64, added to without a cast.
        np.add(tokens.view(np.uint64), np.uint64(1), out=terms)
    else:
        np.add(tokens, 1, out=terms, dtype=np.uint64, casting="unsafe")
    np.multiply(terms, powers[:hashed], out=terms)
    starts = np.concatenate([[0], ends[:-1]])
    sums = np.add.reduceat(terms, starts)
    messages = sums * inverse_powers[starts]
    length = int(prompt.shape[0])
    return np.cumsum(sums).tolist(), {
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


def follow(producers: PrefixProducers, name: str, prompt: np.ndarray, anchors: Anchors,
           sessions: Mapping[str, Session], stream: StreamStats) -> None:
    """Find the session the prompt of ``name``'s request follows (``PrefixProducers.leader``),
    count in the stream how the previous prompt's follow state went on, and remember this
    prompt's prefixes."""
    session = sessions[name]
    prompt_len = int(prompt.shape[0])
    starts = anchors.of_kind(AnchorKind.MESSAGE_START)
    starts = starts[(starts > 0) & (starts < prompt_len)].tolist()
    digests, session.planned_messages = prefix_digests(prompt, [*starts, prompt_len])
    following = producers.leader(name, starts, digests, session.planned_messages)
    if following is not None and following.leader not in sessions:
        following = None  # the session it repeats was forgotten
    before = session.following
    if before is not None:
        stream.follow_seen[before.whole] += 1
        if following is not None and following.leader == before.leader and not following.whole:
            stream.follow_parted[before.whole] += 1
        sessions[before.leader].followers.pop(name, None)
    session.following = following
    if following is not None:
        sessions[following.leader].followers[name] = following
    producers.remember(digests, name, stream.clock)

"""Which session a request follows: trials of one task, run one after another, send the same
prompts until their outputs differ. The planner remembers which request first sent each prompt
prefix ending at a message start; a prompt that repeats another session's (whole, or up to a
message start, beyond the first message) in the same tree namespace (LoRA adapter, cache salt)
names the session it follows."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Hashable, Mapping, Optional

import numba
import numpy as np

from sglang_hybrid.anchors.detector import AnchorKind, Anchors
from sglang_hybrid.planning.state import MAX_REMEMBERED_PREFIXES, Follow, PromptDigests, Session, StreamStats
from sglang_hybrid.tokens import equal_spans

# Digests are polynomial hashes modulo 2**64 of (token id + 1) -- so a trailing token 0 still
# counts -- with an odd multiplier: a prefix's is the sum of (t_i + 1) MULTIPLIER**i over its
# tokens, so the sum of its messages' terms; a message's (its content alone, wherever it sits)
# is the sum of (t_j + 1) MULTIPLIER**j over its tokens, from its start. Not collision
# resistant: a collision only misleads a placement estimate.
MULTIPLIER = 0x9E3779B97F4A7C15
# A message's terms are summed in that many independent lanes, each by Horner's rule from the
# message's end: one multiply per token, and no lane waits for another's.
_LANES = 32


def prefix_digests(prompt: np.ndarray, boundaries: list[int], known: Optional[PromptDigests] = None,
                   common: int = 0, previous: Optional[np.ndarray] = None) -> PromptDigests:
    """Digests of the prompt's prefixes ending at ``boundaries`` (strictly ascending, each > 0),
    and of the message ending at each, the message starting at the boundary before.

    ``known``: the digests of a prompt that shares its first ``common`` tokens with this one
    (the session's previous request's): its leading boundaries that this prompt has too, up to
    ``common``, end the same prefixes, so their digests are taken as they are. ``previous``:
    that prompt's tokens (or a sequence starting with them): a later message whose
    counterpart there (the message ending at the same boundary index) has the same tokens
    takes that one's digest, compared instead of hashed. An edit early in the prompt (an old
    observation masked, a memory block rewritten) leaves the messages after it as they were,
    moved; comparing them costs a third of hashing them (~27 us against ~85 at 128k
    tokens)."""
    ends = np.asarray(boundaries, dtype=np.int64)
    reused = 0
    if known is not None:
        shared = min(ends.shape[0], known.boundaries.shape[0])
        same = (ends[:shared] == known.boundaries[:shared]) & (ends[:shared] <= common)
        reused = shared if same.all() else int(np.argmin(same))
    start = int(ends[reused - 1]) if reused else 0
    total = known.sums[reused - 1] if reused else np.uint64(0)
    if prompt.dtype != np.int32:
        prompt = prompt.astype(np.int64, copy=False)
    prompt = np.ascontiguousarray(prompt)
    if known is not None and previous is not None:
        previous = np.ascontiguousarray(previous, dtype=prompt.dtype)
        previous_ends, previous_messages = known.boundaries, known.messages
    else:
        previous = prompt[:0]
        previous_ends, previous_messages = ends[:0], np.empty(0, dtype=np.uint64)
    sums, messages = _digests(prompt, ends[reused:], start, total, previous, previous_ends, previous_messages, reused)
    if reused:
        sums = np.concatenate([known.sums[:reused], sums])
        messages = np.concatenate([known.messages[:reused], messages])
    return PromptDigests(ends, sums, messages, int(prompt.shape[0]))


@numba.njit("u8(u8, i8)", cache=True)
def _power(base, exponent):
    """``base ** exponent`` modulo 2**64."""
    result = np.uint64(1)
    while exponent > 0:
        if exponent & 1:
            result *= base
        base *= base
        exponent >>= 1
    return result


@numba.njit(["UniTuple(u8, 2)(i4[::1], i8, i8, u8[:], u8[:])", "UniTuple(u8, 2)(i8[::1], i8, i8, u8[:], u8[:])"],
            cache=True)
def _message_digest(prompt, start, end, lanes, lane_powers):
    """The digest of ``prompt[start:end]``, its j-th token's term weighted MULTIPLIER**j, and
    MULTIPLIER**(end - start). Lane l holds the terms of the tokens j = l (mod _LANES) of the
    message's whole rows of _LANES, by Horner's rule in MULTIPLIER**_LANES (``lane_powers``:
    MULTIPLIER**0.._LANES; ``lanes``: scratch), the rest are added one by one. Two multiplies
    a token (a running power and a term) cost ~145 us at 128k tokens, this ~80."""
    one, multiplier, row_power = np.uint64(1), np.uint64(MULTIPLIER), lane_powers[_LANES]
    rows_end = start + (end - start) // _LANES * _LANES
    lanes[:] = 0
    row = rows_end - _LANES
    while row >= start:
        tokens = prompt[row:row + _LANES]
        for lane in range(_LANES):
            lanes[lane] = lanes[lane] * row_power + np.uint64(tokens[lane]) + one
        row -= _LANES
    message = np.uint64(0)
    for lane in range(_LANES):
        message += lanes[lane] * lane_powers[lane]
    term_power = _power(row_power, (rows_end - start) // _LANES)
    for i in range(rows_end, end):
        message += (np.uint64(prompt[i]) + one) * term_power
        term_power *= multiplier
    return message, term_power


@numba.njit(["Tuple((u8[:], u8[:]))(i4[::1], i8[:], i8, u8, i4[::1], i8[:], u8[:], i8)",
             "Tuple((u8[:], u8[:]))(i8[::1], i8[:], i8, u8, i8[::1], i8[:], u8[:], i8)"], cache=True)
def _digests(prompt, ends, start, total, previous, previous_ends, previous_messages, first):
    """``prefix_digests``' sums past ``start``, whose prefix digest is ``total``: each boundary's
    prefix digest, and each message's. Compiled, one pass over the prompt. The k-th message
    here is the ``first + k``-th of the boundaries; one as long as the message ending at that
    boundary of ``previous`` (``previous_ends``, ``previous_messages``), and equal to it, has
    its digest; the others are hashed (``_message_digest``). A prefix's digest is the previous
    one plus the message's times MULTIPLIER**start."""
    multiplier = np.uint64(MULTIPLIER)
    lane_powers = np.empty(_LANES + 1, dtype=np.uint64)
    lane_powers[0] = np.uint64(1)
    for lane in range(1, _LANES + 1):
        lane_powers[lane] = lane_powers[lane - 1] * multiplier
    lanes = np.empty(_LANES, dtype=np.uint64)
    sums, messages = np.empty(ends.shape[0], dtype=np.uint64), np.empty(ends.shape[0], dtype=np.uint64)
    power = _power(multiplier, start)  # MULTIPLIER ** start
    for k in range(ends.shape[0]):
        end = ends[k]
        counterpart = first + k
        known = False
        if counterpart < previous_ends.shape[0]:
            previous_start = previous_ends[counterpart - 1] if counterpart > 0 else 0
            known = (previous_ends[counterpart] - previous_start == end - start
                     and previous_ends[counterpart] <= previous.shape[0]
                     and equal_spans(previous, previous_start, prompt, start, end - start))
        if known:
            message, term_power = previous_messages[counterpart], _power(multiplier, end - start)
        else:
            message, term_power = _message_digest(prompt, start, end, lanes, lane_powers)
        messages[k] = message
        total += message * power
        sums[k] = total
        power *= term_power  # MULTIPLIER ** end
        start = end
    return sums, messages


def namespace_digest(namespace: Hashable) -> np.uint64:
    """What a prefix's digest is offset by in ``namespace`` (the default namespace's, None,
    are the prompt's own). Not Python's ``hash``, which salts strings per process: the
    planner's decisions stay a function of the request stream alone, collisions included."""
    return np.uint64(int.from_bytes(hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest(), "little"))


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
        # One lookup a digest: a request after an early edit sends ~100 new prefixes, and
        # testing then inserting each cost ~60 us a request in the planner_cost replay (1,024
        # slots, 32k tokens), this ~42.
        sent = (session, clock)
        for digest in digests:
            if self._first.setdefault(digest, sent) is not sent:
                self._first.move_to_end(digest)
        while len(self._first) > self.capacity:
            self._first.popitem(last=False)


def follow(producers: PrefixProducers, name: str, prompt: np.ndarray, anchors: Anchors, common: int,
           namespace: Optional[Hashable], sessions: Mapping[str, Session], stream: StreamStats) -> None:
    """Find the session the prompt of ``name``'s request follows (``PrefixProducers.leader``),
    count in the stream how the previous prompt's follow state went on, and remember this
    prompt's prefixes. ``common``: the tokens the prompt shares with the session's sequence,
    whose digests (``Session.digests``) this prompt's start from; they become this prompt's.
    ``namespace``: the request's tree namespace (``RequestContext.namespace``): a request
    follows only prompts sent in its own, the only ones whose checkpoints it can restore."""
    session = sessions[name]
    prompt_len = int(prompt.shape[0])
    starts = anchors.of_kind(AnchorKind.MESSAGE_START)
    starts = starts[(starts > 0) & (starts < prompt_len)].tolist()
    session.digests = prefix_digests(prompt, [*starts, prompt_len], session.digests, common, session.sequence)
    sums = session.digests.sums
    digests = (sums if namespace is None else sums + namespace_digest(namespace)).tolist()
    session.planned_messages = session.digests.message_ends()
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

"""Edit-point addresses: a point of a token sequence named by its anchors, so that evaluated on
the session's next sequence it gives where "the same" point is now."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import NamedTuple, Optional

import numba
import numpy as np

from sglang_hybrid.anchors.detector import AnchorKind, Anchors, Role

# An address names a point of a token sequence by its anchors, independent of the sequence's
# length; evaluated on the next sequence it gives where "the same" point is now. Encoded as
# tuples of ints (hashable with a process-independent hash).
ABSOLUTE = 0  # (ABSOLUTE, position)
FROM_START = 1  # (FROM_START, index among distinct anchor positions)
FROM_END = 2  # (FROM_END, kind, role, n): the n-th anchor of (kind, role), counting from the end
AFTER_LAST_USER = 3  # (AFTER_LAST_USER, kind, role, n): relative to the last user message start
# (IN_MESSAGE_FROM_END, kind, role, n): the first anchor of (kind, role) inside the n-th message
# (of any role) from the end, for the tool results a window of the last N events masks: the
# rank of the one leaving it among tool results varies with how many of the messages after it
# are tool results; its rank among messages does not.
IN_MESSAGE_FROM_END = 4
# (PROMPT_TAIL,): the prompt's last token, the deepest state a request repeating the prompt
# can restore from (it computes at least one token for its first output's logits). The
# prompt end itself (FROM_END, PROMPT_END, ...) is where a template re-rendering the
# latest output (Qwen3's dropping its reasoning) makes the next prompt leave this one: a
# checkpoint there saves that request one token more, and serves no repeat.
PROMPT_TAIL = 5
WINDOWED_PARTS = frozenset({int(AnchorKind.TOOL_RESULT_START)})
# The role of a message-start address that counts messages of every role: a window of the last
# N events (observation masking, a sliding window) moves by messages, whatever their roles.
ANY_ROLE = -1
# Role values are below this: (kind, role) pairs are numbered kind * _ROLES + role.
_ROLES = int(max(Role)) + 1
_MESSAGE_START = int(AnchorKind.MESSAGE_START)
# Messages an agent's request adds to its session's sequence: its output and the next input
# (a tool result, a user turn).
MESSAGES_PER_REQUEST = 2

Address = tuple[int, ...]


class Prefill(NamedTuple):
    """What one request computed: the points after ``restored`` up to ``length`` of the
    sequence ``index`` describes, each of which it could have checkpointed."""

    restored: int
    length: int
    index: "AnchorIndex"


@numba.njit("Tuple((i8[:], i8[:], i8[:], i8[:], i8[:]))(i8[:], i1[:], i1[:])", cache=True)
def _group(positions, kinds, roles):
    """Of anchors sorted by position: their distinct positions, the message starts, and the
    positions grouped by (kind, role), each group by position (``grouped``; group ``g`` of
    key ``keys[g]`` = kind * _ROLES + role is ``grouped[bounds[g]:bounds[g + 1]]``). Compiled:
    as array operations, ~15 of them, it cost ~25 us on any prompt."""
    n = positions.shape[0]
    unique = np.empty(n, dtype=np.int64)
    messages = np.empty(n, dtype=np.int64)
    distinct = starts = 0
    for i in range(n):
        if i == 0 or positions[i] != positions[i - 1]:
            unique[distinct] = positions[i]
            distinct += 1
        if kinds[i] == _MESSAGE_START:
            messages[starts] = positions[i]
            starts += 1
    key = kinds.astype(np.int64) * _ROLES + roles
    order = np.argsort(key, kind="mergesort")  # stable: each group stays by position
    grouped = positions[order]
    sorted_keys = key[order]
    keys = np.empty(n, dtype=np.int64)
    bounds = np.empty(n + 1, dtype=np.int64)
    groups = 0
    for i in range(n):
        if i == 0 or sorted_keys[i] != sorted_keys[i - 1]:
            keys[groups] = sorted_keys[i]
            bounds[groups] = i
            groups += 1
    bounds[groups] = n
    return unique[:distinct], messages[:starts], grouped, keys[:groups], bounds[: groups + 1]


class AnchorIndex:
    """Anchor positions of one sequence, grouped the ways addresses look them up. Held as
    Python lists: a request reads a few dozen single positions (an edit model's addresses
    evaluated, an edit point named), each a bisection, which on numpy arrays costs a call and
    a scalar conversion apiece (~1 us, ~50 us an edit)."""

    def __init__(self, anchors: Anchors, length: int):
        self.length = length
        unique, messages, grouped, keys, bounds = _group(anchors.positions, anchors.kinds, anchors.roles)
        self.unique: list[int] = unique.tolist()
        self.messages: list[int] = messages.tolist()
        grouped, bounds = grouped.tolist(), bounds.tolist()
        self.by_key: dict[tuple[int, int], list[int]] = {
            divmod(key, _ROLES): grouped[start:stop] for key, start, stop in zip(keys.tolist(), bounds, bounds[1:])}
        # Message starts of every role, which message-window addresses count.
        self.by_key[(_MESSAGE_START, ANY_ROLE)] = self.messages
        users = self.by_key.get((_MESSAGE_START, int(Role.USER)))
        self.last_user = users[-1] if users else None
        prompt_ends = self.by_key.get((int(AnchorKind.PROMPT_END), int(Role.NONE)))
        self.prompt_tail = prompt_ends[-1] - 1 if prompt_ends else None
        # Position -> its addresses: an edit point's are read by the session's edit model and
        # by the stream's.
        self._addresses: dict[int, tuple[Address, ...]] = {}

    def addresses_of(self, position: int) -> tuple[Address, ...]:
        """Every address naming ``position`` itself (an edit inside a message has no anchor of
        its own) or the deepest anchor at or before it.

        An anchor address names the anchor, not the edit a few tokens past it: the template
        text between the two (a message header) is the same in every message, but where the
        content first differs is not, and a checkpoint one token too deep is unusable.
        """
        addresses = self._addresses.get(position)
        if addresses is None:
            addresses = self._addresses[position] = tuple(self._name(position))
        return addresses

    def _name(self, position: int) -> list[Address]:
        addresses: list[Address] = [(ABSOLUTE, position)]
        if position == self.prompt_tail:
            addresses.append((PROMPT_TAIL,))
        index = bisect_right(self.unique, position) - 1
        if index < 0:
            return addresses
        anchor = self.unique[index]
        addresses.append((FROM_START, index))
        keys = [key for key in sorted(self.by_key) if key[1] != ANY_ROLE and _holds(self.by_key[key], anchor)]
        if any(kind == _MESSAGE_START for kind, _ in keys):
            keys.append((_MESSAGE_START, ANY_ROLE))
        message = bisect_right(self.messages, anchor) - 1
        for kind, role in keys:
            positions = self.by_key[(kind, role)]
            mine = bisect_left(positions, anchor)
            addresses.append((FROM_END, kind, role, len(positions) - mine))
            if kind in WINDOWED_PARTS and message >= 0 and self._first_in_message(kind, role, message) == anchor:
                addresses.append((IN_MESSAGE_FROM_END, kind, role, len(self.messages) - message))
            if self.last_user is not None:
                after = bisect_right(positions, self.last_user)
                addresses.append((AFTER_LAST_USER, kind, role, mine - after + 1))
        return addresses

    def positions_ahead(self, address: Address, limit: int) -> list[tuple[int, int]]:
        """Points ``address`` will name once the sequence grows, each with the number of
        requests until it does (1: the next request's edit), at most ``limit`` of them, the
        soonest first.

        A window of the last n events reaches a point only after it was computed: the
        observation a masking agent hides next entered the prompt a few requests before, at
        its end, and only a checkpoint taken then can serve the edit. The tool result of the
        n-th message from the end is, after each request appends ``MESSAGES_PER_REQUEST``
        messages, the one of a message that many closer to the end now. (Not so a message
        address: a condensation's edit lands the same number of messages from the end each
        time the view overflows, but the view does not slide by a message each request.) An
        n-th-anchor-from-the-end address names nothing while the sequence holds fewer than n
        such anchors; once it does, it names the oldest of them, about one anchor of its
        kind per request later."""
        kind = address[0]
        if kind not in (FROM_END, IN_MESSAGE_FROM_END):
            return []
        n = address[3]
        if kind == FROM_END:
            positions = self.by_key.get((address[1], address[2]))
            if positions is None or not 0 < len(positions) < n:
                return []
            return [(positions[0], n - len(positions) + 1)]
        ahead = []
        messages = len(self.messages)
        for rank in range(min(n - 1, messages), max(n - 1 - limit, 0), -1):
            position = self._first_in_message(address[1], address[2], messages - rank)
            if position is not None:
                ahead.append((position, 1 + -(-(n - rank) // MESSAGES_PER_REQUEST)))
        return ahead

    def points_named(self, address: Address, limit: int) -> list[tuple[int, int]]:
        """The point ``address`` names here (1 request away: the next request's edit) and
        those it will name as the sequence grows (``positions_ahead``), with the requests
        until it does."""
        position = self.position_of(address)
        return ([] if position is None else [(position, 1)]) + self.positions_ahead(address, limit)

    def names(self, address: Address, position: int) -> bool:
        """Whether ``address`` names ``position`` here, or will as the sequence grows
        (``points_named`` with no limit but the messages there are). Only the message holding
        ``position`` can name it, so a window address asks that one message rather than
        listing every point it will name (~100 bisections in a 100-message prompt)."""
        if self.position_of(address) == position:
            return True
        if address[0] != IN_MESSAGE_FROM_END:
            return any(depth == position for depth, _ in self.positions_ahead(address, len(self.messages) + 1))
        messages, n = len(self.messages), address[3]
        message = bisect_right(self.messages, position) - 1
        rank = messages - message  # from the end, as the address counts
        # The ranks ``positions_ahead`` lists: below n, at most messages + 1 of them.
        return (message >= 0 and max(n - messages - 1, 1) <= rank <= n - 1
                and self._first_in_message(address[1], address[2], message) == position)

    def position_of(self, address: Address) -> Optional[int]:
        kind = address[0]
        if kind == ABSOLUTE:
            return address[1] if address[1] <= self.length else None
        if kind == FROM_START:
            return self.unique[address[1]] if address[1] < len(self.unique) else None
        if kind == PROMPT_TAIL:
            return self.prompt_tail
        if kind == IN_MESSAGE_FROM_END:
            n = address[3]
            return self._first_in_message(address[1], address[2], len(self.messages) - n) if n <= len(self.messages) else None
        positions = self.by_key.get((address[1], address[2]))
        if positions is None:
            return None
        if kind == FROM_END:
            n = address[3]
            return positions[-n] if n <= len(positions) else None
        if self.last_user is None:
            return None
        index = bisect_right(positions, self.last_user) + address[3] - 1
        return positions[index] if 0 <= index < len(positions) else None

    def _first_in_message(self, kind: int, role: int, message: int) -> Optional[int]:
        """The first anchor of (kind, role) inside the ``message``-th message (from 0)."""
        positions = self.by_key.get((kind, role))
        if positions is None:
            return None
        messages = self.messages
        end = messages[message + 1] if message + 1 < len(messages) else self.length + 1
        first = bisect_left(positions, messages[message])
        return positions[first] if first < len(positions) and positions[first] < end else None


def _holds(positions: list[int], position: int) -> bool:
    """Whether ascending ``positions`` hold ``position``."""
    at = bisect_left(positions, position)
    return at < len(positions) and positions[at] == position

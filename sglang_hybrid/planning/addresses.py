"""Edit-point addresses: a point of a token sequence named by its anchors, so that evaluated on
the session's next sequence it gives where "the same" point is now."""

from __future__ import annotations

from typing import Optional

import numpy as np

from sglang_hybrid.anchors.detector import AnchorKind, Anchors, Role

# An address names a point of a token sequence by its anchors, independent of the sequence's
# length; evaluated on the next sequence it gives where "the same" point is now. Encoded as
# tuples of ints (hashable with a process-independent hash).
ABSOLUTE = 0  # (ABSOLUTE, position)
FROM_START = 1  # (FROM_START, index among distinct anchor positions)
FROM_END = 2  # (FROM_END, kind, role, n): the n-th anchor of (kind, role), counting from the end
AFTER_LAST_USER = 3  # (AFTER_LAST_USER, kind, role, n): relative to the last user message start
# The role of a message-start address that counts messages of every role: a window of the last
# N events (observation masking, a sliding window) moves by messages, whatever their roles.
ANY_ROLE = -1

Address = tuple[int, ...]


class AnchorIndex:
    """Anchor positions of one sequence, grouped the ways addresses look them up."""

    def __init__(self, anchors: Anchors, length: int):
        self.length = length
        self.unique = anchors.unique_positions()
        self.by_key: dict[tuple[int, int], np.ndarray] = {}
        for kind, role in sorted(set(zip(anchors.kinds.tolist(), anchors.roles.tolist()))):
            mask = (anchors.kinds == kind) & (anchors.roles == role)
            self.by_key[(kind, role)] = anchors.positions[mask]
        self.by_key[(int(AnchorKind.MESSAGE_START), ANY_ROLE)] = anchors.of_kind(AnchorKind.MESSAGE_START)
        users = self.by_key.get((int(AnchorKind.MESSAGE_START), int(Role.USER)))
        self.last_user = int(users[-1]) if users is not None and users.size else None
        self._anchors = anchors

    def addresses_of(self, position: int) -> list[Address]:
        """Every address naming ``position`` itself (an edit inside a message has no anchor of
        its own) or the deepest anchor at or before it.

        An anchor address names the anchor, not the edit a few tokens past it: the template
        text between the two (a message header) is the same in every message, but where the
        content first differs is not, and a checkpoint one token too deep is unusable.
        """
        addresses: list[Address] = [(ABSOLUTE, position)]
        index = int(np.searchsorted(self.unique, position, side="right")) - 1
        if index < 0:
            return addresses
        anchor = int(self.unique[index])
        addresses.append((FROM_START, index))
        at = self._anchors.positions == anchor
        keys = sorted(set(zip(self._anchors.kinds[at].tolist(), self._anchors.roles[at].tolist())))
        if any(kind == AnchorKind.MESSAGE_START for kind, _ in keys):
            keys.append((int(AnchorKind.MESSAGE_START), ANY_ROLE))
        for kind, role in keys:
            positions = self.by_key[(kind, role)]
            rank = int(positions.size - np.searchsorted(positions, anchor, side="left"))
            addresses.append((FROM_END, kind, role, rank))
            if self.last_user is not None:
                after = int(np.searchsorted(positions, self.last_user, side="right"))
                mine = int(np.searchsorted(positions, anchor, side="left"))
                addresses.append((AFTER_LAST_USER, kind, role, mine - after + 1))
        return addresses

    def position_ahead(self, address: Address) -> Optional[tuple[int, int]]:
        """Where ``address`` will name a point once the sequence grows, and how many more
        anchors of its kind must come first: a window of the last n events names nothing
        while the session holds fewer, and once it fills it names the oldest of them (the
        first observation a masking agent hides). None for the other addresses, and for one
        that names a point now (``position_of``)."""
        if address[0] != FROM_END:
            return None
        positions = self.by_key.get((address[1], address[2]))
        if positions is None or not 0 < positions.size < address[3]:
            return None
        return int(positions[0]), address[3] - positions.size

    def position_of(self, address: Address) -> Optional[int]:
        kind = address[0]
        if kind == ABSOLUTE:
            return address[1] if address[1] <= self.length else None
        if kind == FROM_START:
            return int(self.unique[address[1]]) if address[1] < self.unique.size else None
        positions = self.by_key.get((address[1], address[2]))
        if positions is None:
            return None
        if kind == FROM_END:
            n = address[3]
            return int(positions[-n]) if n <= positions.size else None
        if self.last_user is None:
            return None
        index = int(np.searchsorted(positions, self.last_user, side="right")) + address[3] - 1
        return int(positions[index]) if 0 <= index < positions.size else None

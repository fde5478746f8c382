"""Whether a session came back after its latest output or ended, counted per output closing
(``StreamStats.closings``), which ``session_rates.return_probability`` reads."""

from __future__ import annotations

import heapq
from typing import Mapping, Optional

import numpy as np

from sglang_hybrid.planning.state import CLOSING_TOKENS, ENDED_AFTER_GAPS, Session, StreamStats
from sglang_hybrid.planning.session_rates import mean_gap


def closing_of(output: np.ndarray) -> Optional[tuple[int, ...]]:
    """An output's closing: its last ``CLOSING_TOKENS`` tokens, None if it has none."""
    return tuple(output[-CLOSING_TOKENS:].tolist()) or None


class SessionEnds:
    """Labels the ends of sessions. A session ends once and is never seen to, so an end is
    labelled late: a session silent for ``ENDED_AFTER_GAPS`` of its mean gaps since its latest
    request counts as ended after its latest output's closing, and so does one its client
    closed, at the next request (the stream's counters move only with the clock, when the held
    values read them again). A session that comes back is counted as having come back, and
    out of the ended if it was counted there."""

    def __init__(self) -> None:
        # (clock past which a session counts as ended, the clock of its latest request, its
        # name), a heap: one entry per finished request, stale once the session sends another.
        self._deadlines: list[tuple[float, int, str]] = []

    def finished(self, name: str, session: Session, stream: StreamStats) -> None:
        """``session``'s latest request finished, its output closing with ``session.closing``."""
        if session.closing is not None:
            deadline = session.last_clock + ENDED_AFTER_GAPS * mean_gap(session, stream)
            heapq.heappush(self._deadlines, (deadline, session.last_clock, name))

    def closed(self, name: str, session: Session, clock: int) -> None:
        """``session``'s client said it sends no more requests."""
        heapq.heappush(self._deadlines, (float(clock), session.last_clock, name))

    def returned(self, session: Session, stream: StreamStats) -> None:
        """``session`` sent another request: it came back after its latest output."""
        closing, session.closing = session.closing, None
        if closing is not None:
            stream.closings.count(closing, 1, -1 if session.presumed_ended else 0)
            session.presumed_ended = False

    def presume_ended(self, sessions: Mapping[str, Session], stream: StreamStats) -> None:
        """Count as ended the sessions silent past their deadline, or closed by their client."""
        while self._deadlines and self._deadlines[0][0] < stream.clock:
            _, last_clock, name = heapq.heappop(self._deadlines)
            session = sessions.get(name)
            if (session is None or session.last_clock != last_clock or session.presumed_ended
                    or session.closing is None):
                continue  # forgotten, back since, or counted already
            session.presumed_ended = True
            stream.closings.count(session.closing, 0, 1)

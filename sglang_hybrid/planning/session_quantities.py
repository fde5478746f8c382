"""The per-session quantities every held checkpoint's value reads (``HeldValues``), for all
sessions at once: ``valuation``'s own arithmetic applied to arrays indexed by session, in the
order of operations of the scalar functions, so the values are the same floats."""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from sglang_hybrid.planning.state import PRIOR_GAPS, Session, StreamStats
from sglang_hybrid.planning.valuation import (
    closing_return_rate, edit_rate, edit_weight, patience, scarcity, stream_mean_gap, toward,
)

# A session's counters, copied when it changes (``Session``): gaps, transitions and edits, its
# latest request's clock, the ending of its latest output (an index into the endings seen, -1:
# not known yet), the gaps, transitions and edits after that ending, whether it ended.
GAP_TOTAL, TRANSITIONS, EDITS, LAST_CLOCK, ENDING, GAPS_AFTER, TRANSITIONS_AFTER, EDITS_AFTER, ENDED = range(9)
SESSION_STATS = 9


class SessionQuantities:
    """By session index: its counters, and as of the latest ``compute`` its mean gap
    (``gap``), P(next request appends) per unit of time (``appends``), P(alive)
    (``alive``), P(next request edits) (``edit``), the weight of its predicted edit points
    (``edit_weight``, ``valuation.edit_weight``). Reads the planner's sessions and stream
    counters, which the planner owns."""

    def __init__(self, sessions: Mapping[str, Session], stream: StreamStats):
        self._sessions, self._stream = sessions, stream
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self._free_indices: list[int] = []  # of sessions forgotten
        self._stats = np.zeros((0, SESSION_STATS))
        self.gap = np.zeros(0)
        self.appends = np.zeros(0)
        self.alive = np.zeros(0)
        self.edit = np.zeros(0)
        self.edit_weight = np.zeros(0)
        self._endings: dict[int, int] = {}  # output ending -> index

    def index_of(self, name: str) -> Optional[int]:
        return self._index.get(name)

    def session(self, index: int) -> Session:
        return self._sessions[self._names[index]]

    def add(self, name: str) -> int:
        """An index for ``name``, which has none; its counters are to be ``read``."""
        if self._free_indices:
            index = self._free_indices.pop()
            self._names[index] = name
        else:
            index = len(self._names)
            self._names.append(name)
            if index >= self.gap.shape[0]:
                size = max(16, 2 * self.gap.shape[0])
                self.gap, self.appends, self.alive, self.edit, self.edit_weight = (
                    np.resize(array, size) for array in (self.gap, self.appends, self.alive, self.edit, self.edit_weight))
                self._stats = np.concatenate([self._stats, np.zeros((size - self._stats.shape[0], SESSION_STATS))])
        self._index[name] = index
        return index

    def forget(self, name: str) -> Optional[int]:
        """Free ``name``'s index for the next new session; return it (None: it had none)."""
        index = self._index.pop(name, None)
        if index is not None:
            self._names[index] = ""
            self._free_indices.append(index)
        return index

    def read(self, index: int) -> None:
        """Copy the session's counters."""
        session = self.session(index)
        ending = session.ending
        if ending is None:
            after = (-1, 0, 0, 0)
        else:
            after = (self._endings.setdefault(ending, len(self._endings)), session.gaps_after[ending],
                     session.transitions_after[ending], session.edits_after[ending])
        self._stats[index] = (session.gap_total, session.transitions, session.edits, session.last_clock, *after,
                              session.ended)

    def compute(self, sessions: np.ndarray, clock: int) -> None:
        """``valuation``'s mean_gap, append_probability x stream_mean_gap / next_gap, alive and
        edit_probability of ``sessions`` at ``clock``, from their counters as last read and
        the stream's."""
        stream, stats = self._stream, self._stats[sessions]
        stream_gap = stream_mean_gap(stream)
        gap = toward(stats[:, GAP_TOTAL], stats[:, TRANSITIONS], stream_gap, PRIOR_GAPS)
        edit = edit_rate(stats[:, EDITS], stats[:, TRANSITIONS], stream.edits, stream.transitions)
        # After a known ending: the session's gaps and edits after such endings, the stream's
        # after it (its gaps drawn toward its mean gap) as the prior. Index -1: none known.
        after = np.zeros((3, len(self._endings) + 1))
        for ending, index in self._endings.items():
            after[:, index] = (stream.gaps_after[ending], stream.transitions_after[ending], stream.edits_after[ending])
        ending = stats[:, ENDING].astype(np.int64)
        stream_gaps, stream_transitions, stream_edits = after[:, ending]
        known = ending >= 0
        gap_prior = toward(stream_gaps, stream_transitions, stream_gap, PRIOR_GAPS)
        next_gap = np.where(known, toward(stats[:, GAPS_AFTER], stats[:, TRANSITIONS_AFTER], gap_prior, PRIOR_GAPS), gap)
        appends = 1.0 - np.where(
            known, edit_rate(stats[:, EDITS_AFTER], stats[:, TRANSITIONS_AFTER], stream_edits, stream_transitions), edit)
        # The sessions share a handful of closings ("!", "?", a tool call's close): each
        # one's rate once, by the scalar function.
        closings = [self.session(index).closing for index in sessions.tolist()]
        rates = {closing: closing_return_rate(closing, stream) for closing in set(closings)}
        returning = np.array([rates[closing] for closing in closings])
        idle = clock - stats[:, LAST_CLOCK]
        limit = patience(gap, next_gap)
        with np.errstate(divide="ignore", invalid="ignore"):
            self.alive[sessions] = np.where(
                stats[:, ENDED] > 0.0, 0.0, returning * np.where(idle <= limit, 1.0, (limit / idle) ** 2))
        self.gap[sessions] = gap
        self.appends[sessions] = appends * stream_gap / next_gap
        self.edit_weight[sessions] = edit_weight(stream_gap, next_gap, scarcity(stream))
        self.edit[sessions] = edit

"""The per-session quantities every held checkpoint's value reads (``HeldValues``), for all
sessions at once: ``session_rates``' and ``valuation``'s own functions compiled (``numba``)
over arrays indexed by session, so the values are the same floats as the scalar functions
give."""

from __future__ import annotations

from typing import Mapping, Optional

import numba
import numpy as np

from sglang_hybrid.planning.state import CLOSING_TOKENS, PRIOR_GAPS, Session, StreamStats
from sglang_hybrid.planning.session_rates import (
    edit_rate, overall_return_rate, patience, return_rate_after, stream_mean_gap, toward,
)
from sglang_hybrid.planning.valuation import edit_weight, scarcity

# A session's counters, copied when it changes (``Session``): gaps, transitions and edits, its
# latest request's clock, the ending of its latest output (an index into the endings seen, -1:
# not known yet), the gaps, transitions and edits after that ending, whether it ended.
GAP_TOTAL, TRANSITIONS, EDITS, LAST_CLOCK, ENDING, GAPS_AFTER, TRANSITIONS_AFTER, EDITS_AFTER, ENDED = range(9)
# Its latest output's closing: its length (0: none), then the stream's returns and ends after
# each of its suffixes, the shortest first (``StreamStats.closings``), copied when the session
# changes and again when the stream counts one of those suffixes.
CLOSING_LENGTH = 9
CLOSING_COUNTS = 10
SESSION_STATS = CLOSING_COUNTS + 2 * CLOSING_TOKENS


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
        # By session index, its closing as last read; by closing suffix, the sessions whose
        # closing ends with it.
        self._closings: list[Optional[tuple[int, ...]]] = []
        self._sessions_by_suffix: dict[tuple[int, ...], set[int]] = {}

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
            self._closings.append(None)
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
            self._track_closing(index, None)
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
        self._stats[index, :CLOSING_LENGTH] = (session.gap_total, session.transitions, session.edits,
                                               session.last_clock, *after, session.ended)
        self._track_closing(index, session.closing)
        self._read_closing_counts(index)

    def _track_closing(self, index: int, closing: Optional[tuple[int, ...]]) -> None:
        before = self._closings[index]
        if before == closing:
            return
        for suffix in _suffixes(before):
            sessions = self._sessions_by_suffix[suffix]
            sessions.discard(index)
            if not sessions:
                del self._sessions_by_suffix[suffix]
        for suffix in _suffixes(closing):
            self._sessions_by_suffix.setdefault(suffix, set()).add(index)
        self._closings[index] = closing

    def _read_closing_counts(self, index: int) -> None:
        row, counts = self._stats[index], self._stream.closings
        suffixes = _suffixes(self._closings[index])
        row[CLOSING_LENGTH] = len(suffixes)
        for k, suffix in enumerate(suffixes):
            row[CLOSING_COUNTS + 2 * k: CLOSING_COUNTS + 2 * k + 2] = counts.of(suffix)

    def compute(self, sessions: np.ndarray, clock: int) -> None:
        """``valuation``'s mean_gap, append_probability x stream_mean_gap / next_gap, alive and
        edit_probability of ``sessions`` at ``clock``, from their counters as last read and
        the stream's."""
        stream = self._stream
        # The stream's gaps, transitions and edits after each known ending.
        after = np.zeros((3, len(self._endings)))
        for ending, index in self._endings.items():
            after[:, index] = (stream.gaps_after[ending], stream.transitions_after[ending], stream.edits_after[ending])
        for suffix in stream.closings.take_changed():
            for index in self._sessions_by_suffix.get(suffix, ()):
                self._read_closing_counts(index)
        _compute(self._stats, sessions, after, overall_return_rate(stream), clock, stream_mean_gap(stream),
                 float(stream.edits), float(stream.transitions), scarcity(stream), self.gap, self.appends, self.alive,
                 self.edit, self.edit_weight)


def _suffixes(closing: Optional[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """A closing's suffixes, the shortest first."""
    return [] if closing is None else [closing[start:] for start in range(len(closing) - 1, -1, -1)]


@numba.njit("void(f8[:, :], i8[:], f8[:, :], f8, i8, f8, f8, f8, f8, f8[:], f8[:], f8[:], f8[:], f8[:])",
            cache=True)
def _compute(stats, sessions, after, overall_return, clock, stream_gap, stream_edits, stream_transitions,
             pool_scarcity, gap_out, appends_out, alive_out, edit_out, edit_weight_out):
    """``SessionQuantities.compute`` of ``sessions`` (``overall_return``:
    ``session_rates.overall_return_rate``). Compiled, with their formulas as written (the
    same operations in the same order, so the same floats): numpy's ~40 array operations cost
    ~40 us at any number of sessions, and each session's ``closing_return_rate`` in Python
    ~2 us."""
    for i in range(sessions.shape[0]):
        session = sessions[i]
        row = stats[session]
        returning = 1.0 if row[CLOSING_LENGTH] == 0.0 else overall_return
        for k in range(int(row[CLOSING_LENGTH])):
            returning = return_rate_after(returning, row[CLOSING_COUNTS + 2 * k], row[CLOSING_COUNTS + 2 * k + 1])
        gap = toward(row[GAP_TOTAL], row[TRANSITIONS], stream_gap, PRIOR_GAPS)
        edit = edit_rate(row[EDITS], row[TRANSITIONS], stream_edits, stream_transitions)
        ending = int(row[ENDING])
        if ending >= 0:
            # After a known ending: the session's gaps and edits after such endings, the
            # stream's after it (its gaps drawn toward its mean gap) as the prior.
            gap_prior = toward(after[0, ending], after[1, ending], stream_gap, PRIOR_GAPS)
            next_gap = toward(row[GAPS_AFTER], row[TRANSITIONS_AFTER], gap_prior, PRIOR_GAPS)
            appends = 1.0 - edit_rate(row[EDITS_AFTER], row[TRANSITIONS_AFTER], after[2, ending], after[1, ending])
        else:
            next_gap = gap
            appends = 1.0 - edit
        idle = clock - row[LAST_CLOCK]
        limit = patience(gap, next_gap)
        if row[ENDED] > 0.0:
            alive_out[session] = 0.0
        else:
            alive_out[session] = returning * (1.0 if idle <= limit else (limit / idle) ** 2)
        gap_out[session] = gap
        appends_out[session] = appends * stream_gap / next_gap
        edit_weight_out[session] = edit_weight(stream_gap, next_gap, pool_scarcity)
        edit_out[session] = edit

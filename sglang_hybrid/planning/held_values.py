"""The values of every held checkpoint at once: ``valuation.checkpoint_value`` evaluated over
the rows of one table, one row per checkpoint.

Admission against a full pool compares each candidate with the lowest held value and every
eviction takes the lowest, so both need all of them, and every request moves the clock that
they read (how long a session has been silent, the rate a shared checkpoint is used at) and the
stream's counters behind every session's priors: each request values the whole pool again.
Valued one by one in Python that cost ~3 us a checkpoint (3 ms a request at 1,024 slots).
Here a session's checkpoints share its few per-request quantities (its mean gap, append
probability, liveness), computed for all sessions at once from their counters (copied when a
session changes) and the stream's (``SessionQuantities``); what an own checkpoint's depth is
worth to its session's restore points is kept in its row until the session changes; the rest
is ``valuation``'s functions compiled (``numba``) over the rows, so the values are the same
floats as the scalar functions give.

The row of a checkpoint is fixed by where it is (device slot s: row 2s, host slot s: row
2s + 1), so the device values by slot are every other row. Reads the planner's records,
sessions and stream counters, which the planner owns; the planner says which records it added,
dropped, moved or changed and which sessions changed.
"""

from __future__ import annotations

from typing import Mapping, Optional

import numba
import numpy as np

from sglang_hybrid.cache.planning import CheckpointId, Tier
from sglang_hybrid.planning.session_quantities import SessionQuantities
from sglang_hybrid.planning.state import SHARED_PURPOSES, Purpose, Record, Session, StreamStats
from sglang_hybrid.planning.valuation import (
    followed_value, restore_horizon, restore_probability, restore_shares, shared_prior, shared_value, tokens_saved,
)

# The table's columns (those written together adjacent: a slice costs a tenth of a list index).
# Flags are 0.0 / 1.0.
SESSION, SHARED, BRANCH, HINT, CREATED, USES, SPAN, DEPTH = range(8)
# An own checkpoint's, from its session's restore shares: on the session's path, P(its restore
# points but the end), serves the end of the latest sequence, tokens it saves (at least 1).
ON_PATH, PREDICTED, SERVES_END, SAVED = range(8, 12)
COLUMNS = 12


@numba.njit("void(f8[:, :], i8[:], f8[:], f8[:], f8[:], f8[:], f8[:], i8, f8, f8, f8, f8[:])", cache=True)
def _value_rows(table, rows, gap, edit_weight, appends, edit, alive, clock, horizon, path_prior, branch_prior,
                values):
    """``valuation.checkpoint_value`` of the checkpoints in ``rows`` of ``table`` into
    ``values``, from their sessions' quantities (``SessionQuantities``), but what a leader's
    followers restore. Compiled, with valuation's formulas as written (the same operations in
    the same order, so the same floats: without fastmath numba fuses no multiply and add):
    numpy's ~35 array operations cost ~40 us at any size, a Python loop ~2 us a row, this
    ~10 us for a thousand rows."""
    for row in rows:
        session = int(table[row, SESSION])
        if table[row, SHARED] > 0.0:
            prior = branch_prior if table[row, BRANCH] > 0.0 else path_prior
            values[row] = shared_value(table[row, SPAN], table[row, USES], clock - table[row, CREATED], prior,
                                       gap[session])
            continue
        # Own: P(the session's next request restores from it) x P(alive) x tokens saved.
        probability = restore_probability(table[row, PREDICTED], table[row, SERVES_END] > 0.0, appends[session],
                                          horizon, edit_weight[session])
        if table[row, HINT] > 0.0:
            probability = max(probability, edit[session])
        kept = table[row, ON_PATH] > 0.0 and probability > 0.0
        values[row] = probability * alive[session] * table[row, SAVED] if kept else 0.0


@numba.njit("void(f8[:, :], i8[:], b1[:], i8[:], f8[:], i8, i8)", cache=True)
def _read_restore_shares(table, rows, on_path, depths, predicted, end, base_depth):
    """A session's ``valuation.RestoreShares`` into the ON_PATH..SAVED columns of its own
    checkpoints' ``rows`` (``on_path``: whether each one is on the path): ``depths``, the
    distinct depths of its checkpoints on the path, ascending, each with the probability of
    the predicted points it serves (``predicted``); ``end``, the depth serving the end (-1:
    none). Compiled: in Python it cost ~2 us a checkpoint, every time its session changes."""
    for k in range(rows.shape[0]):
        row = rows[k]
        depth = int(table[row, DEPTH])
        at = np.searchsorted(depths, depth, side="left")
        held_here = at < depths.shape[0] and depths[at] == depth
        table[row, ON_PATH] = 1.0 if on_path[k] else 0.0
        table[row, PREDICTED] = predicted[at] if held_here else 0.0
        table[row, SERVES_END] = 1.0 if depth == end else 0.0
        table[row, SAVED] = tokens_saved(depth, base_depth, depths[at - 1] if at > 0 else 0)


def _row(checkpoint: CheckpointId) -> int:
    return 2 * checkpoint.slot + (checkpoint.tier is Tier.HOST)


class HeldValues:
    """What each held checkpoint is worth, kept for the planner's clock tick: computed for
    every checkpoint when the clock moves, and for one session's when it changes."""

    def __init__(self, records: Mapping[CheckpointId, Record], sessions: Mapping[str, Session], stream: StreamStats):
        self._records, self._sessions, self._stream = records, sessions, stream
        self._table = np.zeros((0, COLUMNS))
        self._values = np.zeros(0)
        self._live = np.zeros(0, dtype=bool)
        self._checkpoints: list[Optional[CheckpointId]] = []  # by row
        # By session index: its quantities for the clock tick of the values; its rows, of
        # those its own checkpoints' and its shared-path ones' (which its followers' restores
        # add to).
        self._quantities = SessionQuantities(sessions, stream)
        self._rows_of: dict[int, set[int]] = {}
        self._own_rows_of: dict[int, set[int]] = {}
        self._path_rows_of: dict[int, set[int]] = {}
        self._clock: Optional[int] = None
        # Since the values were computed: sessions changed (their counters and own rows are
        # read again and all their rows valued), sessions whose checkpoints alone changed
        # (their own rows are read again and valued), rows added or changed (valued again).
        self._changed: set[int] = set()
        self._paths_changed: set[int] = set()
        self._changed_rows: set[int] = set()
        # Sessions whose per-request quantities are those of their counters at this clock.
        self._current: set[int] = set()

    # ---- what the planner tells ----

    def added(self, checkpoint: CheckpointId) -> None:
        """The planner recorded ``checkpoint`` (``records[checkpoint]``)."""
        record = self._records[checkpoint]
        row = _row(checkpoint)
        if row >= self._live.shape[0]:
            self._grow(row + 1)
        session = self._quantities.index_of(record.session)
        if session is None:
            session = self._quantities.add(record.session)
            self._changed.add(session)  # its counters are read with the next values
        self._live[row] = True
        self._checkpoints[row] = checkpoint
        self._rows_of.setdefault(session, set()).add(row)
        shared = record.purpose in SHARED_PURPOSES
        if not shared:
            self._own_rows_of.setdefault(session, set()).add(row)
            self._paths_changed.add(session)  # its own columns are read with its session's
        elif record.purpose is Purpose.SHARED_PATH:
            self._path_rows_of.setdefault(session, set()).add(row)
        self._table[row] = 0.0
        self._table[row, SESSION:HINT + 1] = (
            session, shared, record.purpose is Purpose.BRANCH, record.purpose is Purpose.HINT)
        self._table[row, DEPTH] = record.depth
        self.record_changed(checkpoint)

    def record_changed(self, checkpoint: CheckpointId) -> None:
        """``records[checkpoint]``'s age, uses or span changed."""
        record, row = self._records[checkpoint], _row(checkpoint)
        self._table[row, CREATED:SPAN + 1] = (record.created, record.uses, record.span)
        self._changed_rows.add(row)

    def dropped(self, checkpoint: CheckpointId) -> None:
        """The planner dropped ``checkpoint``'s record (and says whether its session changed:
        one on the session's path did, one off it leaves every other value as it was)."""
        row = _row(checkpoint)
        session = int(self._table[row, SESSION])
        self._live[row] = False
        self._values[row] = 0.0
        self._checkpoints[row] = None
        self._changed_rows.discard(row)
        for rows_of in (self._rows_of, self._own_rows_of, self._path_rows_of):
            rows = rows_of.get(session)
            if rows is not None:
                rows.discard(row)
                if not rows:
                    del rows_of[session]

    def moved(self, old: CheckpointId, new: CheckpointId) -> None:
        """The record of ``old`` is now ``records[new]``."""
        self.dropped(old)
        self.added(new)

    def changed(self, session: str) -> None:
        """``session``'s counters, predictions or sequence changed: its checkpoints' values
        are computed again."""
        index = self._quantities.index_of(session)
        if index is not None:
            self._changed.add(index)

    def path_changed(self, session: str) -> None:
        """A checkpoint on ``session``'s path was recorded or dropped: what its own
        checkpoints' depths are worth to its restore points is read again (its counters, so
        its shared checkpoints' values, are as they were)."""
        index = self._quantities.index_of(session)
        if index is not None:
            self._paths_changed.add(index)

    def forgotten(self, session: str) -> None:
        """The planner forgot ``session``, which holds no checkpoint: its index serves the
        next new session."""
        index = self._quantities.forget(session)
        if index is None:
            return
        for pending in (self._changed, self._paths_changed, self._current):
            pending.discard(index)

    # ---- values ----

    def value(self, checkpoint: CheckpointId) -> float:
        """Computed again only if a change since the last computation can have moved it: the
        clock, its record, or for an own checkpoint its session (a session's state is read by
        its own checkpoints' values only, until the clock moves)."""
        row = _row(checkpoint)
        session = int(self._table[row, SESSION])
        stale = (self._clock != self._stream.clock or row in self._changed_rows
                 or (self._table[row, SHARED] == 0.0 and (session in self._changed or session in self._paths_changed)))
        if stale:
            self._refresh()
        return float(self._values[row])

    def lowest(self, count: int) -> np.ndarray:
        """The ``count`` lowest held values (all of them if fewer are held), lowest first.
        Admission reads no more than one per candidate: sorting a thousand to read a few cost
        ~20 us a request."""
        self._refresh()
        values = self._values[self._live]
        if count < values.shape[0]:
            values = np.partition(values, count - 1)[:count] if count > 0 else values[:0]
        return np.sort(values)

    def by_device_slot(self, num_slots: int) -> np.ndarray:
        """Device checkpoints' values indexed by slot; 0 for a slot holding none."""
        self._refresh()
        by_slot = np.zeros(num_slots)
        device = self._values[0::2][:num_slots]
        by_slot[: device.shape[0]] = device
        return by_slot

    def _refresh(self) -> None:
        for session in self._changed:
            self._quantities.read(session)
            self._current.discard(session)
        for session in self._changed | self._paths_changed:
            if session in self._own_rows_of:
                self._read_own_rows(session)
        if self._clock != self._stream.clock:
            self._clock = self._stream.clock
            self._current.clear()
            rows = np.flatnonzero(self._live)
            sessions = list(self._rows_of)
        else:
            changed = [session for session in self._changed if session in self._rows_of]
            row_set = {row for session in changed for row in self._rows_of[session]} | self._changed_rows
            row_set.update(row for session in self._paths_changed for row in self._own_rows_of.get(session, ()))
            rows = np.fromiter(sorted(row_set), dtype=np.int64, count=len(row_set))
            sessions = sorted({int(self._table[row, SESSION]) for row in row_set})
        self._changed.clear()
        self._paths_changed.clear()
        self._changed_rows.clear()
        if not sessions:
            return
        outdated = [session for session in sessions if session not in self._current]
        if outdated:
            self._quantities.compute(np.array(outdated, dtype=np.int64), self._clock)
            self._current.update(outdated)
        self._evaluate(rows, sessions)

    def _evaluate(self, rows: np.ndarray, sessions: list[int]) -> None:
        stream, quantities = self._stream, self._quantities
        _value_rows(self._table, rows, quantities.gap, quantities.edit_weight, quantities.appends, quantities.edit,
                    quantities.alive, self._clock, restore_horizon(stream), shared_prior(Purpose.SHARED_PATH, stream),
                    shared_prior(Purpose.BRANCH, stream), self._values)
        # Plus, for a leader's shared-path checkpoints, what its followers will restore. Only
        # the few sessions holding such checkpoints are asked whether they lead: asking each
        # of a thousand slots' ~64 sessions cost ~25 us a request.
        leaders = [index for index in sessions if index in self._path_rows_of and quantities.session(index).followers]
        if leaders:
            evaluated = np.zeros(self._live.shape[0], dtype=bool)
            evaluated[rows] = True
            for index in leaders:
                for row in sorted(self._path_rows_of[index]):
                    if evaluated[row]:
                        record = self._records[self._checkpoints[row]]
                        owner = self._sessions[record.session]
                        self._values[row] += followed_value(owner, record, self._sessions, stream)

    # ---- reading the planner's sessions ----

    def _read_own_rows(self, index: int) -> None:
        """What the session's own checkpoints' depths are worth to its restore points
        (``valuation.RestoreShares``)."""
        session = self._quantities.session(index)
        on_path, checkpoints = session.on_path, self._checkpoints
        shares = restore_shares(session, on_path.values())
        rows = list(self._own_rows_of[index])
        _read_restore_shares(
            self._table, np.array(rows, dtype=np.int64),
            np.array([checkpoints[row] in on_path for row in rows], dtype=bool),
            np.array(shares.depths, dtype=np.int64),
            np.array([shares.predicted.get(depth, 0.0) for depth in shares.depths], dtype=np.float64),
            -1 if shares.end is None else shares.end, session.base_depth)

    def _grow(self, rows: int) -> None:
        old = self._live.shape[0]
        size = max(rows, 2 * old, 128)
        self._table = np.concatenate([self._table, np.zeros((size - old, COLUMNS))])
        self._values = np.concatenate([self._values, np.zeros(size - old)])
        self._live = np.concatenate([self._live, np.zeros(size - old, dtype=bool)])
        self._checkpoints.extend([None] * (size - old))

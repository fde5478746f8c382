"""What a checkpoint is worth: expected recomputed prompt tokens it saves (docs/architecture.md,
"Planning quantities"). Every function here reads the planner's state and returns a number;
none writes any.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Mapping, Optional, Sequence

from sglang_hybrid.cache.planning import CheckpointId
from sglang_hybrid.planning.state import PRIOR_EDITS, SHARED_PURPOSES, Purpose, Record, Session, StreamStats


def checkpoint_value(
    record: Record, checkpoint: Optional[CheckpointId], sessions: Mapping[str, Session], stream: StreamStats,
    planned: Sequence[int] = (),
) -> float:
    """Expected recomputed tokens saved by ``record``'s checkpoint: held in ``checkpoint``, or a
    candidate when ``checkpoint`` is None, beside the session's checkpoints at depths
    ``planned`` (already admitted for the same request)."""
    session = sessions[record.session]
    return (own_value(session, record, checkpoint, stream, planned)
            + followed_value(session, record, sessions, stream))


def own_value(session: Session, record: Record, checkpoint: Optional[CheckpointId], stream: StreamStats,
              planned: Sequence[int] = ()) -> float:
    """What the checkpoint saves the requests it was taken for: its session's next ones,
    or for a shared one, any session's."""
    depth, purpose, created = record.depth, record.purpose, record.created
    gap = mean_gap(session, stream)
    if purpose in SHARED_PURPOSES:
        # Serves other sessions: worth its span (what a restore from it saves over the
        # shared checkpoint before it) per use, at the rate it has been used since it was
        # taken. A branch point has been passed by two sessions already: its taking counts
        # as one use; a shared-path message start, as the fraction of those that are used.
        prior = 1.0 if purpose is Purpose.BRANCH else (stream.shared_uses + 1) / (stream.shared_taken + 2)
        rate = (record.uses + prior) / (stream.clock - created + gap)
        return record.span * min(1.0, rate * gap)
    if checkpoint is not None and checkpoint not in session.on_path:
        return 0.0
    others = sorted([*(d for held, d in session.on_path.items() if held != checkpoint), *planned])
    probability = restore_credit(session, depth, others, stream)
    if purpose is Purpose.HINT:
        # The client says an edit will land here: trust it as much as the session's edits.
        probability = max(probability, edit_probability(session, stream))
    if probability <= 0.0:
        return 0.0
    saved = depth - session.base_depth
    if purpose is Purpose.CONTINUATION:
        # A request that only appends falls back to the session's next shallower checkpoint
        # (its prompt tail, mostly): the continuation saves only the tokens in between.
        saved = depth - max([session.base_depth, *(d for d in others if d < depth)])
    return probability * alive(session, gap, stream.clock) * max(saved, 1)


def followed_value(session: Session, record: Record, sessions: Mapping[str, Session], stream: StreamStats) -> float:
    """What ``session``'s shared-path checkpoint is expected to save the sessions following
    it: one that ends the last message a follower shares with it, taken after the request
    the follower repeated, is where the follower's next prompt leaves the leader's if
    their next messages differ (as often as followers in that state were seen to)."""
    if record.purpose is not Purpose.SHARED_PATH or not session.followers:
        return 0.0
    probability = 0.0
    for name, follow in session.followers.items():
        if record.created > follow.lead_clock and record.message == follow.message:
            follower = sessions[name]
            parted = (stream.follow_parted[follow.whole] + 1) / (stream.follow_seen[follow.whole] + 2)
            probability += parted * alive(follower, mean_gap(follower, stream), stream.clock)
    return min(probability, 1.0) * max(record.depth - session.base_depth, 1)


def restore_credit(session: Session, depth: int, others: list[int], stream: StreamStats) -> float:
    """P(the session's next request restores from a checkpoint at ``depth``, ``others`` (sorted)
    being the session's other checkpoints on its path): the restore points -- the predicted
    edit points, and the end of the latest sequence for a request that only appends -- for
    which it is the deepest checkpoint at or before the point."""
    points = dict(session.predictions)
    end = int(session.sequence.shape[0])
    points[end] = points.get(end, 0.0) + 1.0 - edit_probability(session, stream)
    credit = 0.0
    for point, probability in points.items():
        if depth > point:
            continue
        index = bisect_right(others, point) - 1
        if index < 0 or others[index] <= depth:
            credit += probability
    return credit


def edit_probability(session: Session, stream: StreamStats) -> float:
    """P(the session's next request edits its history), the stream's rate as a prior."""
    prior = (stream.edits + 1) / (stream.transitions + 2)
    return (session.edits + PRIOR_EDITS * prior) / (session.transitions + PRIOR_EDITS)


def mean_gap(session: Session, stream: StreamStats) -> float:
    """Requests of any session between two of this session's, the stream's mean as a prior."""
    prior = (stream.gap_total + 1) / (stream.transitions + 1)
    return (session.gap_total + 2 * prior) / (session.transitions + 2)


def alive(session: Session, gap: float, clock: int) -> float:
    """P(the session sends another request), from how long it has been silent: sure
    within twice its usual gap, then falling off as a session that ended would."""
    idle = clock - session.last_clock
    horizon = 2.0 * gap
    return 1.0 if idle <= horizon else (horizon / idle) ** 2

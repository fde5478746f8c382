"""What a checkpoint is worth: expected recomputed prompt tokens it saves (docs/architecture.md,
"Planning quantities"), from its session's rates (``session_rates``) and the pool's share per
session. Every function here reads the planner's state and returns a number; none writes any.

The formulas marked ``register_jitable`` are also compiled (numba) into the loops that value
every held checkpoint at once (``HeldValues``, ``SessionQuantities``): they stay arithmetic on
their arguments, so that both give the same floats.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

from numba.extending import register_jitable

from sglang_hybrid.cache.planning import CheckpointId
from sglang_hybrid.planning.session_rates import (
    alive, append_probability, edit_probability, mean_gap, next_gap, patience, stream_mean_gap,
)
from sglang_hybrid.planning.state import SHARED_PURPOSES, Purpose, Record, Session, StreamStats


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


class OwnOutlook(NamedTuple):
    """What a session's own checkpoint's value reads of the session and the stream, whatever
    its depth (``own_outlook``)."""

    appends: float  # P(the next request only appends), per unit of time
    horizon: float  # ``restore_horizon``
    edit_weight: float  # what a predicted edit point's probability counts for
    edit: float  # P(the next request edits its history)
    alive: float  # P(the session sends another request)


def own_outlook(session: Session, stream: StreamStats) -> OwnOutlook:
    """The session's ``OwnOutlook`` now.

    An append restores from the end state at the session's next request, which comes
    sooner than the stream's mean gap after a tool call (the tool's result is sent back at
    once) and later after an answer (a user types the next turn): the sooner, the more
    requests the slot serves per unit of time. A predicted edit may come later than the next
    request (the one closing a chain of tool calls): how soon counts for it only as far as
    the pool is short of slots (``edit_weight``), and with slots to spare it counts over the
    requests a checkpoint can wait through (``restore_horizon``)."""
    gap, wait, unit = mean_gap(session, stream), next_gap(session, stream), stream_mean_gap(stream)
    return OwnOutlook(append_probability(session, stream) * unit / wait, restore_horizon(stream),
                      edit_weight(unit, wait, scarcity(stream)), edit_probability(session, stream),
                      alive(session, patience(gap, wait), stream))


def own_value(session: Session, record: Record, checkpoint: Optional[CheckpointId], stream: StreamStats,
              planned: Sequence[int] = (), outlook: Optional[OwnOutlook] = None) -> float:
    """What the checkpoint saves the requests it was taken for: its session's next ones,
    or for a shared one, any session's. ``outlook``: the session's ``own_outlook`` now, if
    known (a request's candidates are valued with one)."""
    depth, purpose, created = record.depth, record.purpose, record.created
    if purpose in SHARED_PURPOSES:
        # Serves other sessions: worth its span (what a restore from it saves over the
        # shared checkpoint before it) per use, at the rate it has been used since it was
        # taken, over one of its owner's gaps (the unit of the own values it competes with):
        # a system prompt every session restores from is worth its span once per session.
        # A branch point has been passed by two sessions already: its taking counts as one
        # use; a shared-path message start, as the fraction of those proposed that another
        # session restored from.
        return shared_value(record.span, record.uses, stream.clock - created, shared_prior(purpose, stream),
                            mean_gap(session, stream))
    if checkpoint is not None and checkpoint not in session.on_path:
        return 0.0
    if outlook is None:
        outlook = own_outlook(session, stream)
    shares = restore_shares(session, [*session.on_path.values(), *planned, depth])
    probability = shares.probability(depth, outlook.appends, outlook.horizon, outlook.edit_weight)
    if purpose is Purpose.HINT:
        # The client says an edit will land here: trust it as much as the session's edits.
        probability = max(probability, outlook.edit)
    if probability <= 0.0:
        return 0.0
    return probability * outlook.alive * tokens_saved(depth, session.base_depth, shares.below(depth))


def shared_prior(purpose: Purpose, stream: StreamStats) -> float:
    """The uses a checkpoint serving other sessions counts before any: one for a branch point
    (two sessions passed it), for a shared-path message start the fraction of those proposed
    that another session restored from."""
    if purpose is Purpose.BRANCH:
        return 1.0
    return (stream.shared_followed + 1) / (stream.shared_proposed + 2)


@register_jitable
def shared_value(span, uses, age, prior, gap):
    """What a checkpoint serving other sessions saves in one of its owner's gaps: its span per
    use, at the rate it was used (``uses`` in the ``age`` requests since it was taken, ``prior``
    more). Scalars or arrays alike: a request's candidates are valued in bulk with the same
    operations."""
    return span * ((uses + prior) / (age + gap)) * gap


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
            follower_patience = patience(mean_gap(follower, stream), next_gap(follower, stream))
            probability += parted * alive(follower, follower_patience, stream)
    return min(probability, 1.0) * max(record.depth - session.base_depth, 1)


@dataclass(frozen=True)
class RestoreShares:
    """How a session's checkpoint depths divide its next restore points -- the predicted
    edit points, and the end of its latest sequence for a request that only appends --
    each point going to the deepest depth at or before it. A function of the depths, the
    predictions and the sequence alone, so a caller may keep it until one of them changes."""

    predicted: dict[int, float]  # depth -> P of the predicted edit points it serves
    end: Optional[int]  # the depth serving the end, if any
    depths: tuple[int, ...]  # the distinct depths, ascending

    def probability(self, depth: int, append_probability: float, horizon: float, edit_weight: float) -> float:
        """P(the session's next request restores from a checkpoint at ``depth``)
        (``restore_probability``)."""
        return restore_probability(self.predicted.get(depth, 0.0), depth == self.end, append_probability, horizon,
                                   edit_weight)

    def below(self, depth: int) -> int:
        """The deepest depth shallower than ``depth`` (0 if none)."""
        index = bisect_left(self.depths, depth) - 1
        return self.depths[index] if index >= 0 else 0


def restore_shares(session: Session, depths: Iterable[int]) -> RestoreShares:
    ordered = tuple(sorted(set(depths)))
    predicted: dict[int, float] = {}
    for point, probability in session.predictions.items():
        index = bisect_right(ordered, point) - 1
        if index >= 0:
            predicted[ordered[index]] = predicted.get(ordered[index], 0.0) + probability
    index = bisect_right(ordered, int(session.sequence.shape[0])) - 1
    return RestoreShares(predicted, ordered[index] if index >= 0 else None, ordered)


@register_jitable
def restore_probability(predicted, serves_end, append_probability, horizon, edit_weight):
    """P(a session's next request restores from a checkpoint): ``predicted``, the probability
    of the predicted edit points it serves, counted over ``horizon`` requests
    (``within_horizon``) and weighed by ``edit_weight``, plus ``append_probability`` if it
    ``serves_end`` of the latest sequence."""
    return within_horizon(predicted, horizon) * edit_weight + (append_probability if serves_end else 0.0)


@register_jitable
def tokens_saved(depth, base_depth, below):
    """Tokens a checkpoint at ``depth`` saves a restore: without it, the restore falls back to
    the session's next shallower checkpoint (at ``below``) or to its base; at least 1."""
    return max(depth - max(base_depth, below), 1)


def pool_share(stream: StreamStats) -> float:
    """The checkpoint pool's slots per active session: the stream's mean gap is the number of
    sessions active (between two requests of one session, each other active session sends
    one)."""
    return stream.pool_slots / stream_mean_gap(stream)


def scarcity(stream: StreamStats) -> float:
    """How far the pool is from a slot per active session: 0 with one for each, 1 with one
    for every two sessions or fewer."""
    return min(max(2.0 - 2.0 * pool_share(stream), 0.0), 1.0)


def restore_horizon(stream: StreamStats) -> float:
    """The requests of its session a checkpoint can expect to wait through in the pool: the
    next one, or, with more slots than sessions active, one per slot each session has."""
    return max(1.0, pool_share(stream))


@register_jitable
def within_horizon(probability, horizon):
    """P(a point predicted at ``probability`` per request is restored within ``horizon``
    requests): ``1 - (1 - p)^h`` for small ``p`` and exact at ``p`` = 0 or 1 and ``h`` = 1,
    as ``p h / (1 + p (h - 1))`` -- arithmetic only, so compiled it gives the same floats
    (a compiled ``**`` may differ from Python's in the last bit). A rule that edits one request in
    several (a condensation, a rewritten memory block) is worth a slot a session holds for
    that many requests."""
    return probability * horizon / (1.0 + probability * (horizon - 1.0))


@register_jitable
def edit_weight(stream_gap, next_gap, scarcity):
    """What a predicted edit point's probability counts for in a checkpoint's value. With a
    slot for every active session, all of it: the checkpoint is worth its restores however long
    it waits for them. With fewer, a slot is worth what it saves per unit of time, the
    stream's mean gap (``stream_gap``): a slot held for a session that comes back late (a user
    typing the next turn, ``next_gap`` requests away) is one the sessions coming back sooner
    (running tool calls) lack, and a slot held for one of those serves more restores in the
    same time. Its worth per unit of time is ``stream_gap / next_gap`` of what it saves, and
    the value moves toward that rate as the pool's ``scarcity`` grows."""
    return 1.0 - scarcity * (1.0 - stream_gap / next_gap)


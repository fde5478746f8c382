"""CheckpointPlanner: which depths of a request get a recurrent-state checkpoint, under a budget
(docs/architecture.md, "Planning quantities").

A checkpoint is worth its slot only if a later request restores from it, and a later request
restores from the deepest checkpoint at or before the point where it leaves the tree. The
points reached again:

* the end of the request, from which an append-only continuation restores (the cache keeps
  the generation-end state), and the prompt tail ``len(prompt) - 1``, from which an
  identical repeat does;
* where the session's next request *edits* its history (a masked observation, an answer
  re-rendered without its reasoning, a rewritten memory block), learned online from where
  the session's and the stream's past edits landed (``edit_points``, ``edit_model``,
  ``addresses``), and once the request's output is known, from where edits after outputs
  that ended alike did;
* branch points, where a request leaves a path other requests share (a system prompt common
  to all sessions);
* shared paths: the message starts of content a request computes first, for the sessions
  that follow it (trials of one task, forked conversations: ``following``) and leave it in
  some later message.

One value function, the *expected recomputed tokens a checkpoint saves* -- P(a request
restores from it) x the tokens it saves over the next shallower checkpoint -- ranks the
candidates for admission and the held checkpoints for eviction (``valuation``,
``held_values``, ``admission``).

Every decision is a deterministic function of the request stream: the clock is the number of
requests planned, no randomness, no wall time, and no iteration over hash-ordered containers,
so tensor-parallel ranks running their own planner agree.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from sglang_hybrid.anchors.detector import Anchors
from sglang_hybrid.cache.planning import CheckpointId
from sglang_hybrid.planning.addresses import AnchorIndex, Prefill
from sglang_hybrid.planning.admission import Candidates, SharedCandidates, admit, propose
from sglang_hybrid.planning.edit_points import EditPoints
from sglang_hybrid.planning.ends import SessionEnds
from sglang_hybrid.planning.following import PrefixProducers, follow
from sglang_hybrid.planning.held_values import HeldValues
from sglang_hybrid.planning.state import (
    FORGET_AFTER_GAPS, FORGET_SWEEP_REQUESTS, SHARED_PURPOSES, CheckpointPlan, PromptDigests,
    Purpose, Record, RequestContext, Session, StreamStats,
)
from sglang_hybrid.planning.session_rates import mean_gap
from sglang_hybrid.planning.valuation import followed_value, own_outlook, own_value, shared_prior, shared_value
from sglang_hybrid.tokens import common_prefix_length


class CheckpointPlanner:
    """Plans checkpoints per request and values held checkpoints for eviction.

    The budget it plans for is the cache's checkpoint pool: ``RequestContext.free_slots`` and
    the checkpoints it has recorded. Use (``AnchorPlanning`` does, for the cache): ``plan(ctx)``
    at admission (it also learns from the request); capture the returned depths during
    prefill; ``record_checkpoint`` each checkpoint that holds one of the request's states (the
    staged ones, and once it finished the generation-end one); ``forget`` the checkpoints the
    cache reports free; ``value`` a held checkpoint for eviction; ``move_record`` when the
    cache moves one between tiers. A checkpoint is known by its ``CheckpointId``.
    """

    def __init__(
        self,
        *,
        predictions_per_request: int = 6,
        model_capacity: int = 16,
        learning_rate: float = 0.3,
    ):
        self.stream = StreamStats()
        self.sessions: dict[str, Session] = {}
        self.records: dict[CheckpointId, Record] = {}
        self.edit_points = EditPoints(predictions_per_request=predictions_per_request, model_capacity=model_capacity,
                                      learning_rate=learning_rate)
        self._producers = PrefixProducers()
        # Every held checkpoint's value, for admission against a full pool and for eviction.
        self._held = HeldValues(self.records, self.sessions, self.stream)
        self._ends = SessionEnds()

    @property
    def clock(self) -> int:
        """Requests planned: the planner's only notion of time."""
        return self.stream.clock

    # ---- planning ----

    def plan(self, ctx: RequestContext) -> CheckpointPlan:
        self.stream.clock += 1
        self.stream.pool_slots = ctx.pool_slots
        if self.clock % FORGET_SWEEP_REQUESTS == 0:
            self._forget_idle_sessions(sending=ctx.session)
        self._ends.presume_ended(self.sessions, self.stream)
        prompt_len = int(ctx.prompt_ids.shape[0])
        session = self.sessions.get(ctx.session)
        own_prefix = 0
        if session is None:
            session = self.sessions[ctx.session] = Session(last_clock=self.clock)
            session.base_depth = ctx.restored_depth
        else:
            own_prefix = self._learn_transition(session, ctx.prompt_ids)
            session.ended = False  # it came back after all
        if ctx.restored is not None and ctx.restored in self.records:
            restored = self.records[ctx.restored]
            restored.uses += 1
            self._held.record_changed(ctx.restored)
            if restored.purpose is Purpose.SHARED_PATH and restored.session != ctx.session and not restored.followed:
                restored.followed = True
                self.stream.shared_followed += 1
        follow(self._producers, ctx.session, ctx.prompt_ids, ctx.anchors, own_prefix, ctx.namespace, self.sessions,
               self.stream)

        index = AnchorIndex(ctx.anchors, prompt_len)
        session.predictions = self.edit_points.planned(session, self.stream, index)
        # Until the request finishes, its prompt is what the session's next request follows.
        session.sequence, session.index = ctx.prompt_ids, index
        session.prefills.append(Prefill(ctx.restored_depth, prompt_len, index))
        session.last_clock = self.clock
        self._held.changed(ctx.session)

        candidates = propose(ctx, session.predictions, own_prefix)
        session.planned_spans = dict(zip(candidates.shared_depths, candidates.shared_spans))
        self.stream.shared_proposed += candidates.shared_paths
        outlook = own_outlook(session, self.stream)
        return CheckpointPlan(admit(
            candidates.own, self._shared_candidates(ctx.session, candidates),
            lambda depth, purpose, planned: own_value(
                session, self._new_record(ctx.session, depth, purpose), None, self.stream, planned, outlook),
            ctx.free_slots, self._held.lowest,
        ), session.digests)  # fmt: skip

    def _learn_transition(self, session: Session, prompt: np.ndarray) -> int:
        """Learn from how this prompt continues the session's previous request; return the
        length of their common prefix."""
        previous = session.sequence
        common = common_prefix_length(previous, prompt)
        session.transitions += 1
        self.stream.transitions += 1
        ending, session.ending = session.ending, None  # this request's output is not known yet
        self._ends.returned(session, self.stream)
        session.transitions_after[ending] += 1
        self.stream.transitions_after[ending] += 1
        session.on_path = {checkpoint: depth for checkpoint, depth in session.on_path.items() if depth <= common}
        gap = self.clock - session.last_clock
        session.gap_total += gap
        self.stream.gap_total += gap
        session.gaps_after[ending] += gap
        self.stream.gaps_after[ending] += gap
        # The previous request's final state covers all but its last output token, so a
        # prompt that keeps at least that much is a continuation, not an edit.
        if common < previous.shape[0] - 1 and common > 0:
            session.edits += 1
            self.stream.edits += 1
            session.edits_after[ending] += 1
            self.stream.edits_after[ending] += 1
            # A prompt that repeats the previous one up to its end can restore at most from its
            # own last token.
            self.edit_points.learn(session, min(common, prompt.shape[0] - 1), ending)
        return common

    def _shared_candidates(self, session: str, candidates: Candidates) -> SharedCandidates:
        """The candidates serving other sessions, valued at once (a new content's message
        starts come by the hundred): ``checkpoint_value`` of each as a new record."""
        owner = self.sessions[session]
        depths, purposes = candidates.shared_depths, candidates.shared_purposes
        priors = np.full(len(depths), shared_prior(Purpose.SHARED_PATH, self.stream))
        priors[: len(depths) - candidates.shared_paths] = shared_prior(Purpose.BRANCH, self.stream)
        values = shared_value(np.array(candidates.shared_spans, dtype=np.float64), 0, 0, priors,
                              mean_gap(owner, self.stream))
        if owner.followers:
            values = values + np.array([
                followed_value(owner, self._new_record(session, depth, purpose), self.sessions, self.stream)
                for depth, purpose in zip(depths, purposes)])
        return SharedCandidates(depths, purposes, values)

    # ---- bookkeeping after a request ----

    def request_finished(self, session: str, sequence: np.ndarray, anchors: Anchors, ending: int,
                         closing: Optional[tuple[int, ...]], prompt_digests: Optional[PromptDigests]) -> None:
        """``session``'s request left ``sequence`` in the tree (prompt + the output its state
        covers; ``anchors`` detected on it; its output ended with ``ending``,
        ``AnchorDetector.output_ending``, and with the tokens ``closing``, its last
        ``CLOSING_TOKENS``, None if it had none; ``prompt_digests``: its plan's, None if not
        known): the session's next request is compared with it, expected to append as often as
        requests after such an output did, and to come at all as often as sessions did after
        an output closing alike."""
        owner = self.sessions.get(session)
        if owner is None:
            raise KeyError(f"session {session!r} was never planned")
        owner.sequence, owner.index = sequence, AnchorIndex(anchors, int(sequence.shape[0]))
        owner.digests = prompt_digests
        owner.ending, owner.closing = ending, closing
        owner.predictions = self.edit_points.after_output(owner, self.stream)
        self._ends.finished(session, owner, self.stream)
        self._held.changed(session)

    def end_session(self, session: str) -> None:
        """``session``'s client says it sends no more requests: its own checkpoints are
        worth nothing from now (those serving other sessions keep their value), so they are
        evicted first. A request it sends after all opens it again. A session never planned
        is ignored: it holds nothing."""
        owner = self.sessions.get(session)
        if owner is None or owner.ended:
            return
        owner.ended = True
        self._ends.closed(session, owner, self.clock)
        self._held.changed(session)
        if owner.following is not None:
            # Its leader's shared-path checkpoints were worth what it would restore from them.
            self._held.changed(owner.following.leader)

    def _forget_idle_sessions(self, sending: str) -> None:
        """Forget the sessions that hold no checkpoint and ended or fell silent
        (``FORGET_AFTER_GAPS``), but the one ``sending`` a request, and every follow relation
        naming them."""
        holding = {record.session for record in self.records.values()}
        idle = [name for name, session in self.sessions.items() if name not in holding and name != sending and (
            session.ended or self.clock - session.last_clock > FORGET_AFTER_GAPS * mean_gap(session, self.stream))]
        for name in idle:
            session = self.sessions.pop(name)
            if session.following is not None and session.following.leader in self.sessions:
                self.sessions[session.following.leader].followers.pop(name, None)
            for follower in session.followers:
                if follower in self.sessions:
                    self.sessions[follower].following = None
            self._held.forgotten(name)

    def record_checkpoint(self, checkpoint: CheckpointId, session: str, depth: int, purpose: Purpose) -> None:
        """``checkpoint`` now holds ``session``'s checkpoint at ``depth`` (taken for ``purpose``)."""
        owner = self.sessions.get(session)
        if owner is None:
            raise KeyError(f"session {session!r} was never planned")
        self._drop_record(checkpoint)
        self.records[checkpoint] = self._new_record(session, depth, purpose)
        owner.on_path[checkpoint] = depth
        self._held.added(checkpoint)

    def _new_record(self, session: str, depth: int, purpose: Purpose) -> Record:
        """The record of a checkpoint ``session``'s latest request takes (or would take)."""
        owner = self.sessions[session]
        span = owner.planned_spans.get(depth, depth) if purpose in SHARED_PURPOSES else 0
        message = owner.planned_messages.get(depth, 0) if purpose is Purpose.SHARED_PATH else 0
        return Record(session, depth, purpose, self.clock, span=span, message=message)

    def move_record(self, old: CheckpointId, new: CheckpointId) -> None:
        """The checkpoint held in ``old`` now sits in ``new`` (the cache moved it
        between its tiers): its record -- uses, age, place on its session's path -- follows
        (its depth, so what its session's restore shares are, does not change)."""
        record = self.records.pop(old, None)
        self._drop_record(new)
        if record is None:
            return
        self.records[new] = record
        session = self.sessions[record.session]
        if old in session.on_path:
            session.on_path[new] = session.on_path.pop(old)
        self._held.moved(old, new)

    def forget(self, free: Iterable[CheckpointId]) -> None:
        """Drop what the planner knows about slots the cache reports free (evicted, or a
        capture that never reached the tree)."""
        for checkpoint in free:
            self._drop_record(checkpoint)

    def _drop_record(self, checkpoint: CheckpointId) -> None:
        record = self.records.pop(checkpoint, None)
        if record is None:
            return
        self._held.dropped(checkpoint)
        if self.sessions[record.session].on_path.pop(checkpoint, None) is not None:
            self._held.path_changed(record.session)

    # ---- valuation ----

    def value(self, checkpoint: CheckpointId, depth: int) -> float:
        """Expected tokens saved by keeping this checkpoint (the cache evicts the lowest).

        A checkpoint the planner does not know (or knows at another depth) is worth nothing.
        """
        record = self.records.get(checkpoint)
        if record is None or record.depth != depth:
            return 0.0
        return self._held.value(checkpoint)

    def device_values(self, num_slots: int) -> np.ndarray:
        """What keeping each device checkpoint is worth, indexed by slot (0: a slot holding
        none the planner knows of)."""
        return self._held.by_device_slot(num_slots)

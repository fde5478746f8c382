"""CheckpointPlanner: which depths of a request get a recurrent-state checkpoint, under a budget.

A checkpoint is worth its slot only if a later request restores from it, and a later request
restores from the deepest checkpoint at or before the point where it leaves the tree. Three
kinds of points are reached again:

* the end of the request (append-only continuation): the cache keeps the generation-end state
  on finish; the planner keeps ``len(prompt) - 1`` as well, so an identical repeat
  recomputes one token;
* where the session's next request will *edit* its history (observation masking, stripped
  reasoning, a rewritten memory block). Edits follow a rule of the agent framework, so the
  planner learns the rule online: each past edit point (first divergence vs the session's
  previous request) is described in several coordinate systems -- absolute position, n-th
  anchor from the start, n-th anchor of a kind (or n-th message of any role) from the end, n-th
  anchor of a kind after the last user message -- and every description is scored by how well
  it would have predicted the edits that followed. A session's own scores are blended with the
  stream's (weighted as PRIOR_EDITS edits), so a session that has shown one rule still expects
  the others the stream shows. The best descriptions, evaluated on the current request, give
  the depths the next edit needs;
* branch points, where a request leaves a path other requests share (a system prompt common to
  all sessions): a checkpoint at the shared anchor there serves every later session;
* shared paths: the message starts of content a request computes first, for other sessions
  that follow it (trials of one task, forked conversations) and leave it in some message;
* where a session following another parts from it: trials of one task, run one after
  another, send the same prompts until their outputs differ. The planner remembers which
  request first sent each prompt prefix ending at a message start, so a request that repeats
  another session's prompt (whole, or up to a message start) names the session it follows.
  Its next request shares the leader's next prompt up to the end of the last message the two
  share, or of one more: the leader's shared-path checkpoints there are worth what the
  follower will restore from them, at the rate followers were seen to part so.

Budget: one value function, *expected recomputed tokens saved* = P(the next request that can
use it does) x the tokens it saves over the session's next shallower checkpoint (or its shared
base) -- for checkpoints that serve other sessions,
their use rate x what they save over the shared checkpoint before them -- ranks candidates for
admission and held checkpoints for eviction (the cache's planning ``value``), so
a flood of message-start checkpoints never pushes out the continuation states the next turns
need; and a message start displaces a held checkpoint only if it is worth its capture
(``CAPTURE_COST_TOKENS``) more, so fresh ones do not churn through older ones.

Every decision is a deterministic function of the request stream: the clock is the number of
requests planned, no randomness, no wall time, and no iteration over hash-ordered containers,
so tensor-parallel ranks running their own planner agree.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Optional

import numpy as np

from sglang_hybrid.anchors.detector import AnchorKind, Anchors
from sglang_hybrid.cache.planning import CheckpointId
from sglang_hybrid.planning.addresses import AnchorIndex, Prefill
from sglang_hybrid.planning.admission import SharedCandidates, admit, propose
from sglang_hybrid.planning.edit_model import EditModel
from sglang_hybrid.planning.following import PrefixProducers, prefix_digests
from sglang_hybrid.planning.held_values import HeldValues
from sglang_hybrid.planning.state import (
    ENDED_AFTER_GAPS, FORGET_AFTER_GAPS, FORGET_SWEEP_REQUESTS, PRIOR_EDITS, SHARED_PURPOSES, CheckpointPlan, Purpose,
    Record, RequestContext, Session, StreamStats,
)
from sglang_hybrid.planning.valuation import (
    checkpoint_value, edit_probability, followed_value, mean_gap, shared_prior, shared_value,
)


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
        self.predictions_per_request = predictions_per_request
        self.stream = StreamStats()
        self.sessions: dict[str, Session] = {}
        self.records: dict[CheckpointId, Record] = {}
        self._model_capacity = model_capacity
        self._learning_rate = learning_rate
        # Stream-wide edit model: the prior for sessions with little history.
        self.global_model = EditModel(model_capacity, learning_rate)
        self._producers = PrefixProducers()
        # Every held checkpoint's value, for admission against a full pool and for eviction.
        self._held = HeldValues(self.records, self.sessions, self.stream)
        # (clock past which a session counts as ended, the clock of its latest request, its
        # name), a heap: one entry per finished request, stale once the session sends another.
        self._silences: list[tuple[float, int, str]] = []

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
        self._presume_ended()
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
        self._follow(ctx, session)

        index = AnchorIndex(ctx.anchors, prompt_len)
        if session.model is not None:
            # The session's own edits count as many times as it has shown; the stream's rule
            # weighs as PRIOR_EDITS of them.
            predicted = session.model.predict(index, self.predictions_per_request, self.global_model,
                                              PRIOR_EDITS / session.edits)
        else:
            predicted = self.global_model.predict(index, self.predictions_per_request)
        session.predictions = {
            depth: probability * edit_probability(session, self.stream) for depth, probability in predicted.items()
        }
        # Until the request finishes, its prompt is what the session's next request follows.
        session.sequence, session.index = ctx.prompt_ids, index
        session.prefills.append(Prefill(ctx.restored_depth, prompt_len, index))
        session.last_clock = self.clock
        self._held.changed(ctx.session)

        candidates = propose(ctx, session.predictions, own_prefix)
        session.planned_spans = candidates.spans
        self.stream.shared_proposed += candidates.shared_paths
        own = [(depth, purpose) for depth, purpose in candidates.proposed if purpose not in SHARED_PURPOSES]
        shared = self._shared_candidates(ctx.session, [c for c in candidates.proposed if c[1] in SHARED_PURPOSES])
        return CheckpointPlan(admit(
            own, shared, lambda depth, purpose, planned: self._candidate_value(ctx.session, depth, purpose, planned),
            ctx.free_slots, self._held.ascending,
        ))  # fmt: skip

    def _follow(self, ctx: RequestContext, session: Session) -> None:
        """Find the session this prompt follows (``PrefixProducers.leader``), learn how the
        previous prompt's follow state went on, and remember this prompt's prefixes."""
        prompt_len = int(ctx.prompt_ids.shape[0])
        starts = [int(d) for d in ctx.anchors.of_kind(AnchorKind.MESSAGE_START).tolist() if 0 < d < prompt_len]
        digests, session.planned_messages = prefix_digests(ctx.prompt_ids, [*starts, prompt_len])
        follow = self._producers.leader(ctx.session, starts, digests, session.planned_messages)
        if follow is not None and follow.leader not in self.sessions:
            follow = None  # the session it repeats was forgotten
        before = session.following
        if before is not None:
            self.stream.follow_seen[before.whole] += 1
            if follow is not None and follow.leader == before.leader and not follow.whole:
                self.stream.follow_parted[before.whole] += 1
            self.sessions[before.leader].followers.pop(ctx.session, None)
        session.following = follow
        if follow is not None:
            self.sessions[follow.leader].followers[ctx.session] = follow
        self._producers.remember(digests, ctx.session, self.clock)

    def _learn_transition(self, session: Session, prompt: np.ndarray) -> int:
        """Learn from how this prompt continues the session's previous request; return the
        length of their common prefix."""
        previous = session.sequence
        n = min(previous.shape[0], prompt.shape[0])
        # The first difference alone: after an early edit every later token differs, and
        # listing them all costs a buffer the size of the prompt.
        differs = previous[:n] != prompt[:n]
        first = int(differs.argmax()) if n else 0
        common = first if n and differs[first] else n
        session.transitions += 1
        self.stream.transitions += 1
        ending, session.ending = session.ending, None  # this request's output is not known yet
        closing, session.closing = session.closing, None
        if closing is not None:
            self.stream.closings.count(closing, 1, -1 if session.presumed_ended else 0)
            session.presumed_ended = False
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
            if session.model is None:
                session.model = EditModel(self._model_capacity, self._learning_rate)
            # A prompt that repeats the previous one up to its end can restore at most from its
            # own last token.
            restorable = min(common, prompt.shape[0] - 1)
            session.model.observe(session.index, restorable, self.global_model, session.prefills)
            self.global_model.observe(session.index, restorable, None, session.prefills)
        return common

    def _shared_candidates(self, session: str, candidates: list[tuple[int, Purpose]]) -> SharedCandidates:
        """The candidates serving other sessions, valued at once (a new content's message
        starts come by the hundred): ``checkpoint_value`` of each as a new record."""
        owner = self.sessions[session]
        spans = np.array([owner.planned_spans.get(depth, depth) for depth, _ in candidates], dtype=np.float64)
        prior = {purpose: shared_prior(purpose, self.stream) for purpose in SHARED_PURPOSES}
        priors = np.array([prior[purpose] for _, purpose in candidates])
        values = shared_value(spans, 0, 0, priors, mean_gap(owner, self.stream))
        if owner.followers:
            values = values + np.array([
                followed_value(owner, self._new_record(session, depth, purpose), self.sessions, self.stream)
                for depth, purpose in candidates])
        return SharedCandidates([depth for depth, _ in candidates], [purpose for _, purpose in candidates], values)

    def _candidate_value(self, session: str, depth: int, purpose: Purpose, planned: list[int]) -> float:
        return checkpoint_value(self._new_record(session, depth, purpose), None, self.sessions, self.stream, planned)

    # ---- bookkeeping after a request ----

    def request_finished(self, session: str, sequence: np.ndarray, anchors: Anchors, ending: int,
                         closing: Optional[tuple[int, ...]]) -> None:
        """``session``'s request left ``sequence`` in the tree (prompt + the output its state
        covers; ``anchors`` detected on it; its output ended with ``ending``,
        ``AnchorDetector.output_ending``, and with the tokens ``closing``, its last
        ``CLOSING_TOKENS``, None if it had none): the session's next request is compared
        with it, expected to append as often as requests after such an output did, and to
        come at all as often as sessions did after an output closing alike."""
        owner = self.sessions.get(session)
        if owner is None:
            raise KeyError(f"session {session!r} was never planned")
        owner.sequence, owner.index = sequence, AnchorIndex(anchors, int(sequence.shape[0]))
        owner.ending, owner.closing = ending, closing
        if closing is not None:
            deadline = owner.last_clock + ENDED_AFTER_GAPS * mean_gap(owner, self.stream)
            heapq.heappush(self._silences, (deadline, owner.last_clock, session))
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
        # Counted ended at the next request, with the silent ones: the stream's counters move
        # only with the clock, when the held values read them again.
        heapq.heappush(self._silences, (float(self.clock), owner.last_clock, session))
        self._held.changed(session)
        if owner.following is not None:
            # Its leader's shared-path checkpoints were worth what it would restore from them.
            self._held.changed(owner.following.leader)

    def _presume_ended(self) -> None:
        """Count in the stream's end rates the sessions silent past their deadline since
        their latest request (``ENDED_AFTER_GAPS``), or closed by their client."""
        while self._silences and self._silences[0][0] < self.clock:
            _, last_clock, name = heapq.heappop(self._silences)
            session = self.sessions.get(name)
            if (session is None or session.last_clock != last_clock or session.presumed_ended
                    or session.closing is None):
                continue  # forgotten, back since, or counted already
            session.presumed_ended = True
            self.stream.closings.count(session.closing, 0, 1)

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

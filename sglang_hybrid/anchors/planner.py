"""CheckpointPlanner: which depths of a request get a recurrent-state checkpoint, under a budget.

A checkpoint is worth its slot only if a later request restores from it, and a later request
restores from the deepest checkpoint at or before the point where it leaves the tree. Three
kinds of points are reached again:

* the end of the request (append-only continuation): the cache keeps the generation-end state
  on finish; the planner keeps ``len(prompt) - 1`` as well, so an identical repeat (or a
  re-rendered output) recomputes one token;
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
use it does) x (depth - the session's shared base) -- for checkpoints that serve other sessions,
their use rate x what they save over the shared checkpoint before them -- ranks candidates for
admission and held checkpoints for eviction (the cache's planning ``value``), so
a flood of message-start checkpoints never pushes out the continuation states the next turns
need.

Every decision is a deterministic function of the request stream: the clock is the number of
requests planned, no randomness, no wall time, and no iteration over hash-ordered containers,
so tensor-parallel ranks running their own planner agree.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Iterable, Optional, Sequence

import numpy as np

from sglang_hybrid.anchors.detector import AnchorKind, Anchors, Role
from sglang_hybrid.anchors.hints import HintMode, ValidatedHint
from sglang_hybrid.cache.planning import CheckpointId


# How many of a session's own requests the stream-wide statistics (edit rate, edit rule) weigh
# as, before the session has shown its own.
PRIOR_EDITS = 2
# Prompt prefixes (at message starts) whose first producer the planner remembers, to tell which
# session a request follows; the oldest are forgotten first.
MAX_REMEMBERED_PREFIXES = 1 << 16


class Purpose(IntEnum):
    """Why a checkpoint was taken; it decides how its value is estimated."""

    CONTINUATION = 0  # the generation-end state a request leaves on finish
    PROMPT_TAIL = 1  # len(prompt) - 1: identical repeats, re-rendered outputs
    PREDICTED_EDIT = 2  # where the session's next edit is predicted
    BRANCH = 3  # where requests leave a path shared with other requests
    HINT = 4  # a client-requested position
    SHARED_PATH = 5  # a message start of new content other sessions may follow and leave later


# Checkpoints taken for other sessions' requests rather than the owner's next one.
_SHARED = (Purpose.BRANCH, Purpose.SHARED_PATH)


@dataclass(frozen=True)
class RequestContext:
    """What the planner needs to know about one request at admission.

    ``anchors`` come from ``AnchorDetector.detect(prompt_ids)``. The request's output does
    not exist yet when it is planned (a server plans its prefill); what it leaves in the tree
    is told to the planner with ``request_finished``.
    ``tree_lcp`` is how many prompt tokens the tree's KV already holds; ``held_depths`` the
    depths of checkpoints on that path; ``restored_depth``/``restored`` what the cache's
    match restored (0/None for none); ``free_slots`` how many checkpoint slots are unused.
    """

    session: str
    prompt_ids: np.ndarray
    anchors: Anchors
    tree_lcp: int
    held_depths: Sequence[int]
    restored_depth: int
    restored: Optional[CheckpointId]
    free_slots: int
    hint: Optional[ValidatedHint] = None


@dataclass(frozen=True)
class PlannedCheckpoint:
    depth: int
    purpose: Purpose
    value: float  # expected recomputed tokens saved, the admission criterion


@dataclass(frozen=True)
class CheckpointPlan:
    """Checkpoints to capture during the request's prefill, sorted by depth, all in
    (restored depth, len(prompt)]."""

    checkpoints: tuple[PlannedCheckpoint, ...]

    @property
    def depths(self) -> list[int]:
        return [c.depth for c in self.checkpoints]


# ---- edit-point coordinates ----
#
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


class _AnchorIndex:
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


class _EditModel:
    """Addresses of past edit points, scored by how often each named the restore point of the
    edits that followed.

    Shares form a distribution over the addresses (ties split an edit's credit), so several
    rules mixing in one session -- a masked observation on tool turns, a re-rendered answer on
    user turns -- each keep the probability of their own edits.
    """

    def __init__(self, capacity: int, learning_rate: float):
        self.capacity = capacity
        self.learning_rate = learning_rate
        # Address -> running frequency with which it named the checkpoint an edit would
        # restore from: the deepest point at or before the edit among all addresses scored.
        self.shares: dict[Address, float] = {}

    def observe(self, index: _AnchorIndex, edit_point: int, prior: Optional["_EditModel"]) -> None:
        """Learn from one edit: the request diverged from the sequence ``index`` describes at
        ``edit_point``."""
        reached = {address: index.position_of(address) for address in self.shares}
        usable = [depth for depth in reached.values() if depth is not None and depth <= edit_point]
        best = max(usable, default=None)
        winners = sum(1 for depth in usable if depth == best)
        for address, share in self.shares.items():
            target = 1.0 / winners if best is not None and reached[address] == best else 0.0
            self.shares[address] = share + self.learning_rate * (target - share)
        new = [address for address in index.addresses_of(edit_point) if address not in self.shares]
        for address in new:
            # A description of the edit just seen has predicted nothing yet: it starts at the
            # stream-wide share of that description, else at zero, so shares stay frequencies
            # (summing to at most one) and a description earns weight only by predicting.
            self.shares[address] = prior.shares.get(address, 0.0) if prior is not None else 0.0
        excess = len(self.shares) - self.capacity
        if excess > 0:
            # The descriptions just added have not competed yet: drop the weakest of the others
            # (the oldest first among equals).
            veterans = [address for address in self.shares if address not in new]
            weakest = sorted(range(len(veterans)), key=lambda i: (self.shares[veterans[i]], i))[:excess]
            for i in weakest:
                del self.shares[veterans[i]]

    def predict(
        self, index: _AnchorIndex, limit: int, prior: Optional["_EditModel"] = None, prior_weight: float = 0.0
    ) -> dict[int, float]:
        """Depth -> probability that the next edit restores from a checkpoint there, for the
        ``limit`` most likely depths, evaluated on ``index``.

        With a ``prior`` the shares are ``prior_weight`` parts the prior's to one part this
        model's: a session that has shown one edit rule may still follow another the stream
        shows (a rewritten answer on every call as well as a moved block on user turns).
        """
        predictions: dict[int, float] = {}
        mine = 1.0 / (1.0 + prior_weight) if prior is not None else 1.0
        sources = [(self.shares, mine)]
        if prior is not None:
            sources.append((prior.shares, 1.0 - mine))
        for shares, weight in sources:
            for address, share in shares.items():
                depth = index.position_of(address)
                if depth is None or depth <= 0 or share <= 0.0:
                    continue
                predictions[depth] = predictions.get(depth, 0.0) + weight * share
        ranked = sorted(predictions.items(), key=lambda item: (-item[1], item[0]))[:limit]
        return {depth: min(probability, 1.0) for depth, probability in ranked}


@dataclass
class _Record:
    session: str
    depth: int
    purpose: Purpose
    created: int
    uses: int = 0
    # BRANCH, SHARED_PATH: tokens a restore from it saves over the shared checkpoint before it
    # (for a message start, the one of the message before).
    span: int = 0
    # SHARED_PATH: digest of the message that ends at the checkpoint.
    message: bytes = b""


@dataclass
class _Follow:
    """A session whose latest prompt repeats another's: trials of one task, run one after
    another, replay the same conversation until their outputs differ."""

    leader: str
    lead_clock: int  # the leader's request whose prompt it repeated (wholly or in part)
    whole: bool  # the whole prompt, or up to a message start
    # Digest of the last message the two share: the leader's later prompts hold it too (a
    # sliding window moves it, not away), and the follower's next prompt leaves the leader's
    # at its end if their next messages differ.
    message: bytes


@dataclass
class _Session:
    last_clock: int
    sequence: Optional[np.ndarray] = None  # prompt + output of the latest request
    index: Optional[_AnchorIndex] = None
    transitions: int = 0  # requests that followed an earlier request of the session
    edits: int = 0  # of those, requests that diverged before the earlier request's end
    gap_total: int = 0  # requests of any session between consecutive requests of this one
    base_depth: int = 0  # shared-prefix depth the session started from
    continuation: Optional[CheckpointId] = None
    # Checkpoint -> depth of the session's checkpoints on its current path: those before its last
    # edit point. The others can only serve a request that undoes an edit.
    on_path: dict[CheckpointId, int] = field(default_factory=dict)
    # Depth -> P(the next request's edit restores from a checkpoint at that depth).
    predictions: dict[int, float] = field(default_factory=dict)
    model: Optional[_EditModel] = None
    # Depth -> span of the SHARED_PATH checkpoints of the latest plan, until recorded.
    planned_spans: dict[int, int] = field(default_factory=dict)
    # Depth -> digest of the message ending there, for the latest plan's message starts.
    planned_messages: dict[int, bytes] = field(default_factory=dict)
    following: Optional[_Follow] = None
    followers: dict[str, _Follow] = field(default_factory=dict)


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
        self.clock = 0
        self.sessions: dict[str, _Session] = {}
        self.records: dict[CheckpointId, _Record] = {}
        self._model_capacity = model_capacity
        self._learning_rate = learning_rate
        # Stream-wide edit model and rates: the prior for sessions with little history.
        self.global_model = _EditModel(model_capacity, learning_rate)
        self.transitions = 0
        self.edits = 0
        self.gap_total = 0
        # SHARED_PATH checkpoints recorded, and restores from them by other sessions: how often
        # the stream's sessions follow each other's new content.
        self.shared_taken = 0
        self.shared_uses = 0
        # Digest of a prompt prefix ending at a message start (or of a whole prompt) -> the
        # session and clock of the request that sent it first.
        self._prefix_producers: OrderedDict[bytes, tuple[str, int]] = OrderedDict()
        # Whether a follower had repeated its leader's whole prompt -> its next requests seen,
        # and of those, the ones that left the same leader's prompt at a message start.
        self.follow_seen = {True: 0, False: 0}
        self.follow_parted = {True: 0, False: 0}
        # Held checkpoint -> its value, until the planner's state next changes: an eviction
        # scan values every held checkpoint, and consecutive evictions see the same state.
        self._held_values: dict[CheckpointId, float] = {}

    # ---- planning ----

    def plan(self, ctx: RequestContext) -> CheckpointPlan:
        self._held_values.clear()
        self.clock += 1
        prompt_len = int(ctx.prompt_ids.shape[0])
        session = self.sessions.get(ctx.session)
        own_prefix = 0
        if session is None:
            session = self.sessions[ctx.session] = _Session(last_clock=self.clock)
            session.base_depth = ctx.restored_depth
        else:
            own_prefix = self._learn_transition(session, ctx.prompt_ids)
        if ctx.restored is not None and ctx.restored in self.records:
            restored = self.records[ctx.restored]
            restored.uses += 1
            if restored.purpose is Purpose.SHARED_PATH and restored.session != ctx.session:
                self.shared_uses += 1
        # The previous continuation state was just consumed (or bypassed by an edit); the one
        # this request leaves replaces it once recorded.
        session.continuation = None
        self._follow(ctx, session)

        index = _AnchorIndex(ctx.anchors, prompt_len)
        if session.model is not None:
            # The session's own edits count as many times as it has shown; the stream's rule
            # weighs as PRIOR_EDITS of them.
            predicted = session.model.predict(index, self.predictions_per_request, self.global_model,
                                              PRIOR_EDITS / session.edits)
        else:
            predicted = self.global_model.predict(index, self.predictions_per_request)
        session.predictions = {
            depth: probability * self._edit_probability(session) for depth, probability in predicted.items()
        }
        # Until the request finishes, its prompt is what the session's next request follows.
        session.sequence, session.index = ctx.prompt_ids, index
        session.last_clock = self.clock

        candidates = self._candidates(ctx, session, prompt_len, own_prefix)
        return CheckpointPlan(self._admit(candidates, ctx))

    def _follow(self, ctx: RequestContext, session: _Session) -> None:
        """Find the session whose earlier prompt this one repeats beyond its first message (a
        system prompt many sessions share): the one that first sent the deepest prefix
        ending at a message start, or the whole prompt. Learn how the previous prompt's
        follow state went on, and remember this prompt's prefixes."""
        prompt_len = int(ctx.prompt_ids.shape[0])
        starts = [int(d) for d in ctx.anchors.of_kind(AnchorKind.MESSAGE_START).tolist() if 0 < d < prompt_len]
        boundaries = [*starts, prompt_len]
        digests, session.planned_messages = self._prefix_digests(ctx.prompt_ids, boundaries)

        follow = None
        matched = 0
        while matched < len(digests) and digests[matched] in self._prefix_producers:
            matched += 1
        if matched >= 2:
            leader, lead_clock = self._prefix_producers[digests[matched - 1]]
            whole = matched == len(digests)
            last_shared = starts[-1] if whole else boundaries[matched - 1]
            if leader != ctx.session:
                follow = _Follow(leader, lead_clock, whole, session.planned_messages[last_shared])

        before = session.following
        if before is not None:
            self.follow_seen[before.whole] += 1
            if follow is not None and follow.leader == before.leader and not follow.whole:
                self.follow_parted[before.whole] += 1
            self.sessions[before.leader].followers.pop(ctx.session, None)
        session.following = follow
        if follow is not None:
            self.sessions[follow.leader].followers[ctx.session] = follow
        self._remember_prefixes(digests, ctx.session)

    @staticmethod
    def _prefix_digests(prompt: np.ndarray, boundaries: list[int]) -> tuple[list[bytes], dict[int, bytes]]:
        """Digests of the prompt's prefixes ending at ``boundaries``, and depth -> digest of
        the message ending there (for each boundary but the prompt's end)."""
        prefix = hashlib.blake2b(digest_size=16)
        digests, messages = [], {}
        previous = 0
        for depth in boundaries:
            chunk = prompt[previous:depth].tobytes()
            prefix.update(chunk)
            digests.append(prefix.digest())
            if depth < prompt.shape[0]:
                messages[depth] = hashlib.blake2b(chunk, digest_size=16).digest()
            previous = depth
        return digests, messages

    def _remember_prefixes(self, digests: list[bytes], session: str) -> None:
        for digest in digests:
            if digest in self._prefix_producers:
                self._prefix_producers.move_to_end(digest)
            else:
                self._prefix_producers[digest] = (session, self.clock)
        while len(self._prefix_producers) > MAX_REMEMBERED_PREFIXES:
            self._prefix_producers.popitem(last=False)

    def _learn_transition(self, session: _Session, prompt: np.ndarray) -> int:
        """Learn from how this prompt continues the session's previous request; return the
        length of their common prefix."""
        previous = session.sequence
        n = min(previous.shape[0], prompt.shape[0])
        differ = np.flatnonzero(previous[:n] != prompt[:n])
        common = int(differ[0]) if differ.size else n
        session.transitions += 1
        self.transitions += 1
        session.on_path = {checkpoint: depth for checkpoint, depth in session.on_path.items() if depth <= common}
        gap = self.clock - session.last_clock
        session.gap_total += gap
        self.gap_total += gap
        # The previous request's final state covers all but its last output token, so a
        # prompt that keeps at least that much is a continuation, not an edit.
        if common < previous.shape[0] - 1 and common > 0:
            session.edits += 1
            self.edits += 1
            if session.model is None:
                session.model = _EditModel(self._model_capacity, self._learning_rate)
            session.model.observe(session.index, common, self.global_model)
            self.global_model.observe(session.index, common, None)
        return common

    def _candidates(
        self, ctx: RequestContext, session: _Session, prompt_len: int, own_prefix: int
    ) -> list[tuple[int, Purpose]]:
        hint = ctx.hint
        if hint is not None and hint.mode is HintMode.NONE:
            return []
        lowest = ctx.restored_depth
        held = set(int(d) for d in ctx.held_depths)
        candidates: dict[int, Purpose] = {}

        def propose(depth: int, purpose: Purpose) -> None:
            if lowest < depth <= prompt_len and depth not in held and depth not in candidates:
                candidates[depth] = purpose

        if hint is not None and hint.mode is HintMode.EXPLICIT:
            for depth in hint.positions.tolist():
                propose(int(depth), Purpose.HINT)
        if hint is not None and hint.mode is HintMode.MESSAGES:
            for depth in ctx.anchors.of_kind(AnchorKind.MESSAGE_START).tolist():
                propose(int(depth), Purpose.HINT)
        propose(prompt_len - 1, Purpose.PROMPT_TAIL)
        for depth in sorted(session.predictions):
            # A predicted point in the output or at the prompt end is covered by the
            # prompt-tail and generation-end states.
            if depth < prompt_len - 1:
                propose(depth, Purpose.PREDICTED_EDIT)
        session.planned_spans = {}
        branch = self._branch_depth(ctx, prompt_len, own_prefix)
        if branch is not None and branch not in candidates:
            propose(branch, Purpose.BRANCH)
            session.planned_spans[branch] = branch - max([lowest, *(d for d in held if d < branch)])
        # Content this request computes first may be followed by other sessions (trials of one
        # task, forks of a conversation) that leave it somewhere later: a checkpoint at each
        # new message start bounds what such a request recomputes to the message it leaves in.
        # Only messages complete in the prompt: the last start opens the generation prompt,
        # whose content is the output, and a request that shares the prompt up to there
        # restores from the prompt tail.
        starts = ctx.anchors.of_kind(AnchorKind.MESSAGE_START).tolist()
        for previous, depth in zip(starts, starts[1:-1]):
            if depth > max(lowest, ctx.tree_lcp) and depth < prompt_len - 1 and depth not in candidates:
                propose(depth, Purpose.SHARED_PATH)
                session.planned_spans[depth] = depth - max(previous, lowest)
        return sorted(candidates.items())

    @staticmethod
    def _branch_depth(ctx: RequestContext, prompt_len: int, own_prefix: int) -> Optional[int]:
        """Where this prompt leaves a path it shares with *other* requests, if it does.

        Checkpointed at the deepest anchor at or before the divergence: sessions that share a
        system prompt part ways a few tokens into their first message, at a different token
        each, but all of them pass the message start.
        """
        shared = min(ctx.tree_lcp, prompt_len - 1)
        if shared <= max(ctx.restored_depth, own_prefix):
            return None
        anchor = ctx.anchors.last_at_or_before(shared)
        if anchor is not None and anchor > max(ctx.restored_depth, own_prefix):
            return anchor
        return shared

    def _admit(self, candidates: list[tuple[int, Purpose]], ctx: RequestContext) -> tuple[PlannedCheckpoint, ...]:
        valued = [
            PlannedCheckpoint(depth, purpose, self._value(self._new_record(ctx.session, depth, purpose), None))
            for depth, purpose in candidates
        ]
        free = ctx.free_slots
        held_values = sorted(self.value(checkpoint, record.depth) for checkpoint, record in self.records.items())
        admitted = []
        # Most valuable first: each admission without a free slot displaces the least valuable
        # held checkpoint, which is then no longer the bar for the next one.
        for checkpoint in sorted(valued, key=lambda c: (-c.value, c.depth)):
            if checkpoint.purpose in (Purpose.PROMPT_TAIL, Purpose.HINT):
                admitted.append(checkpoint)
            elif free > 0:
                if checkpoint.value > 0.0:
                    admitted.append(checkpoint)
            elif held_values and checkpoint.value > held_values[0]:
                admitted.append(checkpoint)
                held_values.pop(0)
            else:
                continue
            free -= 1
        return tuple(sorted(admitted, key=lambda c: c.depth))

    # ---- bookkeeping after a request ----

    def request_finished(self, session: str, sequence: np.ndarray, anchors: Anchors) -> None:
        """``session``'s request left ``sequence`` in the tree (prompt + the output its state
        covers; ``anchors`` detected on it): the session's next request is compared with it."""
        owner = self.sessions.get(session)
        if owner is None:
            raise KeyError(f"session {session!r} was never planned")
        self._held_values.clear()
        owner.sequence, owner.index = sequence, _AnchorIndex(anchors, int(sequence.shape[0]))

    def record_checkpoint(self, checkpoint: CheckpointId, session: str, depth: int, purpose: Purpose) -> None:
        """``checkpoint`` now holds ``session``'s checkpoint at ``depth`` (taken for ``purpose``)."""
        owner = self.sessions.get(session)
        if owner is None:
            raise KeyError(f"session {session!r} was never planned")
        self._held_values.clear()
        self._drop_record(checkpoint)
        self.records[checkpoint] = self._new_record(session, depth, purpose)
        if purpose is Purpose.SHARED_PATH:
            self.shared_taken += 1
        owner.on_path[checkpoint] = depth
        if purpose is Purpose.CONTINUATION:
            owner.continuation = checkpoint

    def _new_record(self, session: str, depth: int, purpose: Purpose) -> _Record:
        """The record of a checkpoint ``session``'s latest request takes (or would take)."""
        owner = self.sessions[session]
        span = owner.planned_spans.get(depth, depth) if purpose in _SHARED else 0
        message = owner.planned_messages.get(depth, b"") if purpose is Purpose.SHARED_PATH else b""
        return _Record(session, depth, purpose, self.clock, span=span, message=message)

    def move_record(self, old: CheckpointId, new: CheckpointId) -> None:
        """The checkpoint held in ``old`` now sits in ``new`` (the cache moved it
        between its tiers): its record -- uses, age, place on its session's path -- follows."""
        self._held_values.clear()
        record = self.records.pop(old, None)
        self._drop_record(new)
        if record is None:
            return
        self.records[new] = record
        session = self.sessions[record.session]
        if old in session.on_path:
            session.on_path[new] = session.on_path.pop(old)
        if session.continuation == old:
            session.continuation = new

    def forget(self, free: Iterable[CheckpointId]) -> None:
        """Drop what the planner knows about slots the cache reports free (evicted, or a
        capture that never reached the tree)."""
        for checkpoint in free:
            self._drop_record(checkpoint)

    def _drop_record(self, checkpoint: CheckpointId) -> None:
        record = self.records.pop(checkpoint, None)
        if record is None:
            return
        self._held_values.clear()
        session = self.sessions[record.session]
        session.on_path.pop(checkpoint, None)
        if session.continuation == checkpoint:
            session.continuation = None

    # ---- valuation ----

    def value(self, checkpoint: CheckpointId, depth: int) -> float:
        """Expected tokens saved by keeping this checkpoint (the cache evicts the lowest).

        A checkpoint the planner does not know (or knows at another depth) is worth nothing.
        """
        record = self.records.get(checkpoint)
        if record is None or record.depth != depth:
            return 0.0
        value = self._held_values.get(checkpoint)
        if value is None:
            value = self._held_values[checkpoint] = self._value(record, checkpoint)
        return value

    def _value(self, record: _Record, checkpoint: Optional[CheckpointId]) -> float:
        """Expected recomputed tokens saved by ``record``'s checkpoint: held in ``checkpoint``, or a
        candidate when ``checkpoint`` is None."""
        session = self.sessions[record.session]
        return self._own_value(session, record, checkpoint) + self._followed_value(session, record)

    def _own_value(self, session: _Session, record: _Record, checkpoint: Optional[CheckpointId]) -> float:
        """What the checkpoint saves the requests it was taken for: its session's next ones,
        or for a shared one, any session's."""
        depth, purpose, created = record.depth, record.purpose, record.created
        gap = self._mean_gap(session)
        if purpose in _SHARED:
            # Serves other sessions: worth its span (what a restore from it saves over the
            # shared checkpoint before it) per use, at the rate it has been used since it was
            # taken. A branch point has been passed by two sessions already: its taking counts
            # as one use; a shared-path message start, as the fraction of those that are used.
            prior = 1.0 if purpose is Purpose.BRANCH else (self.shared_uses + 1) / (self.shared_taken + 2)
            rate = (record.uses + prior) / (self.clock - created + gap)
            return record.span * min(1.0, rate * gap)
        if checkpoint is not None and checkpoint not in session.on_path:
            return 0.0
        edit = self._edit_probability(session)
        probability = self._edit_credit(session, depth, checkpoint)
        if checkpoint is not None and checkpoint == session.continuation:
            probability += 1.0 - edit
        if purpose is Purpose.HINT:
            # The client says an edit will land here: trust it as much as the session's edits.
            probability = max(probability, edit)
        if probability <= 0.0:
            return 0.0
        return probability * self._alive(session, gap) * max(depth - session.base_depth, 1)

    def _followed_value(self, session: _Session, record: _Record) -> float:
        """What ``session``'s shared-path checkpoint is expected to save the sessions following
        it: one that ends the last message a follower shares with it, taken after the request
        the follower repeated, is where the follower's next prompt leaves the leader's if
        their next messages differ (as often as followers in that state were seen to)."""
        if record.purpose is not Purpose.SHARED_PATH or not session.followers:
            return 0.0
        probability = 0.0
        for name, follow in session.followers.items():
            if record.created > follow.lead_clock and record.message == follow.message:
                follower = self.sessions[name]
                parted = (self.follow_parted[follow.whole] + 1) / (self.follow_seen[follow.whole] + 2)
                probability += parted * self._alive(follower, self._mean_gap(follower))
        return min(probability, 1.0) * max(record.depth - session.base_depth, 1)

    @staticmethod
    def _edit_credit(session: _Session, depth: int, checkpoint: Optional[CheckpointId]) -> float:
        """P(the next edit restores from this checkpoint): the predicted edit points for which
        it is the deepest of the session's checkpoints at or before the point."""
        others = sorted(d for s, d in session.on_path.items() if s != checkpoint)
        credit = 0.0
        for point, probability in session.predictions.items():
            if depth > point:
                continue
            index = bisect_right(others, point) - 1
            if index < 0 or others[index] <= depth:
                credit += probability
        return credit

    def _edit_probability(self, session: _Session) -> float:
        """P(the session's next request edits its history), the stream's rate as a prior."""
        prior = (self.edits + 1) / (self.transitions + 2)
        return (session.edits + PRIOR_EDITS * prior) / (session.transitions + PRIOR_EDITS)

    def _mean_gap(self, session: _Session) -> float:
        prior = (self.gap_total + 1) / (self.transitions + 1)
        return (session.gap_total + 2 * prior) / (session.transitions + 2)

    def _alive(self, session: _Session, gap: float) -> float:
        """P(the session sends another request), from how long it has been silent: sure
        within twice its usual gap, then falling off as a session that ended would."""
        idle = self.clock - session.last_clock
        horizon = 2.0 * gap
        return 1.0 if idle <= horizon else (horizon / idle) ** 2

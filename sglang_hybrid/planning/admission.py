"""A request's checkpoint candidates, and which of them are worth a slot (docs/architecture.md,
"Planning quantities": admission). Functions of what they are given; the planner values the
candidates and keeps what they return."""

from __future__ import annotations

from itertools import compress
from typing import Callable, Mapping, NamedTuple, Optional

import numpy as np

from sglang_hybrid.anchors.detector import AnchorKind
from sglang_hybrid.anchors.hints import HintMode
from sglang_hybrid.planning.state import CAPTURE_COST_TOKENS, SHARED_PURPOSES, PlannedCheckpoint, Purpose, RequestContext


class SharedCandidates(NamedTuple):
    """Candidates serving other sessions, valued in bulk (a new content's message starts
    come by the hundred: kept as arrays, a checkpoint made only of those admitted)."""

    depths: list[int]
    purposes: list[Purpose]
    values: np.ndarray


class Candidates(NamedTuple):
    own: list[tuple[int, Purpose]]  # the session's own (depth, purpose), by depth
    # Those serving other sessions: the branch point if any, then new content's message starts
    # by depth, each with its span.
    shared_depths: list[int]
    shared_purposes: list[Purpose]
    shared_spans: list[int]
    shared_paths: int  # how many of them are shared-path message starts


def propose(ctx: RequestContext, predictions: Mapping[int, float], own_prefix: int) -> Candidates:
    """The depths worth considering for the request of ``ctx``: a client's hint, the prompt
    tail, the session's predicted edit points, where the prompt leaves a path other requests
    share, the message starts of content it computes first. ``own_prefix``: the tokens it
    shares with its session's previous request."""
    hint = ctx.hint
    if hint is not None and hint.mode is HintMode.NONE:
        return Candidates([], [], [], [], 0)
    prompt_len = int(ctx.prompt_ids.shape[0])
    lowest = ctx.restored_depth
    held = set(int(d) for d in ctx.held_depths)
    own: dict[int, Purpose] = {}

    def open_at(depth: int) -> bool:
        """Whether a checkpoint at ``depth`` is new: inside the prefill, neither held nor
        proposed already."""
        return lowest < depth <= prompt_len and depth not in held and depth not in own

    def propose_own(depth: int, purpose: Purpose) -> None:
        if open_at(depth):
            own[depth] = purpose

    if hint is not None and hint.mode is HintMode.EXPLICIT:
        for depth in hint.positions.tolist():
            propose_own(int(depth), Purpose.HINT)
    if hint is not None and hint.mode is HintMode.MESSAGES:
        for depth in ctx.anchors.of_kind(AnchorKind.MESSAGE_START).tolist():
            propose_own(int(depth), Purpose.HINT)
    propose_own(prompt_len - 1, Purpose.PROMPT_TAIL)
    # A predicted point in the output lies past the prompt, covered by the generation-end
    # state; one at the prompt tail is proposed already; the prompt end (where a re-rendered
    # output makes the next prompt leave this one) is a point of its own.
    for depth in sorted(predictions):
        propose_own(depth, Purpose.PREDICTED_EDIT)
    shared_depths: list[int] = []
    shared_spans: list[int] = []
    branch = branch_depth(ctx, own_prefix)
    if branch is not None and open_at(branch):
        shared_depths.append(branch)
        shared_spans.append(branch - max([lowest, *(d for d in held if d < branch)]))
    # Content this request computes first may be followed by other sessions (trials of one
    # task, forks of a conversation) that leave it somewhere later: a checkpoint at each
    # new message start bounds what such a request recomputes to the message it leaves in.
    # Only messages complete in the prompt: the last start opens the generation prompt,
    # whose content is the output, and a request that shares the prompt up to there
    # restores from the prompt tail.
    starts = ctx.anchors.of_kind(AnchorKind.MESSAGE_START)
    inner = starts[1:-1]
    new = (inner > max(lowest, ctx.tree_lcp)) & (inner < prompt_len - 1)
    taken = held | own.keys() | set(shared_depths)
    # Spans as arrays, the rest in bulk: a new content's message starts (distinct) come by the
    # hundred.
    depths = inner[new]
    spans = (depths - np.maximum(starts[:-2][new], lowest)).tolist()
    depths = depths.tolist()
    fresh = [depth not in taken for depth in depths]
    shared_depths += compress(depths, fresh)
    shared_spans += compress(spans, fresh)
    shared_paths = sum(fresh)
    return Candidates(sorted(own.items()), shared_depths,
                      [Purpose.BRANCH] * (len(shared_depths) - shared_paths) + [Purpose.SHARED_PATH] * shared_paths,
                      shared_spans, shared_paths)


def branch_depth(ctx: RequestContext, own_prefix: int) -> Optional[int]:
    """Where this prompt leaves a path it shares with *other* requests, if it does.

    Checkpointed at the deepest anchor at or before the divergence: sessions that share a
    system prompt part ways a few tokens into their first message, at a different token
    each, but all of them pass the message start.
    """
    shared = min(ctx.tree_lcp, int(ctx.prompt_ids.shape[0]) - 1)
    if shared <= max(ctx.restored_depth, own_prefix):
        return None
    anchor = ctx.anchors.last_at_or_before(shared)
    if anchor is not None and anchor > max(ctx.restored_depth, own_prefix):
        return anchor
    return shared


def admit(
    own: list[tuple[int, Purpose]],
    shared: SharedCandidates,
    own_value: Callable[[int, Purpose, list[int]], float],
    free_slots: int,
    held_values: Callable[[int], np.ndarray],
) -> tuple[PlannedCheckpoint, ...]:
    """The candidates worth their slot, by depth, admitted most valuable first.

    ``own``: the session's own candidates, valued by ``own_value(depth, purpose, planned)``
    beside the own ones already admitted (two checkpoints before one restore point save what
    the deeper one saves, once); ``shared``: those serving other sessions, valued on their
    own. A candidate must save more than its capture costs (``CAPTURE_COST_TOKENS``): while
    ``free_slots`` last, that alone (the prompt tail takes one unvalued); then more than that
    beyond the lowest held value it would displace (``held_values(n)``: the n lowest, lowest
    first)."""
    own = list(own)
    # Shared candidates, most valuable last (the shallower first among equals).
    order = np.lexsort((-np.asarray(shared.depths, dtype=np.int64), shared.values)).tolist()
    values = shared.values.tolist()
    free = free_slots
    # The held values, read once the free slots are gone; each admission without a free
    # slot displaces the lowest, which is then no longer the bar.
    held: Optional[list[float]] = None
    displaced = 0
    admitted: list[PlannedCheckpoint] = []
    own_valued: list[PlannedCheckpoint] = []
    while own or order:
        if own and not own_valued:
            planned = [c.depth for c in admitted if c.purpose not in SHARED_PURPOSES]
            own_valued = sorted((PlannedCheckpoint(depth, purpose, own_value(depth, purpose, planned))
                                 for depth, purpose in own), key=lambda c: (c.value, -c.depth))
        top = order[-1] if order else None
        if own_valued and (top is None or (own_valued[-1].value, -own_valued[-1].depth)
                           >= (values[top], -shared.depths[top])):
            candidate = own_valued.pop()
            own.remove((candidate.depth, candidate.purpose))
            depth, purpose, value = candidate.depth, candidate.purpose, candidate.value
        else:
            order.pop()
            depth, purpose, value = shared.depths[top], shared.purposes[top], values[top]
        if purpose is Purpose.HINT:
            pass
        elif free > 0:
            # The prompt tail takes a free slot even unvalued, since it serves a repeat no edit
            # model predicts yet.
            if value <= CAPTURE_COST_TOKENS and purpose is not Purpose.PROMPT_TAIL:
                continue
        else:
            if held is None:
                # Each admission displaces at most one: no more can be read than there are
                # candidates.
                held = held_values(len(own) + len(order) + 1).tolist()
            if displaced == len(held) or value <= held[displaced] + CAPTURE_COST_TOKENS:
                # The most valuable candidate left cannot pay for its capture and the least
                # valuable held checkpoint: none can, but a hint.
                if all(purpose is not Purpose.HINT for _, purpose in own):
                    break
                order = _without_shared_paths(order, shared, purpose)
                continue
            displaced += 1
        admitted.append(PlannedCheckpoint(depth, purpose, value))
        free -= 1
        if purpose not in SHARED_PURPOSES:
            own_valued = []  # the own candidates left are valued again beside it
    return tuple(sorted(admitted, key=lambda c: c.depth))


def _without_shared_paths(order: list[int], shared: SharedCandidates, failed: Purpose) -> list[int]:
    """``order`` without its shared-path candidates once one has failed to displace a held
    checkpoint: those left are worth no more and the bar only rises (each admission displaces
    the lowest held value), so each would fail in turn and change nothing. A new content's
    ~100 message starts are dropped at once instead of one by one."""
    if failed is not Purpose.SHARED_PATH:
        return order
    return [index for index in order if shared.purposes[index] is not Purpose.SHARED_PATH]

"""The bounds every comparison is read against: no state reuse, a state at every position, and
a clairvoyant placement under the same budget."""

from __future__ import annotations

import bisect

import numpy as np

from ..prefix_tree import PrefixTree
from .base import Policy, ReplayStep, ServeOutcome


class NoCachePolicy(Policy):
    """Recompute every prompt from scratch: the recurrent state is never cached."""

    name = "none"

    def serve(self, step: ReplayStep) -> ServeOutcome:
        return ServeOutcome(step.prompt_len, 0, step.prompt_len, 0, 0)

    @property
    def slots_in_use(self) -> int:
        return 0


class OraclePolicy(Policy):
    """A checkpoint at every token position, unbounded: reuse = min(KV LCP, len(prompt)-1).

    The budget is ignored. Its slot count is the number of distinct positions in the tree,
    i.e. what holding a state at each of them would take.
    """

    name = "oracle"

    def __init__(self, budget_slots, profile):
        super().__init__(budget_slots, profile)
        self._positions = 0

    def serve(self, step: ReplayStep) -> ServeOutcome:
        reused = step.reuse_limit
        new_positions = step.tree.total_tokens - self._positions
        self._positions = step.tree.total_tokens
        self._note_usage()
        return ServeOutcome(step.prompt_len, reused, step.prompt_len - reused, new_positions, reused)

    @property
    def slots_in_use(self) -> int:
        return self._positions


class ClairvoyantPolicy(Policy):
    """An offline reference with the same budget that knows every future request.

    What it knows: each request's *restore target*, the deepest position it could reuse
    (``reuse_limit``: min(KV LCP, len(prompt)-1)), computed ahead on its own copy of the tree.
    What it does: a request restores from the deepest held checkpoint at or before its target;
    then, among the held checkpoints and the targets of future requests that lie on this
    request's path past its restored depth (like the oracle, at any position its prompt and
    output cover), it keeps the ``budget`` whose next request *targeting
    them exactly* comes soonest (Belady's rule; one never targeted again goes first, ties to
    the shallower, then to the one targeted first). A slot is never emptied without need.

    What it bounds: with unit savings per hit (every restore of an exact target worth the same)
    Belady is optimal, so it is then a lower bound on recomputed tokens for this budget. Here a
    hit saves a request-dependent number of tokens and a non-exact restore still saves some, so
    it is not a proven lower bound: it is the clairvoyant placement a policy that predicted the
    future perfectly would approach. Never below the oracle (same targets, unbounded).
    """

    name = "clairvoyant"

    def __init__(self, budget_slots, profile, requests):
        super().__init__(budget_slots, profile)
        self._requests = list(requests)
        # Per request: its outcome and how many checkpoints are held after it.
        self._outcomes = self._plan(self._requests)
        self._clock = 0

    def _plan(self, requests) -> list[tuple[ServeOutcome, int]]:
        tree = PrefixTree()
        sequences, targets = [], []
        for request in requests:
            sequence = np.concatenate([request.input_ids, request.output_ids])
            view = tree.match(request.input_ids)
            targets.append(min(view.lcp, len(request.input_ids) - 1))
            tree.insert(sequence)
            sequences.append(sequence)
        target_nodes = [tree.node_ending_at(r.input_ids, t) if t > 0 else None for r, t in zip(requests, targets)]
        uses: dict[object, list[int]] = {}
        for clock, node in enumerate(target_nodes):
            if node is not None:
                uses.setdefault(node, []).append(clock)

        # Ties (same next use, same depth: different branches) go by which was targeted first,
        # never by object identity, so the reference is the same in every run.
        first_target = {node: order for order, node in enumerate(uses)}

        def next_use(node, after: int) -> float:
            times = uses.get(node, ())
            index = bisect.bisect_right(times, after)
            return times[index] if index < len(times) else float("inf")

        held: set = set()
        outcomes = []
        for clock, (request, sequence) in enumerate(zip(requests, sequences)):
            prompt_len = len(request.input_ids)
            path = tree.match(sequence).path
            restored = max((n.depth for n in path if n in held and n.depth <= targets[clock]), default=0)
            candidates = [n for n in path if n in uses and n not in held and restored < n.depth]
            pool = sorted([*held, *candidates], key=lambda n: (next_use(n, clock), n.depth, first_target[n]))
            keep = set(pool[:self.budget_slots]) if len(pool) > self.budget_slots else set(pool)
            taken = len(keep - held)
            held = keep
            outcomes.append((ServeOutcome(prompt_len, restored, prompt_len - restored, taken, restored), len(held)))
        return outcomes

    def serve(self, step: ReplayStep) -> ServeOutcome:
        if self._clock >= len(self._requests) or step.request is not self._requests[self._clock]:
            raise ValueError("the clairvoyant policy must be served the requests it was built with, in order")
        outcome, _ = self._outcomes[self._clock]
        self._clock += 1
        self._note_usage()
        return outcome

    @property
    def slots_in_use(self) -> int:
        return self._outcomes[self._clock - 1][1] if self._clock else 0

"""The two bounds every comparison is read against: no state reuse, and a state at every position."""

from __future__ import annotations

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

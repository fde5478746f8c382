"""Marconi (Pan et al., MLSys'25, arXiv 2411.19379; github.com/ruipeterpan/marconi).

Admission: a state is always kept at the last decoded token of each sequence, and, when the
request's insertion creates a new branch node (its prompt leaves the tree in the middle of an
edge), at that branch point, captured during prefill: at most two states per sequence.
Eviction: candidates are checkpointed nodes with at most one child; each gets
    utility = alpha * minmax(flop_efficiency) + minmax(recency)
with flop_efficiency = FLOPs its state saves over restoring from its nearest checkpointed
ancestor / the memory it holds (one state + the KV of the tokens in between), and
recency = 1 / (clock - last use + 1) on the request clock. A hit refreshes every checkpointed
node on the matched path (Marconi builds on SGLang's radix cache, whose match updates the path).
The lowest utility is evicted.
Marconi's tree also evicts KV, so a node's children are the branches still cached below it. Our
replay keeps KV unbounded, where a branch node would keep its children forever and its state
could never be evicted; so "children" counts the branches below a node that still hold
Marconi checkpoints (the tree Marconi's would have shrunk to).

alpha is tuned online as in the paper: alpha = 0 (recency only) until the first eviction; after a
bootstrap window of `bootstrap_multiplier` x the requests seen by then, the window's requests
are replayed on a fresh cache for every alpha of the grid and the best token hit rate wins
(ties -> smaller alpha); the search repeats every window.
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

from ..trace import Request
from .base import NodeCheckpoints, Policy, ReplayStep, ServeOutcome, drive

ALPHA_GRID = tuple(np.round(np.arange(0.0, 2.01, 0.25), 2).tolist())


class MarconiPolicy(Policy):
    name = "marconi"

    def __init__(self, budget_slots, profile, alpha: float | None = None, bootstrap_multiplier: int = 5,
                 alpha_grid: tuple[float, ...] = ALPHA_GRID):
        super().__init__(budget_slots, profile)
        self.checkpoints = NodeCheckpoints(budget_slots)
        self.tune_online = alpha is None
        self.alpha = 0.0 if alpha is None else alpha
        self.bootstrap_multiplier = bootstrap_multiplier
        self.alpha_grid = alpha_grid
        self.window: deque[Request] | None = None  # set at the first eviction
        self.requests_until_tuning = 0
        self.requests_seen = 0
        self._clock = 0

    @property
    def slots_in_use(self) -> int:
        return len(self.checkpoints)

    def _nearest_checkpointed_ancestor_depth(self, node) -> int:
        parent = node.parent
        while parent is not None and parent.depth > 0:
            if parent in self.checkpoints:
                return parent.depth
            parent = parent.parent
        return 0

    def _checkpointed_branches(self) -> dict:
        """Checkpointed node -> how many of its child branches hold checkpoints below it."""
        branches: dict = defaultdict(set)
        for node in self.checkpoints.order:
            child, parent = node, node.parent
            while parent is not None and parent.depth > 0 and parent not in self.checkpoints:
                child, parent = parent, parent.parent
            if parent is not None and parent in self.checkpoints:
                branches[parent].add(child)
        return {node: len(children) for node, children in branches.items()}

    def _choose_victim(self):
        branches = self._checkpointed_branches()
        candidates = [node for node in self.checkpoints.order if branches.get(node, 0) <= 1]
        if not candidates:
            return None
        if self.window is None and self.tune_online:
            self._start_bootstrap()
        model = self.profile.model
        efficiency = np.empty(len(candidates))
        recency = np.empty(len(candidates))
        for i, node in enumerate(candidates):
            parent_depth = self._nearest_checkpointed_ancestor_depth(node)
            span = node.depth - parent_depth
            memory = self.profile.checkpoint_bytes + span * model.kv_bytes_per_token
            efficiency[i] = self.profile.prefill_flops(parent_depth, span) / memory
            recency[i] = 1.0 / (self._clock - self.checkpoints.order[node] + 1)
        utility = self.alpha * _minmax(efficiency) + _minmax(recency)
        return candidates[int(np.argmin(utility))]

    def _start_bootstrap(self) -> None:
        window_len = self.bootstrap_multiplier * max(self.requests_seen, 1)
        self.window = deque(maxlen=window_len)
        self.requests_until_tuning = window_len

    def _tune_alpha(self) -> None:
        requests = list(self.window)
        best_alpha, best_hits = self.alpha, -1
        for alpha in self.alpha_grid:
            trial = MarconiPolicy(self.budget_slots, self.profile, alpha=alpha)
            hits = sum(outcomes[0].cached_tokens for _, outcomes in drive(requests, [trial]))
            if hits > best_hits:
                best_alpha, best_hits = alpha, hits
        self.alpha = best_alpha

    def serve(self, step: ReplayStep) -> ServeOutcome:
        self._clock = step.clock
        node = self.checkpoints.deepest_usable(step.view.path, step.reuse_limit)
        restored = 0
        if node is not None:
            restored = node.depth
            for on_path in step.view.path:
                if on_path.depth <= step.view.lcp and on_path in self.checkpoints:
                    self.checkpoints.touch(on_path, step.clock)
        depths = []
        if step.view.splits_edge and restored < step.view.lcp < step.prompt_len:
            depths.append(step.view.lcp)
        depths.append(step.final_state_depth)
        taken = 0
        for depth in depths:
            taken += self.checkpoints.add(step.tree.node_ending_at(step.sequence, depth), step.clock,
                                          self._choose_victim)
        self._note_usage()
        self.requests_seen += 1
        if self.tune_online and self.window is not None:
            self.window.append(step.request)
            self.requests_until_tuning -= 1
            if self.requests_until_tuning == 0:
                self._tune_alpha()
                self.requests_until_tuning = self.window.maxlen
        return ServeOutcome(step.prompt_len, restored, step.prompt_len - restored, taken, restored)


def _minmax(values: np.ndarray) -> np.ndarray:
    span = values.max() - values.min()
    return (values - values.min()) / span if span > 0 else np.zeros_like(values)

"""Policy interface of the replay, and the checkpoint bookkeeping the tree-based peers share.

Replay semantics (every backend): requests are served one at a time in arrival order; after a
request, its prompt+output tokens are in the KV tree (KV is unbounded); recurrent-state
checkpoints live in one global pool of `budget_slots` slots shared by all sessions; a request
reuses the deepest checkpoint at depth <= min(KV LCP, len(prompt)-1) and recomputes the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Iterator

import numpy as np

from ..cost_model import CostProfile
from ..prefix_tree import MatchView, Node, PrefixTree
from ..trace import Request

# SGLang's and vLLM's default chunked-prefill size (--chunked-prefill-size / max_num_batched_tokens).
PREFILL_CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class ServeOutcome:
    prompt_tokens: int
    cached_tokens: int  # tokens whose recurrent state and KV were reused
    recomputed_tokens: int
    checkpoints_taken: int
    restored_depth: int
    # The restored checkpoint was copied in from host memory (a host tier below the device
    # pool); only a policy with such a tier sets it.
    restored_from_host: bool = False


@dataclass
class ReplayStep:
    """One request as a policy sees it.

    `view` is the KV tree as the request found it; `tree` already holds `sequence`
    (prompt + output), so a policy can pin checkpoints anywhere along it with
    `tree.node_ending_at(sequence, depth)`. `clock` is the request's index in arrival order.
    """

    request: Request
    sequence: np.ndarray
    view: MatchView
    tree: PrefixTree
    clock: int

    @property
    def prompt_len(self) -> int:
        return len(self.request.input_ids)

    @property
    def reuse_limit(self) -> int:
        # The last prompt token is always computed: it produces the first output logits.
        return min(self.view.lcp, self.prompt_len - 1)

    @property
    def final_state_depth(self) -> int:
        """Depth of the recurrent state a request holds when it finishes.

        The last sampled token is never fed back through the model, so the state covers
        prompt + output[:-1]; a request without output ends at its prompt end.
        """
        return self.prompt_len + max(len(self.request.output_ids) - 1, 0)


class Policy(ABC):
    """A checkpoint placement + eviction rule under a budget of `budget_slots` states."""

    name: ClassVar[str]

    def __init__(self, budget_slots: int, profile: CostProfile):
        if budget_slots < 0:
            raise ValueError("budget_slots must be >= 0")
        self.budget_slots = budget_slots
        self.profile = profile
        self.slots_peak = 0

    @abstractmethod
    def serve(self, step: ReplayStep) -> ServeOutcome: ...

    @property
    @abstractmethod
    def slots_in_use(self) -> int: ...

    def _note_usage(self) -> None:
        self.slots_peak = max(self.slots_peak, self.slots_in_use)


def prefill_chunks(start: int, end: int, chunk: int = PREFILL_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """The [begin, end) forwards a chunked prefill of tokens start..end runs."""
    return [(begin, min(begin + chunk, end)) for begin in range(start, end, chunk)]


class NodeCheckpoints:
    """Checkpoints pinned at tree-node ends, in one recency order (oldest first), under a capacity."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.order: OrderedDict[Node, int] = OrderedDict()  # node -> clock of last use

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, node: Node) -> bool:
        return node in self.order

    def deepest_usable(self, path: list[Node], limit: int) -> Node | None:
        for node in reversed(path):
            if node.depth <= limit and node in self.order:
                return node
        return None

    def touch(self, node: Node, clock: int) -> None:
        self.order[node] = clock
        self.order.move_to_end(node)

    def add(self, node: Node, clock: int, choose_victim: Callable[[], Node | None] | None = None) -> bool:
        """Pin a checkpoint at `node`; True if a new slot was filled.

        A node already holding one is only refreshed. When the pool is full, `choose_victim`
        (default: least recently used) names the checkpoint to drop; None means keep all and
        skip this one.
        """
        if node in self.order:
            self.touch(node, clock)
            return False
        if self.capacity == 0:
            return False
        if len(self.order) >= self.capacity:
            victim = choose_victim() if choose_victim else next(iter(self.order))
            if victim is None:
                return False
            del self.order[victim]
        self.order[node] = clock
        return True


def drive(requests: Iterable[Request], policies: list[Policy]) -> Iterator[tuple[ReplayStep, list[ServeOutcome]]]:
    """Serve `requests` in the given order against one shared KV tree; yield each step's outcomes.

    The tree is matched once per request, then the request's prompt+output is inserted, then
    every policy serves it (policies only add checkpoint bookkeeping, so they share the tree).
    """
    tree = PrefixTree()
    for clock, request in enumerate(requests):
        sequence = np.concatenate([request.input_ids, request.output_ids])
        view = tree.match(request.input_ids)
        tree.insert(sequence)
        step = ReplayStep(request, sequence, view, tree, clock)
        yield step, [policy.serve(step) for policy in policies]

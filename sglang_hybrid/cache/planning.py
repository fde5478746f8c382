"""The one interface between the semantic cache and whoever plans its checkpoints.

``SemanticStateCache`` is given a ``CheckpointPlanning`` when it is built (the backend factory,
``plugin.py``, builds it from the config) and makes every call: it asks the planning which
depths of a request to checkpoint and what a held checkpoint is worth, and tells it where each
planned checkpoint was staged, where a checkpoint moved, what a finished request left in the
tree and which request left. The planning never calls the cache; what it needs to know about
the tree arrives in the calls.

A checkpoint is known outside the cache by one name, its ``CheckpointId``: the tier and slot
holding it. It changes when the cache moves the checkpoint between tiers (``moved``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple, Optional, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from sglang_hybrid.anchors.hints import ValidatedHint


class Tier(IntEnum):
    DEVICE = 0  # the checkpoint pool beside the live request states
    HOST = 1  # the host-memory tier below it


class CheckpointId(NamedTuple):
    """Where a held checkpoint is: a slot of the device checkpoint pool or of the host tier."""

    tier: Tier
    slot: int

    @classmethod
    def device(cls, slot) -> "CheckpointId":
        return cls(Tier.DEVICE, int(slot))

    @classmethod
    def host(cls, slot) -> "CheckpointId":
        return cls(Tier.HOST, int(slot))


@dataclass(frozen=True, eq=False)
class RequestToPlan:
    """What the cache knows of a request when its prefill checkpoints are planned: its prompt
    and the tree, not its output."""

    rid: str
    prompt: np.ndarray  # int64 token ids
    session: Optional[str]  # the agent session its client named
    hint: Optional["ValidatedHint"]  # the checkpoints its client asked for
    restored_depth: int  # prompt tokens the restored checkpoint covers (0: none)
    restored: Optional[CheckpointId]  # the checkpoint the request restored
    tree_lcp: int  # prompt tokens whose KV the tree holds
    held_depths: tuple[int, ...]  # depths of the checkpoints on that path
    free_slots: int  # device checkpoint slots unused
    pool_slots: int  # device checkpoint slots in all
    # (LoRA ``extra_key``, ``cache_salt``) that SGLang keys the request's tree path by; None:
    # neither. Requests of different namespaces share no prefix in the tree.
    namespace: Optional[tuple[Optional[str], Optional[str]]] = None


class CheckpointPlanning(Protocol):
    """What the cache asks of its planning and tells it; every call comes from the cache."""

    # Whether eviction follows ``value`` (lowest first) rather than recency.
    evicts_by_value: bool

    def plan(self, request: RequestToPlan) -> Sequence[int]:
        """Depths in (restored depth, len(prompt)] whose state the request's prefill should
        checkpoint, ascending; the cache stages a slot for each while slots last."""

    def staged(self, rid: str, depth: int, checkpoint: CheckpointId) -> None:
        """``checkpoint`` will hold request ``rid``'s state at planned ``depth``."""

    def value(self, checkpoint: CheckpointId, depth: int) -> float:
        """What keeping the checkpoint at ``depth`` is worth; the lowest is evicted first."""

    def device_values(self, num_slots: int) -> np.ndarray:
        """``value`` of every device checkpoint, indexed by slot (0 for a slot holding none
        the planning knows of): an eviction call reads them all once, then asks ``value`` for
        each lowest again, since the victims it takes can raise the others' values."""

    def moved(self, old: CheckpointId, new: CheckpointId) -> None:
        """The cache moved a checkpoint between its tiers."""

    def evicted(self, checkpoint: CheckpointId) -> None:
        """The cache evicted ``checkpoint`` (no host copy kept): the values of the checkpoints
        left can change before the next victim is picked."""

    def finished(
        self,
        rid: str,
        cached: np.ndarray,
        prompt_len: int,
        end: Optional[CheckpointId],
        free: Sequence[CheckpointId],
    ) -> None:
        """Request ``rid`` finished and left ``cached`` in the tree (its prompt of
        ``prompt_len`` tokens and the output its final state covers); ``end`` holds the state
        after all of it; ``free`` are the slots of both tiers that hold no checkpoint now
        (whatever emptied them: an eviction, the KV's eviction, a capture that never reached
        the tree)."""

    def released(self, rid: str) -> None:
        """Request ``rid`` left the cache (finished or aborted)."""

    def session_ended(self, session: str) -> None:
        """The client of agent session ``session`` says it sends no more requests."""

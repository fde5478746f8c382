"""Checkpoint policies compared by the replay, by name (DESIGN.md policy names).

POLICIES maps a name to a factory `(budget_slots, profile) -> Policy`: the peer systems and
the two bounds, simulated on the shared token tree (fast, no SGLang), and `semantic`, ours,
driving the real SGLang-based cache (it imports SGLang only when built).
"""

from __future__ import annotations

from typing import Callable

from ..cost_model import CostProfile
from .base import Policy, ReplayStep, ServeOutcome, drive
from .bounds import NoCachePolicy, OraclePolicy
from .llamacpp import LlamaCppPolicy
from .marconi import MarconiPolicy
from .semantic import SemanticPolicy
from .sglang import SGLangExtraBufferPolicy, SGLangNoBufferPolicy
from .vllm import VLLMAlignPolicy

PolicyFactory = Callable[[int, CostProfile], Policy]

_PEERS = (
    OraclePolicy,
    NoCachePolicy,
    SGLangNoBufferPolicy,
    SGLangExtraBufferPolicy,
    VLLMAlignPolicy,
    LlamaCppPolicy,
    MarconiPolicy,
)
PEER_POLICIES: tuple[str, ...] = tuple(cls.name for cls in _PEERS)
POLICIES: dict[str, PolicyFactory] = {cls.name: cls for cls in (*_PEERS, SemanticPolicy)}


def make_policy(name: str, budget_slots: int, profile: CostProfile) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(budget_slots, profile)


__all__ = ["PEER_POLICIES", "POLICIES", "Policy", "PolicyFactory", "ReplayStep", "ServeOutcome", "drive", "make_policy"]

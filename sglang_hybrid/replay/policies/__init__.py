"""Checkpoint policies compared by the replay, by name (DESIGN.md policy names).

POLICIES maps a name to a factory `(budget_slots, profile) -> Policy`; the `semantic` policy
(ours, driving the real SGLang-based cache) registers itself with `register_policy`.
"""

from __future__ import annotations

from typing import Callable

from ..cost_model import CostProfile
from .base import Policy, ReplayStep, ServeOutcome, drive
from .bounds import NoCachePolicy, OraclePolicy
from .llamacpp import LlamaCppPolicy
from .marconi import MarconiPolicy
from .sglang import SGLangExtraBufferPolicy, SGLangNoBufferPolicy
from .vllm import VLLMAlignPolicy

PolicyFactory = Callable[[int, CostProfile], Policy]

POLICIES: dict[str, PolicyFactory] = {
    cls.name: cls
    for cls in (
        OraclePolicy,
        NoCachePolicy,
        SGLangNoBufferPolicy,
        SGLangExtraBufferPolicy,
        VLLMAlignPolicy,
        LlamaCppPolicy,
        MarconiPolicy,
    )
}
# The peer systems and the two bounds, simulated on the shared token tree (fast, no SGLang).
PEER_POLICIES: tuple[str, ...] = tuple(POLICIES)


def register_policy(name: str, factory: PolicyFactory) -> None:
    if name in POLICIES:
        raise ValueError(f"policy {name!r} is already registered")
    POLICIES[name] = factory


def make_policy(name: str, budget_slots: int, profile: CostProfile) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(budget_slots, profile)


__all__ = ["PEER_POLICIES", "POLICIES", "Policy", "PolicyFactory", "ReplayStep", "ServeOutcome", "drive", "make_policy",
           "register_policy"]
from . import semantic  # noqa: E402,F401  (registers "semantic"; it imports SGLang only when built)

"""Every flag of sglang-hybrid, in one dataclass.

SGLang builds the tree cache inside each scheduler process from its own ``ServerArgs``,
which know nothing of our flags. ``sglang-hybrid launch`` therefore serialises this config
into one environment variable that every child process inherits; the backend factory reads
it back there. Values are validated where they are parsed, so a bad flag fails before the
model loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Optional

from sglang_hybrid.anchors.detector import KNOWN_FAMILIES, NO_ANCHORS

CONFIG_ENV_VAR = "SGLANG_HYBRID_CONFIG"
GIB = 1 << 30
# Checkpoint slots when neither a count nor a memory budget is given; the replay's default
# budget too.
DEFAULT_CHECKPOINT_SLOTS = 64

# Which checkpoints a request gets beyond the end-of-request state the cache always keeps:
# "adaptive" learns where each session's edits land (planning/planner.py), "messages" takes
# one at every detected message start as slots allow, "none" takes no extra ones.
CHECKPOINT_PLANNERS: tuple[str, ...] = ("adaptive", "messages", "none")
# Which checkpoint goes first when the pool is full: least recently restored, or the one
# the adaptive planner expects to save the fewest recomputed tokens.
CHECKPOINT_EVICTIONS: tuple[str, ...] = ("lru", "expected-saving")
# "auto" picks the family from the served model's tokenizer and config; "none" detects
# only prompt and generation ends, which needs no knowledge of the chat template.
AUTO_TEMPLATE_FAMILY = "auto"
ANCHOR_TEMPLATE_FAMILIES: tuple[str, ...] = (AUTO_TEMPLATE_FAMILY, *KNOWN_FAMILIES, NO_ANCHORS)


@dataclass(frozen=True)
class SemanticCacheConfig:
    # Size of the checkpoint pool: a slot count, or a memory budget it is derived from.
    state_checkpoint_slots: Optional[int] = None
    state_checkpoint_memory_gib: Optional[float] = None
    # Host-memory tier below the device pool (0: none): device evictions are demoted there.
    state_checkpoint_host_slots: int = 0
    checkpoint_planner: str = "adaptive"
    # None: expected-saving under the adaptive planner (the only one that values checkpoints),
    # lru under the others; resolved in __post_init__.
    checkpoint_eviction: Optional[str] = None
    anchor_template_family: str = AUTO_TEMPLATE_FAMILY

    def __post_init__(self):
        if self.state_checkpoint_slots is not None and self.state_checkpoint_memory_gib is not None:
            raise ValueError(
                "give either --state-checkpoint-slots or --state-checkpoint-memory-gib, not both"
            )
        if self.state_checkpoint_slots is not None and self.state_checkpoint_slots < 0:
            raise ValueError(
                f"--state-checkpoint-slots must be >= 0, got {self.state_checkpoint_slots}"
            )
        if self.state_checkpoint_memory_gib is not None and self.state_checkpoint_memory_gib < 0:
            raise ValueError(
                "--state-checkpoint-memory-gib must be >= 0, "
                f"got {self.state_checkpoint_memory_gib}"
            )
        if self.state_checkpoint_host_slots < 0:
            raise ValueError(
                "--state-checkpoint-host-slots must be >= 0, "
                f"got {self.state_checkpoint_host_slots}"
            )
        _check_choice("--checkpoint-planner", self.checkpoint_planner, CHECKPOINT_PLANNERS)
        if self.checkpoint_eviction is None:
            default = "expected-saving" if self.checkpoint_planner == "adaptive" else "lru"
            object.__setattr__(self, "checkpoint_eviction", default)
        _check_choice("--checkpoint-eviction", self.checkpoint_eviction, CHECKPOINT_EVICTIONS)
        _check_choice(
            "--anchor-template-family", self.anchor_template_family, ANCHOR_TEMPLATE_FAMILIES
        )
        if self.checkpoint_eviction == "expected-saving" and self.checkpoint_planner != "adaptive":
            raise ValueError(
                "--checkpoint-eviction expected-saving values checkpoints with the adaptive "
                "planner's predictions; use it with --checkpoint-planner adaptive, or choose "
                "--checkpoint-eviction lru"
            )

    def checkpoint_slots(self, bytes_per_slot: int) -> int:
        """Slots to allocate for checkpoints whose size is ``bytes_per_slot``."""
        if self.state_checkpoint_memory_gib is not None:
            return int(self.state_checkpoint_memory_gib * GIB) // bytes_per_slot
        if self.state_checkpoint_slots is not None:
            return self.state_checkpoint_slots
        return DEFAULT_CHECKPOINT_SLOTS

    def to_env(self) -> dict[str, str]:
        return {CONFIG_ENV_VAR: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> "SemanticCacheConfig":
        raw = (os.environ if environ is None else environ).get(CONFIG_ENV_VAR)
        if not raw:
            return cls()
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{CONFIG_ENV_VAR} is not valid JSON: {exc}") from None
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"{CONFIG_ENV_VAR} has unknown fields: {sorted(unknown)}")
        return cls(**values)


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")

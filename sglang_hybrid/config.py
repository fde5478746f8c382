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

CONFIG_ENV_VAR = "SGLANG_HYBRID_CONFIG"
GIB = 1 << 30


@dataclass(frozen=True)
class SemanticCacheConfig:
    # Size of the checkpoint pool: a slot count, or a memory budget it is derived from.
    state_checkpoint_slots: Optional[int] = None
    state_checkpoint_memory_gib: Optional[float] = None

    DEFAULT_SLOTS = 64

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

    def checkpoint_slots(self, bytes_per_slot: int) -> int:
        """Slots to allocate for checkpoints whose size is ``bytes_per_slot``."""
        if self.state_checkpoint_memory_gib is not None:
            return int(self.state_checkpoint_memory_gib * GIB) // bytes_per_slot
        if self.state_checkpoint_slots is not None:
            return self.state_checkpoint_slots
        return self.DEFAULT_SLOTS

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

"""llama.cpp server context checkpoints for recurrent/hybrid models
(PRs #15293, #16382, #22929, #24176, #20288, #25420; defaults --ctx-checkpoints 32,
--checkpoint-min-step 8192, --ubatch-size 512).

Each conversation keeps a server slot (session affinity): the slot's cached tokens (previous
prompt + output), its live recurrent state at the end of them, and up to 32 checkpoints.
Restore: LCP of the new prompt with the slot's cached tokens; use the live state if the LCP
covers it, else the newest checkpoint at or below the LCP; checkpoints past the LCP are erased.
While processing a prompt the server checkpoints at user-message starts (from the chat template
spans; in ChatML every `<|im_start|>user`, which the Qwen3 template also uses for tool results)
and at n_ubatch+4 and 4 tokens before the prompt end, each only if at least checkpoint_min_step
tokens lie past the closest existing checkpoint; the oldest checkpoint of a slot is dropped past 32.
llama.cpp has no cross-slot restore, so a request only sees its own session's states.

The replay's global pool of `budget_slots` states holds the slots' live states and checkpoints
alike (both cost one state of memory); when it is full the oldest state is dropped (FIFO).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ...anchors.special_tokens import QWEN3_ROLE_IDS, QWEN3_SPECIAL_IDS
from ...tokens import common_prefix_length
from .base import Policy, ReplayStep, ServeOutcome

# `<|im_start|>user` in the Qwen2/Qwen3 vocabulary: where ChatML user turns start.
CHATML_USER_TURN = (QWEN3_SPECIAL_IDS["<|im_start|>"], QWEN3_ROLE_IDS["user"])


@dataclass
class _Slot:
    cached: np.ndarray
    live_depth: int  # depth of the slot's live recurrent state (its last request's final state)
    checkpoints: list[int] = field(default_factory=list)  # depths, oldest first


class LlamaCppPolicy(Policy):
    name = "llamacpp"
    MAX_CHECKPOINTS_PER_SLOT = 32
    CHECKPOINT_MIN_STEP = 8192
    UBATCH = 512
    TAIL = 4

    def __init__(self, budget_slots, profile, user_turn_tokens: tuple[int, int] | None = None):
        super().__init__(budget_slots, profile)
        self.user_turn_tokens = user_turn_tokens or CHATML_USER_TURN
        self.slots: dict[str, _Slot] = {}
        # Every held state, oldest first: (session, depth) for checkpoints, (session, None) for live states.
        self.states: OrderedDict[tuple[str, int | None], None] = OrderedDict()

    @property
    def slots_in_use(self) -> int:
        return len(self.states)

    def _user_message_starts(self, prompt: np.ndarray) -> np.ndarray:
        first, second = self.user_turn_tokens
        return np.flatnonzero((prompt[:-1] == first) & (prompt[1:] == second))

    def _drop(self, key: tuple[str, int | None]) -> None:
        del self.states[key]
        session, depth = key
        if depth is not None:
            self.slots[session].checkpoints.remove(depth)

    def _hold(self, key: tuple[str, int | None]) -> bool:
        if self.budget_slots == 0:
            return False
        if len(self.states) >= self.budget_slots:
            self._drop(next(iter(self.states)))
        self.states[key] = None
        return True

    def serve(self, step: ReplayStep) -> ServeOutcome:
        session = step.request.session
        prompt = step.request.input_ids
        prompt_len = step.prompt_len
        slot = self.slots.get(session)
        restored = 0
        if slot is not None:
            lcp = common_prefix_length(prompt, slot.cached)
            limit = min(lcp, prompt_len - 1)
            if (session, None) in self.states and slot.live_depth <= limit:
                restored = slot.live_depth
            usable = [depth for depth in slot.checkpoints if depth <= limit]
            if usable:
                restored = max(restored, usable[-1])
            for depth in [d for d in slot.checkpoints if d > lcp]:
                self._drop((session, depth))
        else:
            slot = self.slots[session] = _Slot(cached=step.sequence, live_depth=step.final_state_depth)

        candidates = set(self._user_message_starts(prompt).tolist())
        candidates.update((prompt_len - self.TAIL - self.UBATCH, prompt_len - self.TAIL))
        taken = 0
        for depth in sorted(d for d in candidates if restored < d < prompt_len):
            closest = max(slot.checkpoints, default=None)
            if closest is not None and depth - closest < self.CHECKPOINT_MIN_STEP:
                continue
            if len(slot.checkpoints) >= self.MAX_CHECKPOINTS_PER_SLOT:
                self._drop((session, slot.checkpoints[0]))
            if self._hold((session, depth)):
                slot.checkpoints.append(depth)
                taken += 1

        # The live state moves to the end of this request's sequence.
        self.states.pop((session, None), None)
        taken += self._hold((session, None))
        slot.cached = step.sequence
        slot.live_depth = step.final_state_depth
        self._note_usage()
        return ServeOutcome(prompt_len, restored, prompt_len - restored, taken, restored)

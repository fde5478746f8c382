"""vLLM `mamba_cache_mode=align` (PR #30877) with prefix caching.

The scheduler cuts prefill chunks so each ends on a multiple of the attention block size B
(Scheduler._mamba_block_aligned_split: chunks of max_num_batched_tokens rounded down to B, and a
forced stop at the prompt's last full block, prompt_len - prompt_len % B); the state of a step's
last token is cached only when that token sits on a block boundary, and decode caches the state
at every boundary it crosses. A prompt shorter than B therefore caches nothing (#40696).
A hit restores the state of the deepest cached block within the matched prefix.

Eviction follows vLLM's free-block queue: least recently freed first, and a finished request
frees its blocks tail first, so its deepest states are evicted before its shallower ones.
"""

from __future__ import annotations

from .base import PREFILL_CHUNK_TOKENS, NodeCheckpoints, Policy, ReplayStep, ServeOutcome


class VLLMAlignPolicy(Policy):
    name = "vllm-align"

    def __init__(self, budget_slots, profile, block_size: int | None = None):
        super().__init__(budget_slots, profile)
        self.block_size = block_size or profile.vllm_block_size
        self.checkpoints = NodeCheckpoints(budget_slots)

    @property
    def slots_in_use(self) -> int:
        return len(self.checkpoints)

    def _prefill_states(self, restored: int, prompt_len: int) -> list[int]:
        block = self.block_size
        step_tokens = max(PREFILL_CHUNK_TOKENS // block, 1) * block
        last_cache_position = prompt_len - prompt_len % block
        depths, computed = [], restored
        while computed < prompt_len:
            end = min(computed + step_tokens, prompt_len)
            if computed < last_cache_position < end:
                end = last_cache_position
            if end % block == 0:
                depths.append(end)
            computed = end
        return depths

    def serve(self, step: ReplayStep) -> ServeOutcome:
        block = self.block_size
        node = self.checkpoints.deepest_usable(step.view.path, step.reuse_limit)
        restored = node.depth if node is not None else 0
        depths = self._prefill_states(restored, step.prompt_len)
        first_decode_boundary = (step.prompt_len // block + 1) * block
        depths.extend(range(first_decode_boundary, step.final_state_depth + 1, block))
        # Freed tail first: the deepest new state is the oldest entry of the free queue and the
        # restored block, freed last, the newest.
        taken = 0
        for depth in sorted(depths, reverse=True):
            taken += self.checkpoints.add(step.tree.node_ending_at(step.sequence, depth), step.clock)
        if node is not None:
            self.checkpoints.touch(node, step.clock)
        self._note_usage()
        return ServeOutcome(step.prompt_len, restored, step.prompt_len - restored, taken, restored)

"""SGLang 0.5.23 MambaRadixCache semantics (MAMBA component of UnifiedRadixCache, PR #11214).

Shared by both strategies: KV per token, one recurrent state per tree-node end; a match is
truncated to the deepest node holding a state; the MAMBA component keeps its own LRU and a hit
refreshes only the node actually restored (PR #31643/#31648). States never sit on split (branch)
nodes unless a strategy puts one there.
"""

from __future__ import annotations

from abc import abstractmethod

from ..cost_model import CostProfile
from .base import NodeCheckpoints, Policy, ReplayStep, ServeOutcome, prefill_chunks


class _SGLangMambaPolicy(Policy):
    def __init__(self, budget_slots, profile):
        super().__init__(budget_slots, profile)
        self.checkpoints = NodeCheckpoints(budget_slots)

    @property
    def slots_in_use(self) -> int:
        return len(self.checkpoints)

    @abstractmethod
    def _capture_depths(self, step: ReplayStep, restored: int) -> list[int]:
        """Depths whose state the request commits to the tree, in the order it commits them."""

    def serve(self, step: ReplayStep) -> ServeOutcome:
        node = self.checkpoints.deepest_usable(step.view.path, step.reuse_limit)
        restored = 0
        if node is not None:
            restored = node.depth
            self.checkpoints.touch(node, step.clock)
        taken = 0
        for depth in self._capture_depths(step, restored):
            taken += self.checkpoints.add(step.tree.node_ending_at(step.sequence, depth), step.clock)
        self._note_usage()
        return ServeOutcome(step.prompt_len, restored, step.prompt_len - restored, taken, restored)


class SGLangNoBufferPolicy(_SGLangMambaPolicy):
    """`--mamba-radix-cache-strategy no_buffer`: a state at each prefill chunk end (copied out of
    the running slot by cache_unfinished_req) and at the sequence end on finish (the live slot
    is donated by cache_finished_req). Nothing at branch points or at the prompt end."""

    name = "sglang-no-buffer"

    def _capture_depths(self, step, restored):
        chunk_ends = [end for _, end in prefill_chunks(restored, step.prompt_len) if end < step.prompt_len]
        return chunk_ends + [step.final_state_depth]


class SGLangExtraBufferPolicy(_SGLangMambaPolicy):
    """`--mamba-radix-cache-strategy extra_buffer` (PR #14792).

    One tracked state per request per forward (ping-pong track slots): a prefill forward tracks
    its last position on the `mamba_track_interval`=256 grid, except that the forward containing
    the branch point -- the KV hit aligned down to the 64-token GDN chunk grid
    (mamba_branching_seqlen) -- tracks that instead. Decode tracks every 256 tokens and the last
    tracked state is committed on finish.
    """

    name = "sglang-extra-buffer"
    TRACK_INTERVAL = 256

    def __init__(self, budget_slots: int, profile: CostProfile):
        super().__init__(budget_slots, profile)
        # lcm(the GDN chunk, page size 1). The kernels load torch: only a replay of this
        # policy pays for it.
        from ...kernels import GDN_CHUNK_SIZE

        self.branch_grid = GDN_CHUNK_SIZE

    def _capture_depths(self, step, restored):
        branch = step.view.lcp // self.branch_grid * self.branch_grid
        depths = []
        for begin, end in prefill_chunks(restored, step.prompt_len):
            if restored < branch and begin < branch <= end:
                depths.append(branch)
                continue
            aligned = end // self.TRACK_INTERVAL * self.TRACK_INTERVAL
            if aligned > begin:
                depths.append(aligned)
        last_tracked = step.final_state_depth // self.TRACK_INTERVAL * self.TRACK_INTERVAL
        if last_tracked > max(depths, default=restored):
            depths.append(last_tracked)
        return depths

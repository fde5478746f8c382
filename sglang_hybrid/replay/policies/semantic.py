"""`semantic`: our policy, replayed through the real cache.

Every request goes through a ``SemanticStateCache`` built by SGLang's registry and driven the
way SGLang's scheduler drives it (``SchedulerDriver``): admission match with copy-on-write
restore, the ``CheckpointPlanner``'s checkpoints staged during the request by the server's own
planning step (``AnchorCapture``: prompt and tree known, output not yet), insert of the
request with its final state on finish, evictions by the cache itself with the planner as
its ``eviction_scorer``. The reported reuse is what the cache restored.

The state layout is one tiny recurrent layer (copies cost nothing; the budget is a slot
count), and the KV pool is sized so it never evicts on the traces we replay, matching the
replay's unbounded-KV semantics; should a trace outgrow it, the cache evicts KV (LRU) and the
policy counts the evicted tokens in ``kv_tokens_evicted``, so the deviation is visible (it can
only lose reuse, never gain any).

The tree holds prompt + output[:-1] of each request: the last sampled token is never fed back
through the model, so the final state -- and SGLang's insert on finish -- stops before it.

With ``host_slots`` the cache has its host-memory tier below the device pool: device evictions
are demoted there and a restore from it promotes the checkpoint back. Which restores came
from the host is read off the cache's own counter, so the replay charges the PCIe copy to
exactly those requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...anchors.detector import AnchorDetector
from ...anchors.hints import validate_hints
from ...anchors.planner import CheckpointPlanner
from ...runtime.anchor_capture import AnchorCapture
from . import register_policy
from .base import Policy, ReplayStep, ServeOutcome

if TYPE_CHECKING:
    from ...cache.standalone import HybridPoolSpec

# Distinct tokens of the replayed traces: tau-bench airline 0.7M append-only, 1.6M under the
# aider emulator; SWE-agent 0.03M. Every KV free concatenates the allocator's free list, so a
# pool much larger than needed slows the replay down.
DEFAULT_KV_TOKENS = 1 << 21
DEFAULT_MAX_CONTEXT = 1 << 18


def tiny_state_spec(kv_tokens: int = DEFAULT_KV_TOKENS, max_context: int = DEFAULT_MAX_CONTEXT) -> "HybridPoolSpec":
    """Pools for replay: one recurrent and one attention layer, a few bytes per state and per
    token, so a checkpoint copy is negligible and millions of KV tokens fit in memory."""
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

    from ...cache.standalone import HybridPoolSpec

    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=2, n_groups=1, num_heads=1, head_dim=2, state_size=1, conv_kernel=2,
    )
    params = Mamba2CacheParams(
        shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    )
    return HybridPoolSpec(
        cache_params=params,
        full_attention_layer_ids=(1,),
        kv_head_num=1,
        kv_head_dim=1,
        kv_dtype=torch.bfloat16,
        kv_size=kv_tokens,
        max_num_reqs=2,
        max_context_len=max_context,
    )


class SemanticPolicy(Policy):
    name = "semantic"

    def __init__(self, budget_slots, profile, *, host_slots: int = 0, detector: AnchorDetector | None = None,
                 spec: "HybridPoolSpec | None" = None):
        super().__init__(budget_slots, profile)
        # Importing SGLang takes seconds; only a replay that uses this policy pays for it.
        from ...cache.standalone import SchedulerDriver, build_tree_cache
        from ...config import SemanticCacheConfig

        # The replay's converters render with ChatML/Qwen3 templates and the Qwen3 tokenizer.
        self.detector = detector or AnchorDetector.for_family("chatml")
        self.under_test = build_tree_cache(
            "semantic", spec or tiny_state_spec(),
            config=SemanticCacheConfig(state_checkpoint_slots=budget_slots, state_checkpoint_host_slots=host_slots),
        )
        self.driver = SchedulerDriver(self.under_test)
        self.cache = self.under_test.cache
        self.planner = CheckpointPlanner()
        # The server's planning step (runtime/): what a server knows when it plans a prefill.
        self.capture = AnchorCapture(self.cache, self.detector, "adaptive", self.planner)
        self.kv_tokens_evicted = 0

    @property
    def slots_in_use(self) -> int:
        return self.cache.checkpoint_pool.used_size()

    def serve(self, step: ReplayStep) -> ServeOutcome:
        request = step.request
        prompt = request.input_ids
        kept_output = request.output_ids[:-1]
        req = self.driver.new_request(prompt.tolist(), kept_output.tolist())
        self._reserve_kv(len(prompt) + len(kept_output))
        host_restores_before = self.cache.stats.restored_from_host
        result = self.driver.admit(req)
        restored_from_host = self.cache.stats.restored_from_host > host_restores_before
        restored = int(result.device_prefix_len)
        source = req.kv.mamba_cow_src_index
        restored_slot = int(source) if source is not None and restored > 0 else None
        self.driver.run_copy_on_write(req)

        hint = validate_hints(request.anchors, len(prompt)) if request.anchors else None
        taken_before = self.cache.stats.taken
        # The replay checks placement, not numerics: the staged slots' content is not written.
        self.capture.plan_request(
            req, session=request.session, prompt=prompt, restored_slot=restored_slot, hint=hint
        )
        self.driver.finish(req)
        self.capture.request_finished(request.session, np.concatenate([prompt, kept_output]), len(prompt))
        self._note_usage()
        return ServeOutcome(len(prompt), restored, len(prompt) - restored,
                            self.cache.stats.taken - taken_before, restored, restored_from_host)

    # ---- reading the real tree ----

    def _reserve_kv(self, tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        allocator = self.under_test.allocator
        missing = tokens - allocator.available_size()
        if missing > 0:
            self.cache.evict(EvictParams(num_tokens=missing))
            self.kv_tokens_evicted += missing


register_policy(SemanticPolicy.name, SemanticPolicy)

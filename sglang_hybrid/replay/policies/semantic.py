"""`semantic`: our policy, replayed through the real cache and the server's request lifecycle.

Every request goes through a ``SemanticStateCache`` built by SGLang's registry and the
plugin's factory (planning included, from the config, as on a server) and driven with the
steps a server takes (``harness.lifecycle.RequestLifecycle``): admission match with
copy-on-write restore; the checkpoints the ``CheckpointPlanner`` plans from what a server knows
at the first prefill forward (prompt and tree, not the output), staged by the cache; insert
of the request with its final state on finish, the planner learning from it in the cache's
release; evictions by the cache itself, valued by the planner. The reported reuse is what the
cache restored.

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

from typing import TYPE_CHECKING, Sequence

from ..trace import Request
from .base import Policy, ReplayStep, ServeOutcome

if TYPE_CHECKING:
    from ...planning.planner import CheckpointPlanner
    from ...harness.pools import HybridPoolSpec

# Distinct tokens of the replayed traces: tau-bench airline 0.7M append-only, 1.6M under the
# aider emulator; SWE-agent 0.03M. Every KV free concatenates the allocator's free list, so a
# pool much larger than needed slows the replay down.
DEFAULT_KV_TOKENS = 1 << 21
DEFAULT_MAX_CONTEXT = 1 << 18
# The replay's converters render with ChatML/Qwen3 templates and the Qwen3 tokenizer.
REPLAY_TEMPLATE_FAMILY = "chatml"


def tiny_state_spec(kv_tokens: int = DEFAULT_KV_TOKENS, max_context: int = DEFAULT_MAX_CONTEXT) -> "HybridPoolSpec":
    """Pools for replay: one recurrent and one attention layer, a few bytes per state and per
    token, so a checkpoint copy is negligible and millions of KV tokens fit in memory."""
    import torch

    from ...harness.pools import hybrid_pool_spec

    return hybrid_pool_spec(
        recurrent_layers=[0], attention_layers=[1],
        intermediate_size=2, num_heads=1, head_dim=2, state_size=1, conv_kernel=2,
        conv_dtype=torch.bfloat16, kv_head_dim=1, kv_dtype=torch.bfloat16,
        kv_size=kv_tokens, max_num_reqs=2, max_context_len=max_context,
    )  # fmt: skip


class SemanticPolicy(Policy):
    name = "semantic"

    def __init__(self, budget_slots, profile, *, host_slots: int = 0, spec: "HybridPoolSpec | None" = None):
        super().__init__(budget_slots, profile)
        # Importing SGLang takes seconds; only a replay that uses this policy pays for it.
        from ...config import SemanticCacheConfig
        from ...harness.lifecycle import RequestLifecycle
        from ...harness.pools import build_tree_cache

        config = SemanticCacheConfig(
            state_checkpoint_slots=budget_slots,
            state_checkpoint_host_slots=host_slots,
            anchor_template_family=REPLAY_TEMPLATE_FAMILY,
        )
        self.lifecycle = RequestLifecycle(build_tree_cache("semantic", spec or tiny_state_spec(), config=config))
        self.cache = self.lifecycle.cache
        self.kv_tokens_evicted = 0

    @property
    def planner(self) -> "CheckpointPlanner":
        return self.cache.planning.planner

    @property
    def slots_in_use(self) -> int:
        return self.cache.checkpoint_pool.used_size()

    def serve(self, step: ReplayStep) -> ServeOutcome:
        request = step.request
        prompt = request.input_ids
        kept_output = request.output_ids[:-1]
        req = self.lifecycle.new_request(
            prompt.tolist(), kept_output.tolist(), hint=request.anchors or None, session=request.session
        )
        self._reserve_kv(len(prompt) + len(kept_output))
        host_restores_before = self.cache.stats.restored_from_host
        taken_before = self.cache.stats.taken
        restored = int(self.lifecycle.admit(req).device_prefix_len)
        restored_from_host = self.cache.stats.restored_from_host > host_restores_before
        # The replay checks placement, not numerics: the staged slots' content is not written.
        self.lifecycle.start([req])
        self.lifecycle.finish(req)
        self._note_usage()
        return ServeOutcome(len(prompt), restored, len(prompt) - restored,
                            self.cache.stats.taken - taken_before, restored, restored_from_host)

    # ---- reading the real tree ----

    def _reserve_kv(self, tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        allocator = self.lifecycle.tree.allocator
        missing = tokens - allocator.available_size()
        if missing > 0:
            self.cache.evict(EvictParams(num_tokens=missing))
            self.kv_tokens_evicted += missing


class SessionClosingSemanticPolicy(SemanticPolicy):
    """`semantic` with a client that closes each agent session after its last request
    (``/close_session``; ``SemanticStateCache.end_session``), as an agent framework can once
    its episode is over. Built with the trace, which says which request is a session's last:
    an upper reference for what the signal is worth, beside `semantic`, whose clients never
    send it."""

    name = "semantic-closing"

    def __init__(self, budget_slots, profile, requests: Sequence[Request], *, host_slots: int = 0,
                 spec: "HybridPoolSpec | None" = None):
        super().__init__(budget_slots, profile, host_slots=host_slots, spec=spec)
        # Requests in arrival order: a step's clock is its index there.
        last = {request.session: clock for clock, request in enumerate(requests)}
        self._session_ends = set(last.values())

    def serve(self, step: ReplayStep) -> ServeOutcome:
        outcome = super().serve(step)
        if step.clock in self._session_ends:
            self.cache.end_session(step.request.session)
        return outcome

"""An in-process CPU engine serving a transformers hybrid model through the semantic cache.

It answers one question end to end: does serving a request from a restored checkpoint
give the same logits and tokens as computing it from scratch? Everything that is cached,
matched, restored and evicted is decided by SGLang's pools and the real
``SemanticStateCache`` (built through the registry by ``build_tree_cache``, planning
included, and driven with a server's steps by ``RequestLifecycle``); the engine only runs the
model and moves states between the model's cache objects and the pool slots the cache hands
out.

Per request (cached): admit (match) -> start (copy-on-write of the matched checkpoint into the
request's live state slot; the cache stages a checkpoint slot at each depth its planning
gives: the request's explicit positions, or with the adaptive planner what it chooses from
what matched) -> rebuild the model cache from the live slot and the KV of the restored
prefix -> prefill the rest of the prompt in segments ending at the staged depths, writing the
state at each into its slot -> decode -> write the final state into the live slot and the new
KV into the request's KV slots -> finish (insert into the tree, snapshot the live slot as the
end checkpoint, the planner learns what the request left). A server takes the same steps,
with the segments' states captured inside one forward instead (runtime/).
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from sglang_hybrid.config import DEFAULT_CHECKPOINT_SLOTS, SemanticCacheConfig
from sglang_hybrid.engine.state_bridge import HybridStateBridge
from sglang_hybrid.harness.lifecycle import RequestLifecycle
from sglang_hybrid.harness.pools import build_tree_cache


@dataclass(frozen=True)
class EngineRequest:
    prompt: tuple[int, ...]
    output_len: int = 0
    # Prompt depths at which to checkpoint the recurrent state (a client's hint, e.g. a
    # trace's anchors); with a planner, weighed with its own choices. Depths the restored
    # prefix already covers are skipped.
    checkpoint_positions: tuple[int, ...] = ()
    # When given, these tokens are fed as the output (teacher forcing, e.g. a recorded
    # answer) instead of the greedy ones; ``output_len`` is then ignored.
    forced_output: Optional[tuple[int, ...]] = None
    # Conversation the request belongs to, for a planner that learns per session.
    session: Optional[str] = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.forced_output) if self.forced_output is not None else self.output_len


@dataclass
class EngineResult:
    prompt_logits: torch.Tensor  # logits at the last prompt position, shape (vocab,)
    greedy_ids: list[int]  # argmax at each output step
    output_ids: list[int]  # tokens fed as the output (greedy ids unless forced)
    restored_tokens: int  # prompt tokens served from the cache
    computed_prompt_tokens: int  # prompt tokens run through the model
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (depth, slot) staged
    wall_s: float = 0.0  # the whole request: admission to the last output token
    ttft_s: float = 0.0  # admission to the logits of the last prompt position


def max_abs_logit_diff(a: Sequence[EngineResult], b: Sequence[EngineResult]) -> float:
    return max(float((x.prompt_logits - y.prompt_logits).abs().max()) for x, y in zip(a, b))


class CpuHybridEngine:
    """Serves requests with ``model`` (a transformers Qwen3-Next, GraniteMoeHybrid or
    NemotronH) on CPU, one at a time."""

    def __init__(
        self,
        model,
        *,
        checkpoint_slots: int = DEFAULT_CHECKPOINT_SLOTS,
        kv_size: int = 1 << 16,
        max_num_reqs: int = 4,
        max_context_len: int = 1 << 15,
        checkpoint_planner: str = "none",
        anchor_template_family: str = "chatml",
    ):
        """``checkpoint_planner`` (``--checkpoint-planner``): "adaptive" plans (and values
        for eviction) checkpoint depths beyond the requests' explicit positions, from the
        anchors of ``anchor_template_family`` (default ChatML, what the replay's converters
        render); "none" takes the explicit positions only."""
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.bridge = HybridStateBridge(model.config)
        spec = self.bridge.pool_spec(
            kv_size=kv_size, max_num_reqs=max_num_reqs, max_context_len=max_context_len
        )
        config = SemanticCacheConfig(
            state_checkpoint_slots=checkpoint_slots,
            checkpoint_planner=checkpoint_planner,
            anchor_template_family=anchor_template_family,
        )
        self.lifecycle = RequestLifecycle(build_tree_cache("semantic", spec, config=config))

    @property
    def cache(self):
        return self.lifecycle.cache

    def run(
        self,
        requests: Sequence[EngineRequest],
        *,
        cached: bool,
    ) -> list[EngineResult]:
        if not cached:
            return [self.serve_uncached(request) for request in requests]
        return [self.serve_cached(request) for request in requests]

    # ---- one request ----

    @torch.no_grad()
    def serve_uncached(self, request: EngineRequest) -> EngineResult:
        """Plain full prefill of the prompt, then decode; no pool or cache involved."""
        started = time.perf_counter()
        model_cache = DynamicCache(config=self.model.config)
        logits = self._forward(model_cache, request.prompt, start=0)
        ttft_s = time.perf_counter() - started
        greedy, fed = self._decode(model_cache, request, logits, feed_last=False)
        return EngineResult(
            prompt_logits=logits,
            greedy_ids=greedy,
            output_ids=fed,
            restored_tokens=0,
            computed_prompt_tokens=len(request.prompt),
            wall_s=time.perf_counter() - started,
            ttft_s=ttft_s,
        )

    @torch.no_grad()
    def serve_cached(self, request: EngineRequest) -> EngineResult:
        started = time.perf_counter()
        lifecycle, prompt = self.lifecycle, request.prompt
        # The scheduler reserves KV for prompt + output at admission; the output ids are
        # filled in below as they are decoded, before the request is inserted.
        req = lifecycle.new_request(
            prompt,
            [0] * request.num_output_tokens,
            hint=list(request.checkpoint_positions) or None,
            session=request.session,
        )
        restored = lifecycle.admit(req).device_prefix_len
        lifecycle.start([req])
        row = req.kv.req_pool_idx
        total = len(req.full_untruncated_fill_ids)
        kv_indices = lifecycle.tree.req_to_token_pool.req_to_token[row, :total].long()
        kv_pool = lifecycle.tree.allocator.get_kvcache()
        live_state = lifecycle.tree.mamba_pool.mamba_cache
        live_slot = int(req.kv.mamba_pool_idx)

        if restored > 0:
            model_cache = self.bridge.load_cache(
                live_state.conv, live_state.temporal, live_slot, kv_pool, kv_indices[:restored]
            )
        else:
            model_cache = DynamicCache(config=self.model.config)

        checkpoints = [(depth, checkpoint.slot) for depth, checkpoint in self.cache.staged_checkpoints(req)]
        slot_at_depth = dict(checkpoints)
        pool = self.cache.checkpoint_pool
        start = restored
        for end in sorted(set(slot_at_depth) | {len(prompt)}):
            logits = self._forward(model_cache, prompt[start:end], start=start)
            start = end
            if end in slot_at_depth:
                self.bridge.store_state(model_cache, pool.conv, pool.temporal, slot_at_depth[end])
        ttft_s = time.perf_counter() - started

        # The end checkpoint ``finish`` takes covers prompt + output, so the last output
        # token is fed too: the live slot must hold the state after every token.
        greedy, fed = self._decode(model_cache, request, logits, feed_last=True)
        req.output_ids = array("q", fed)
        req.full_untruncated_fill_ids = array("q", [*prompt, *fed])
        self.bridge.store_state(model_cache, live_state.conv, live_state.temporal, live_slot)
        self.bridge.store_kv(model_cache, kv_pool, kv_indices[restored:], start=restored)
        # The engine feeds every output token back: the tree holds prompt + output.
        lifecycle.finish(req)
        return EngineResult(
            prompt_logits=logits,
            greedy_ids=greedy,
            output_ids=fed,
            restored_tokens=restored,
            computed_prompt_tokens=len(prompt) - restored,
            checkpoints=checkpoints,
            wall_s=time.perf_counter() - started,
            ttft_s=ttft_s,
        )

    # ---- model steps ----

    def _forward(self, model_cache: DynamicCache, token_ids: Sequence[int], *, start: int):
        """Run ``token_ids`` at positions ``start:``; logits of the last one, fp32."""
        input_ids = torch.tensor([[t % self.vocab_size for t in token_ids]], dtype=torch.long)
        positions = torch.arange(start, start + len(token_ids)).unsqueeze(0)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=model_cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1].float()

    def _decode(self, model_cache, request: EngineRequest, logits, *, feed_last: bool):
        position = len(request.prompt)
        greedy: list[int] = []
        fed: list[int] = []
        for step in range(request.num_output_tokens):
            greedy.append(int(logits.argmax()))
            token = request.forced_output[step] if request.forced_output is not None else greedy[-1]
            fed.append(token)
            if step + 1 < request.num_output_tokens or feed_last:
                logits = self._forward(model_cache, [token], start=position)
                position += 1
        return greedy, fed

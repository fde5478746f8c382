"""The CPU engine through the real semantic cache gives the logits of a plain full prefill.

A tiny random-weight hybrid model (Qwen3-Next: gated delta-net; GraniteMoeHybrid: Mamba2)
serves multi-turn requests twice: through the cache (restoring checkpoints into SGLang's
pools and back into the model) and uncached. The
restored path must match the uncached one to fp32 rounding, and a corrupted checkpoint
must break that match, so the comparison is shown able to fail.
"""

from __future__ import annotations

import random

import pytest

from sglang_hybrid.engine.engine import CpuHybridEngine, EngineRequest, max_abs_logit_diff
from sglang_hybrid.engine.tiny_models import tiny_granite_moe_hybrid, tiny_qwen3_next

# Segmenting a prefill changes the chunking of the delta-rule scan, so cached and uncached
# logits agree to fp32 rounding (about 1e-7 here), not bit for bit.
LOGIT_TOLERANCE = 1e-5
SYSTEM_LEN = 64
OUTPUT_LEN = 3


@pytest.fixture(scope="module", params=[tiny_qwen3_next, tiny_granite_moe_hybrid])
def model(request):
    return request.param(seed=0)


def tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    # Ids in Qwen's vocabulary range: the engine folds them into the tiny model's vocabulary.
    return tuple(rng.randrange(151936) for _ in range(n))


@pytest.fixture
def conversation():
    rng = random.Random(1)
    system = tokens(rng, SYSTEM_LEN)
    user1 = tokens(rng, 30)
    return system, user1, tokens(rng, 20), tokens(rng, 25)


def test_multi_turn_with_edits_matches_uncached(model, conversation):
    system, user1, user2, edited_tail = conversation
    engine = CpuHybridEngine(model, checkpoint_slots=16)

    turn1 = EngineRequest(system + user1, OUTPUT_LEN, checkpoint_positions=(SYSTEM_LEN,))
    [first] = engine.run([turn1], cached=True)
    turn1_total = len(turn1.prompt) + OUTPUT_LEN
    # The next turn continues the conversation with the answer actually generated.
    turn2 = EngineRequest(turn1.prompt + tuple(first.output_ids) + user2, OUTPUT_LEN)
    # An edit in the middle of the first user turn: only the system prompt is shared.
    edited = EngineRequest(system + user1[:10] + edited_tail, OUTPUT_LEN)
    rest = [turn2, edited, turn2]
    cached = [first, *engine.run(rest, cached=True)]
    uncached = engine.run([turn1, *rest], cached=False)

    assert max_abs_logit_diff(cached, uncached) <= LOGIT_TOLERANCE
    for request, c, u in zip([turn1, *rest], cached, uncached):
        assert c.greedy_ids == u.greedy_ids
        assert c.restored_tokens + c.computed_prompt_tokens == len(request.prompt)
    assert [r.restored_tokens for r in cached] == [
        0,  # cold cache
        turn1_total,  # end checkpoint of turn 1 (prompt + answer)
        SYSTEM_LEN,  # staged checkpoint at the end of the system prompt
        # Identical repeat: turn 2's end checkpoint lies past its prompt (a match stops
        # at len(prompt) - 1), so the deepest usable one is still turn 1's end.
        turn1_total,
    ]
    assert [d for d, _ in cached[0].checkpoints] == [SYSTEM_LEN]


def test_forced_output_is_fed_and_greedy_still_reported(model, conversation):
    system, user1, _, _ = conversation
    engine = CpuHybridEngine(model, checkpoint_slots=4)
    forced = (7, 8, 9)
    request = EngineRequest(
        system + user1, checkpoint_positions=(SYSTEM_LEN,), forced_output=forced
    )
    [cached_cold] = engine.run([request], cached=True)
    [cached_warm] = engine.run([request], cached=True)
    [uncached] = engine.run([request], cached=False)
    assert cached_cold.output_ids == cached_warm.output_ids == list(forced)
    # A repeat cannot use the end checkpoint (past the prompt): it restores the staged one.
    assert cached_warm.restored_tokens == SYSTEM_LEN
    assert cached_warm.greedy_ids == uncached.greedy_ids
    assert max_abs_logit_diff([cached_warm], [uncached]) <= LOGIT_TOLERANCE


def test_corrupted_checkpoint_breaks_the_logit_match(model, conversation):
    system, user1, _, edited_tail = conversation
    engine = CpuHybridEngine(model, checkpoint_slots=16)
    turn1 = EngineRequest(system + user1, OUTPUT_LEN, checkpoint_positions=(SYSTEM_LEN,))
    [first] = engine.run([turn1], cached=True)
    [(depth, slot)] = first.checkpoints
    assert depth == SYSTEM_LEN
    engine.cache.checkpoint_pool.temporal[:, slot] += 1.0

    edited = EngineRequest(system + edited_tail, OUTPUT_LEN)
    [cached] = engine.run([edited], cached=True)
    [uncached] = engine.run([edited], cached=False)
    assert cached.restored_tokens == SYSTEM_LEN  # the corrupted slot was the one restored
    assert max_abs_logit_diff([cached], [uncached]) > LOGIT_TOLERANCE

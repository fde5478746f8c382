"""The `semantic` replay policy: the planner's checkpoints served through the real cache.

The hand-built trace's reuse follows from the rules: an append-only turn restores the previous
request's final state (prompt + output[:-1]); the first session's user-message start is a
shared-path checkpoint, which later sessions sharing the system prompt restore; an identical
repeat restores the prompt tail (len(prompt) - 1).
"""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hybrid.replay.cost_model import get_profile
from sglang_hybrid.replay.policies import POLICIES, drive
from sglang_hybrid.replay.policies.semantic import SemanticPolicy, SessionClosingSemanticPolicy, tiny_state_spec
from sglang_hybrid.replay.sim import simulate
from sglang_hybrid.replay.trace import Request, Trace
from test_planner import TOOL_RESULT_HEADER, last_n_session, message, request, text

PROFILE = get_profile("qwen3-next-80b@h200")
SYSTEM = message("system", text(1, 50))


def as_request(session: str, turn: int, prompt_output) -> Request:
    prompt, output = prompt_output
    return Request(session, turn, float(turn), prompt, output)


def hand_built_trace() -> list[Request]:
    user_a = message("user", [4242, *text(2, 10)])
    first = request([SYSTEM, user_a], text(3, 6))
    follow_up = request([SYSTEM, user_a, message("assistant", text(3, 6)), message("tool", text(4, 20))], text(5, 4))
    second_session = request([SYSTEM, message("user", [4242, *text(6, 10)])], text(7, 4))
    third_session = request([SYSTEM, message("user", text(8, 12))], text(9, 4))
    return [
        as_request("a", 0, first),
        as_request("a", 1, follow_up),
        as_request("b", 0, second_session),
        as_request("c", 0, third_session),
        as_request("c", 1, third_session),  # a retry: the identical prompt again
    ]


def small_policy(budget: int) -> SemanticPolicy:
    return SemanticPolicy(budget, PROFILE, spec=tiny_state_spec(kv_tokens=1 << 15, max_context=1 << 12))


def test_hand_built_trace_restores_what_the_rules_say():
    requests = hand_built_trace()
    policy = small_policy(64)
    outcomes = [outcomes[0] for _, outcomes in drive(requests, [policy])]
    first, follow_up, _, third, retry = requests
    expected_restored = [
        0,
        len(first.input_ids) + len(first.output_ids) - 1,  # final state: prompt + output[:-1]
        len(SYSTEM),  # the shared-path checkpoint the first session left at its message start
        len(SYSTEM),
        len(retry.input_ids) - 1,  # the prompt tail
    ]
    assert [o.restored_depth for o in outcomes] == expected_restored
    assert [o.recomputed_tokens for o in outcomes] == [
        len(r.input_ids) - d for r, d in zip(requests, expected_restored)
    ]
    # It went through the real cache: its counters saw the same restores.
    stats = policy.cache.stats
    assert stats.restored == 4
    assert stats.tokens_restored == sum(expected_restored)
    assert stats.taken == sum(o.checkpoints_taken for o in outcomes) > 0
    assert policy.cache.eviction_valuation.planner is policy.planner
    assert policy.slots_peak == policy.slots_in_use == stats.taken - stats.evicted - stats.dropped_with_kv
    assert policy.kv_tokens_evicted == 0


def test_budget_bounds_the_pool_and_eviction_runs_through_the_planner(monkeypatch):
    sessions = [last_n_session(6, tag=1000 * i) for i in range(4)]
    requests = [as_request(f"s{i}", step, calls[step]) for step in range(6) for i, calls in enumerate(sessions)]
    policy = small_policy(3)
    scored: list[int] = []
    planner_values = policy.planner.device_values

    def recording_values(num_slots: int) -> np.ndarray:
        scored.append(num_slots)
        return planner_values(num_slots)

    monkeypatch.setattr(policy.planner, "device_values", recording_values)
    for step, (outcome,) in drive(requests, [policy]):
        assert outcome.cached_tokens + outcome.recomputed_tokens == outcome.prompt_tokens
        assert outcome.cached_tokens <= step.reuse_limit
        assert policy.slots_in_use <= 3
    assert policy.cache.stats.evicted > 0
    assert scored, "evictions must consult the planner's valuation"
    assert policy.slots_peak == 3


def test_zero_budget_restores_nothing():
    policy = small_policy(0)
    outcomes = [o for _, (o,) in drive(hand_built_trace(), [policy])]
    assert all(o.cached_tokens == 0 for o in outcomes)
    assert policy.cache.stats.taken == 0


def test_registered_and_near_the_oracle_on_masked_history():
    """Through the replay runner by name, on SWE-agent-style masking: once the edit rule is
    learned, every step restores at the anchor of the observation it masks, recomputing only
    that message's two header tokens more than the oracle."""
    assert POLICIES["semantic"] is SemanticPolicy
    calls = last_n_session(10)
    trace = Trace([as_request("swe", step, call) for step, call in enumerate(calls)])
    stats = simulate(trace, ["oracle", "semantic", "none"], (64,), PROFILE, progress=False)[64]
    assert stats["oracle"].recomputed_tokens < stats["semantic"].recomputed_tokens < stats["none"].recomputed_tokens
    semantic = [o.recomputed_tokens for _, (o,) in drive(trace.requests, [small_policy(64)])]
    oracle = [o.recomputed_tokens for _, (o,) in drive(trace.requests, [POLICIES["oracle"](64, PROFILE)])]
    assert [s - o for s, o in zip(semantic, oracle)][5:] == [TOOL_RESULT_HEADER] * (len(calls) - 5)


@pytest.mark.parametrize("budget", [1, 8])
def test_outcomes_never_beat_the_oracle(budget):
    requests = hand_built_trace()
    policy = small_policy(budget)
    for step, (outcome,) in drive(requests, [policy]):
        assert outcome.cached_tokens <= step.reuse_limit


def test_the_closing_client_ends_each_session_after_its_last_request():
    """`semantic-closing` closes each session right after the trace's last request of it:
    the planner sees a session end then and not before, and the replay runner builds it by
    name with the trace."""
    sessions = {f"s{i}": last_n_session(2 + 2 * i, tag=1000 * i) for i in range(3)}
    requests = [as_request(name, step, calls[step])
                for step in range(6) for name, calls in sessions.items() if step < len(calls)]
    last = {request.session: clock for clock, request in enumerate(requests)}
    spec = tiny_state_spec(kv_tokens=1 << 15, max_context=1 << 12)
    policy = SessionClosingSemanticPolicy(4, PROFILE, requests, spec=spec)
    for step, _ in drive(requests, [policy]):
        ended = {name for name, session in policy.planner.sessions.items() if session.ended}
        assert ended == {name for name, clock in last.items() if clock <= step.clock}
    assert ended == set(sessions)
    stats = simulate(Trace(requests), ["semantic", "semantic-closing"], (4,), PROFILE, progress=False)[4]
    assert stats["semantic-closing"].recomputed_tokens > 0

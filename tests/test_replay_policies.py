"""Each peer policy on hand-built traces whose answer follows from the policy's rules."""

import numpy as np
import pytest

from sglang_hybrid.replay.cost_model import get_profile
from sglang_hybrid.replay.policies import PEER_POLICIES, POLICIES, drive, make_policy
from sglang_hybrid.replay.synthetic import synthetic_agent_trace
from sglang_hybrid.replay.trace import Request

PROFILE = get_profile("qwen3-next-80b@h200")  # vLLM block 528
_rng = np.random.default_rng(7)


def tokens(n):
    """Fresh tokens that share no prefix with any other call's."""
    return _rng.integers(1000, 100_000, size=n).astype(np.int32)


def req(prompt, output, session="s", turn=0):
    return Request(session, turn, float(turn), np.asarray(prompt, np.int32), np.asarray(output, np.int32))


def cached(policy_name, requests, budget=64, **kwargs):
    policy = POLICIES[policy_name](budget, PROFILE, **kwargs)
    return [outcomes[0].cached_tokens for _, outcomes in drive(requests, [policy])], policy


def append_only_session():
    p1, o1 = tokens(1000), tokens(20)
    p2 = np.concatenate([p1, o1, tokens(300)])
    return [req(p1, o1, turn=0), req(p2, tokens(10), turn=1)]


def test_none_never_reuses():
    assert cached("none", append_only_session())[0] == [0, 0]


def test_oracle_reuses_the_whole_kv_prefix():
    assert cached("oracle", append_only_session())[0] == [0, 1020]
    p = tokens(500)
    # Identical prompt: the last token is always recomputed.
    assert cached("oracle", [req(p, tokens(5)), req(p, tokens(5), turn=1)])[0] == [0, 499]


def test_sglang_no_buffer_keeps_only_sequence_ends_and_chunk_ends():
    # Append-only: the finished request's state (prompt + output[:-1]) is reused.
    assert cached("sglang-no-buffer", append_only_session())[0] == [0, 1019]
    # An edit before the previous end leaves nothing: no state at branch points or prompt ends.
    p1 = tokens(1000)
    edited = np.concatenate([p1[:600], tokens(500)])
    assert cached("sglang-no-buffer", [req(p1, tokens(5)), req(edited, tokens(5), turn=1)])[0] == [0, 0]
    # Chunked prefill (8192) leaves states at 8192 and 16384.
    long = tokens(20_000)
    edited = np.concatenate([long[:17_000], tokens(100)])
    assert cached("sglang-no-buffer", [req(long, tokens(5)), req(edited, tokens(5), turn=1)])[0] == [0, 16_384]


def test_sglang_extra_buffer_tracks_256_grid_and_the_branch_point():
    a = tokens(1000)
    b = np.concatenate([a[:700], tokens(300)])
    c = np.concatenate([a[:700], tokens(300)])
    d = np.concatenate([a[:900], tokens(50)])
    got, _ = cached("sglang-extra-buffer", [req(a, tokens(5)), req(b, tokens(5), turn=1),
                                            req(c, tokens(5), turn=2), req(d, tokens(5), turn=3)])
    # a tracks 768 (last 256-aligned position); b misses it (KV hit 700 < 768) and tracks the
    # 64-aligned branch point 640, which c then restores; d reaches a's 768.
    assert got == [0, 0, 640, 768]


def test_vllm_align_caches_block_boundaries_only():
    a = tokens(1200)
    b = np.concatenate([a[:1100], tokens(100)])
    short = tokens(400)
    got, _ = cached("vllm-align", [req(a, tokens(5)), req(b, tokens(5), turn=1),
                                   req(short, tokens(5), turn=2), req(np.concatenate([short, tokens(9)]), tokens(5), turn=3)])
    # Prefill is cut at the last full block (1056 = 2 x 528); a prompt shorter than a block caches nothing.
    assert got == [0, 1056, 0, 0]


def test_llamacpp_live_state_tail_checkpoint_and_no_cross_session_reuse():
    p1, o1 = tokens(2000), tokens(20)
    p2 = np.concatenate([p1, o1, tokens(100)])
    p3 = np.concatenate([p2[:1900], tokens(200)])
    other = np.concatenate([p1, tokens(50)])
    got, policy = cached("llamacpp", [req(p1, o1, turn=0), req(p2, tokens(5), turn=1),
                                      req(p3, tokens(5), turn=2), req(other, tokens(5), session="t")])
    # Turn 1 continues from the live state (prompt + output[:-1]). Turn 0 checkpointed at
    # 2000-4-512 = 1484; later candidates lie < 8192 tokens past it and are skipped; turn 2
    # edits at 1900 and restores 1484. Another session cannot use this slot's states.
    assert got == [0, 2019, 1484, 0]
    assert policy.slots_in_use <= 64


def test_marconi_admits_branch_points_and_sequence_ends():
    a = tokens(1000)
    b = np.concatenate([a[:600], tokens(400)])
    c = np.concatenate([a[:600], tokens(100)])
    got, policy = cached("marconi", [req(a, tokens(5)), req(b, tokens(5), turn=1), req(c, tokens(5), turn=2)])
    assert got == [0, 0, 600]
    # a's end, b's branch point and end, c's end.
    assert policy.slots_in_use == 4


def test_marconi_evicts_low_utility_under_pressure():
    # Budget 2: a long and a short sequence are kept; a third sequence forces one out. With
    # alpha > 0 the FLOP efficiency favours keeping the long sequence's state.
    long_p, long_out, short_p = tokens(6000), tokens(2), tokens(50)
    requests = [req(long_p, long_out, session="l"), req(short_p, tokens(2), session="s"),
                req(tokens(60), tokens(2), session="x"),
                req(np.concatenate([long_p, long_out, tokens(10)]), tokens(2), session="l", turn=1)]
    assert cached("marconi", requests, budget=2, alpha=2.0)[0][-1] == 6001
    # Recency alone (alpha = 0) evicts the least recently used state: the long one.
    assert cached("marconi", requests, budget=2, alpha=0.0)[0][-1] == 0


@pytest.mark.parametrize("name", PEER_POLICIES)
def test_budget_is_respected_and_outcomes_add_up(name):
    trace = synthetic_agent_trace(sessions=3, seed=1, min_steps=4, max_steps=8)
    policy = make_policy(name, 16, PROFILE)
    for step, (outcome,) in drive(trace.requests, [policy]):
        assert outcome.cached_tokens + outcome.recomputed_tokens == outcome.prompt_tokens
        assert 0 <= outcome.cached_tokens <= min(step.view.lcp, step.prompt_len - 1)
        if name != "oracle":
            assert policy.slots_in_use <= 16


def test_peers_never_beat_the_oracle():
    trace = synthetic_agent_trace(sessions=4, seed=2, min_steps=6, max_steps=12)
    policies = [make_policy(name, 256, PROFILE) for name in PEER_POLICIES]
    totals = np.zeros(len(policies))
    for _, outcomes in drive(trace.requests, policies):
        totals += [o.cached_tokens for o in outcomes]
    oracle = totals[PEER_POLICIES.index("oracle")]
    assert all(total <= oracle for total in totals)
    assert totals[PEER_POLICIES.index("none")] == 0


def clairvoyant(requests, budget):
    from sglang_hybrid.replay.policies.bounds import ClairvoyantPolicy

    policy = ClairvoyantPolicy(budget, PROFILE, requests)
    return [outcomes[0].cached_tokens for _, outcomes in drive(requests, [policy])], policy


def test_clairvoyant_keeps_the_checkpoint_used_soonest():
    # Two sessions share nothing; with one slot the clairvoyant keeps, after each request,
    # the target that comes back first: b's continuation is needed before a's.
    a1, b1 = tokens(500), tokens(400)
    oa, ob = tokens(5), tokens(5)
    requests = [req(a1, oa, session="a"), req(b1, ob, session="b", turn=1),
                req(np.concatenate([b1, ob, tokens(50)]), tokens(5), session="b", turn=2),
                req(np.concatenate([a1, oa, tokens(50)]), tokens(5), session="a", turn=3)]
    reused, _ = clairvoyant(requests, budget=1)
    # One slot: after b1 it holds b's continuation (used at b2, before a's at a2); a slot is
    # never emptied without need, so a's, taken first, was kept until b's displaced it.
    assert reused == [0, 0, 405, 0]
    reused, policy = clairvoyant(requests, budget=2)
    assert reused == [0, 0, 405, 505]
    assert policy.slots_peak <= 2


def test_clairvoyant_lies_between_the_oracle_and_no_cache_and_refuses_other_requests():
    trace = synthetic_agent_trace(sessions=4, seed=3, min_steps=6, max_steps=12)
    for budget in (1, 4, 64):
        reused, policy = clairvoyant(trace.requests, budget)
        oracle, _ = cached("oracle", trace.requests)
        assert all(0 <= r <= o for r, o in zip(reused, oracle))
        assert policy.slots_peak <= budget
    with pytest.raises(ValueError, match="requests it was built with"):
        list(drive(trace.requests[:1], [policy]))  # past the requests it was built with
    from sglang_hybrid.replay.policies.bounds import ClairvoyantPolicy

    with pytest.raises(ValueError, match="requests it was built with"):
        list(drive(list(reversed(trace.requests)), [ClairvoyantPolicy(4, PROFILE, trace.requests)]))

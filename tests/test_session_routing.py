"""Session routing across data-parallel replicas (``session_routing.py``), without a server:
the rank a session gets, and the hook on SGLang's DP dispatch."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from sglang.srt.managers.data_parallel_controller import LoadBalanceMethod
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_hybrid.session_routing import _route_session_to_its_replica, request_session, session_dp_rank

SESSIONS = [f"agent-{k}" for k in range(400)]


def test_a_session_always_gets_the_same_rank_and_sessions_spread():
    ranks = [session_dp_rank(s, [0, 1, 2, 3]) for s in SESSIONS]
    assert ranks == [session_dp_rank(s, [3, 2, 1, 0]) for s in SESSIONS]
    counts = Counter(ranks)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > len(SESSIONS) / 4 * 0.7


def test_when_a_replica_leaves_only_its_sessions_move():
    before = {s: session_dp_rank(s, [0, 1, 2, 3]) for s in SESSIONS}
    after = {s: session_dp_rank(s, [0, 1, 3]) for s in SESSIONS}
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == 2}


def test_no_active_rank_is_a_clear_error():
    with pytest.raises(ValueError, match="no active data-parallel rank"):
        session_dp_rank("a", [])


def _request(custom_params=None, routed_dp_rank=None):
    return SimpleNamespace(
        sampling_params=SamplingParams(custom_params=custom_params), routed_dp_rank=routed_dp_rank
    )


def _dispatch(req, method=LoadBalanceMethod.ROUND_ROBIN, active=(0, 1)):
    controller = SimpleNamespace(load_balance_method=method, _active_workers=list(active))
    seen = []
    _route_session_to_its_replica(lambda _, r: seen.append(r.routed_dp_rank), controller, req)
    return seen[0]


def test_the_hook_routes_a_session_and_explicit_ranks_win():
    assert _dispatch(_request({"checkpoint_session": "agent-7"})) == session_dp_rank("agent-7", [0, 1])
    other = 1 - session_dp_rank("agent-7", [0, 1])
    assert _dispatch(_request({"checkpoint_session": "agent-7"}, routed_dp_rank=other)) == other


@pytest.mark.parametrize("custom_params", [None, {}, {"checkpoint_session": 5}, {"checkpoint_hints": [16]}])
def test_requests_without_a_usable_session_are_left_to_sglangs_balancing(custom_params):
    assert request_session(_request(custom_params)) is None
    assert _dispatch(_request(custom_params)) is None


def test_bootstrap_room_routing_is_left_alone():
    req = _request({"checkpoint_session": "agent-7"})
    assert _dispatch(req, method=LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM) is None


class _Sent(Exception):
    pass


def test_the_replay_client_sends_its_session_as_the_routers_key(monkeypatch):
    import numpy as np

    from sglang_hybrid.replay import server_client
    from sglang_hybrid.replay.trace import Request

    sent = {}

    def record(url, **kwargs):
        sent.update(kwargs)
        raise _Sent

    monkeypatch.setattr(server_client.requests, "post", record)
    client = server_client.ServerClient(server_client.ServerInfo("http://router", "semantic", True))
    request = Request("agent-7", 0, 0.0, np.arange(1, 9, dtype=np.int32), np.array([1], dtype=np.int32))
    with pytest.raises(_Sent):
        client.serve(0, request, 0.0)
    assert sent["headers"] == {"X-SMG-Routing-Key": "agent-7"}
    assert sent["json"]["sampling_params"]["custom_params"]["checkpoint_session"] == "agent-7"

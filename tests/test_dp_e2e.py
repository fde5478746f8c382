"""Two data-parallel replicas (``--dp-size 2``) of the real SGLang server on this CPU host:
a session's turns stay on one replica, the one holding its checkpoints.

One server, the tiny random-weight Qwen3-Next, the ``semantic`` backend, SGLang's default
``round_robin`` balancing. Sessions that name themselves (``checkpoint_session``) are routed
by ``session_routing.py``: every turn lands on the session's replica and, from the second
turn on, restores the checkpoint the previous turn left. A session that does not name itself
is balanced round robin and its second turn, on the other replica, finds nothing cached; a
request that names its rank goes there. The environment the server gets for two ranks is
what ``sglang-hybrid launch`` sets on a host without CUDA (``cpu_parallel.py``).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import requests
from tiny_server import SERVER_ON_CPU_HOST, SGLangServer, write_tiny_qwen3_next

from sglang_hybrid.cpu_parallel import cpu_parallel_env, usable_cpus
from sglang_hybrid.session_routing import session_dp_rank

pytestmark = [*SERVER_ON_CPU_HOST, pytest.mark.multi_rank]

DP_SIZE = 2
NEW_TOKENS = 4
TURNS = 3
# Two ranks start in about 130 s on two idle cores; other work on the host slows them.
STARTUP_TIMEOUT_S = 480.0
# One session per replica under the session routing.
SESSIONS = ["agent-0", "agent-1"]


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    model_dir = write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"))
    env = {
        "SGLANG_HYBRID_CONFIG": json.dumps({"state_checkpoint_slots": 16}),
        **cpu_parallel_env(DP_SIZE, os.environ, cuda_available=False, cpus=usable_cpus()),
    }
    server = SGLangServer(
        model_dir,
        ["--radix-cache-backend", "semantic", "--dp-size", str(DP_SIZE)],
        env=env,
        log_path=tmp_path_factory.mktemp("dp_logs") / "dp.log",
    )
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        yield server
    finally:
        server.stop()


def _sessions(server, rng, sessions, *, named=True):
    """Sessions of ``TURNS`` turns each, interleaved turn by turn; each turn is its
    predecessor's prompt and answer plus new tokens; ``named``: the requests carry their
    session as ``checkpoint_session``. Returns per session and turn
    (dp rank, cached tokens, prompt length)."""
    prompts = {s: [rng.randrange(1, 511) for _ in range(40)] for s in sessions}
    seen = {s: [] for s in sessions}
    for _ in range(TURNS):
        for session in sessions:
            custom = {"custom_params": {"checkpoint_session": session}} if named else {}
            reply = _generate(server, prompts[session], custom)
            meta = reply["meta_info"]
            seen[session].append((meta["dp_rank"], meta["cached_tokens"], len(prompts[session])))
            prompts[session] += reply["output_ids"] + [rng.randrange(1, 511) for _ in range(8)]
    return seen


def _generate(server, prompt, custom, extra=None):
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, **custom}
    payload = {"input_ids": prompt, "sampling_params": sampling, **(extra or {})}
    response = requests.post(f"{server.base_url}/generate", json=payload, timeout=300)
    response.raise_for_status()
    return response.json()


def test_sessions_stay_on_their_replica_and_hit_the_cache_every_turn(dp_server):
    expected = {s: session_dp_rank(s, list(range(DP_SIZE))) for s in SESSIONS}
    assert set(expected.values()) == set(range(DP_SIZE)), "the sessions should cover both replicas"
    for session, turns in _sessions(dp_server, random.Random(0), SESSIONS).items():
        assert {rank for rank, _, _ in turns} == {expected[session]}, turns
        for (_, cached, _), (_, _, previous_prompt) in zip(turns[1:], turns):
            # The previous turn's finish checkpoint: its prompt and answer but the last token.
            assert cached == previous_prompt + NEW_TOKENS - 1, turns


def test_an_unnamed_session_is_balanced_round_robin_and_loses_its_cache(dp_server):
    turns = _sessions(dp_server, random.Random(1), ["unnamed"], named=False)["unnamed"]
    assert turns[0][0] != turns[1][0]
    assert turns[1][1] == 0


def test_a_rank_the_request_names_wins_over_the_session(dp_server):
    session = SESSIONS[0]
    other = 1 - session_dp_rank(session, list(range(DP_SIZE)))
    named = {"custom_params": {"checkpoint_session": session}}
    reply = _generate(dp_server, [7] * 20, named, {"routed_dp_rank": other})
    assert reply["meta_info"]["dp_rank"] == other

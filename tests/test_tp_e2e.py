"""Two tensor-parallel ranks (``--tp-size 2``, gloo) of the real SGLang server on this CPU
host hold the same tree and checkpoint slots, and answer as one rank does.

Two servers of the tiny random-weight Qwen3-Next with the ``semantic`` backend and a pool
small enough to evict (4 device slots, 4 host slots: evictions demote to the host tier,
demoted checkpoints are promoted back): one with two TP ranks, one with one. The same
multi-session trace with edits goes to both; greedy outputs (in float32, where the ranks'
other summation order does not flip near-tied tokens) and cached tokens must agree turn by
turn. With ``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK=1`` each scheduler logs its
``state_digest`` when it goes idle; the last digest of rank 0 and rank 1 must be equal. The
cache's Prometheus series carry each rank's ``tp_rank`` label and show the evictions.
"""

from __future__ import annotations

import json
import os
import random
import re
import time

import pytest
import requests
from tiny_server import SERVER_ON_CPU_HOST, SGLangServer, write_tiny_qwen3_next

from sglang_hybrid.cpu_parallel import cpu_parallel_env, usable_cpus

pytestmark = [*SERVER_ON_CPU_HOST, pytest.mark.multi_rank]

TP_SIZE = 2
NEW_TOKENS = 4
SESSIONS = 3
TURNS = 3
CACHE_CONFIG = {"state_checkpoint_slots": 4, "state_checkpoint_host_slots": 4}
# float32: two ranks sum a layer's partial products in another order than one rank, which
# in bfloat16 flips greedy choices between near-tied tokens of the random-weight model.
FLAGS = ["--radix-cache-backend", "semantic", "--enable-metrics", "--dtype", "float32"]
# Two ranks start in about 130 s on two idle cores; other work on the host slows them.
STARTUP_TIMEOUT_S = 480.0
DIGEST_LINE = re.compile(r"semantic state digest tp_rank=(\d+): ([0-9a-f]+)")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(two-rank, one-rank) servers."""
    model_dir = write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"))
    logs = tmp_path_factory.mktemp("tp_logs")
    env = {
        "SGLANG_HYBRID_CONFIG": json.dumps(CACHE_CONFIG),
        "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
    }
    two_ranks_env = cpu_parallel_env(TP_SIZE, os.environ, cuda_available=False, cpus=usable_cpus())
    started = []
    try:
        # One after the other: two start-ups at once on two cores take longer than both.
        for extra, rank_env, log in ((["--tp-size", str(TP_SIZE)], two_ranks_env, "tp2.log"), ([], {}, "tp1.log")):
            server = SGLangServer(model_dir, [*FLAGS, *extra], env={**env, **rank_env}, log_path=logs / log)
            started.append(server)
            server.wait_ready(STARTUP_TIMEOUT_S)
        yield tuple(started)
    finally:
        for server in started:
            server.stop()


def _generate(server, prompt, session):
    sampling = {
        "temperature": 0.0,
        "max_new_tokens": NEW_TOKENS,
        "ignore_eos": True,
        "custom_params": {"checkpoint_session": session},
    }
    response = requests.post(
        f"{server.base_url}/generate", json={"input_ids": prompt, "sampling_params": sampling}, timeout=300
    )
    response.raise_for_status()
    reply = response.json()
    return reply["output_ids"], reply["meta_info"]["cached_tokens"]


def _last_digests(server) -> dict[int, str]:
    digests = {}
    for rank, digest in DIGEST_LINE.findall(server.log_tail(10**8)):
        digests[int(rank)] = digest
    return digests


def _series(server, name: str) -> dict[str, float]:
    """``tp_rank`` -> value of the cache's series ``name`` on /metrics."""
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    pattern = re.compile(rf'^sglang:semantic_{name}\{{([^}}]*)\}} ([0-9.e+-]+)$', re.MULTILINE)
    values = {}
    for labels, value in pattern.findall(text):
        rank = re.search(r'tp_rank="(\d+)"', labels)
        if rank:
            values[rank.group(1)] = values.get(rank.group(1), 0.0) + float(value)
    return values


def test_two_ranks_agree_with_each_other_and_with_one_rank(servers):
    two_ranks, one_rank = servers
    rng = random.Random(0)
    prompts = {f"agent-{k}": [rng.randrange(1, 511) for _ in range(60)] for k in range(SESSIONS)}
    for turn in range(TURNS):
        for session, prompt in prompts.items():
            if turn == TURNS - 1:
                # The agent masks an old tool output: an edit in the middle of the history.
                prompt[30:40] = [rng.randrange(1, 511) for _ in range(10)]
            answer, cached = _generate(two_ranks, prompt, session)
            reference, reference_cached = _generate(one_rank, prompt, session)
            assert answer == reference, f"{session} turn {turn}: outputs differ between 2 ranks and 1"
            assert cached == reference_cached, f"{session} turn {turn}"
            prompt += answer + [rng.randrange(1, 511) for _ in range(8)]

    # Each scheduler logs its digest when it goes idle after the last request.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        digests, reference = _last_digests(two_ranks), _last_digests(one_rank)
        if set(digests) == {0, 1} and digests[0] == digests[1] == reference.get(0):
            break
        time.sleep(1)
    assert set(digests) == {0, 1}, two_ranks.log_tail()
    assert digests[0] == digests[1], "the two TP ranks hold different trees or checkpoint slots"
    assert digests[0] == reference[0], "the TP ranks' state differs from the one-rank server's"

    demoted = _series(two_ranks, "checkpoints_demoted_total")
    assert set(demoted) == {"0", "1"} and demoted["0"] == demoted["1"] > 0, demoted
    assert "memory leak detected" not in two_ranks.log_tail(10**8)

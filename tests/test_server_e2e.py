"""The real SGLang server, end to end on this CPU host, with the ``semantic`` cache backend.

Two ``sglang.launch_server`` processes serve the same tiny random-weight Qwen3-Next: one
with ``--radix-cache-backend semantic``, one with ``--disable-radix-cache``. An edited
multi-turn session goes to both; greedy outputs must agree token for token (a restored
checkpoint that were wrong would change them), and the semantic server must reuse the
cache where a checkpoint exists. A long request is aborted mid-decode; afterwards the
server must still serve and still hit its cache; so must a third server, with SGLang's
streaming sessions on, after a session's turn is aborted. SGLang's scheduler itself checks, each
time it goes idle, that every live state slot is free and that the checkpoint pool holds
exactly the slots its tree references (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``,
on by default, raises inside the scheduler on a leak); the test also reads the server
log for those leak reports. Neither pool's occupancy is exposed over HTTP
(``/get_server_info`` and ``/v1/loads`` report token usage only).
"""

import json
import random
import threading
import time

import pytest
import requests

from tiny_server import SERVER_ON_CPU_HOST

pytestmark = list(SERVER_ON_CPU_HOST)

NEW_TOKENS_PER_TURN = 4
# Seeds of this module's prompts, apart from those of the other tests on the shared
# servers (test_replay_server.py uses 1 and 2), whose checkpoints the tree still holds.
SEEDS = (1000, 1001)


@pytest.fixture(scope="module")
def servers(tiny_server_pair):
    return tiny_server_pair


def _tokens(rng, n):
    # Token 0 and the EOS id (vocab - 1) are left out so that every prompt is plain text.
    return [rng.randrange(1, 511) for _ in range(n)]


def _ask_both(semantic, no_cache, input_ids, checkpoint_hints=None):
    """Send one turn to both servers; return (output ids, cached tokens, seconds) of semantic."""
    extra = {}
    if checkpoint_hints is not None:
        extra["custom_params"] = {"checkpoint_hints": checkpoint_hints}
    started = time.monotonic()
    answer = _generate(semantic, input_ids, extra)
    seconds = time.monotonic() - started
    reference = _generate(no_cache, input_ids, extra)
    assert answer["output_ids"] == reference["output_ids"], (
        "greedy output differs between the semantic cache and no cache"
    )
    assert reference["meta_info"]["cached_tokens"] == 0
    return answer["output_ids"], answer["meta_info"]["cached_tokens"], seconds


def _generate(server, input_ids, sampling_extra):
    sampling_params = {
        "temperature": 0.0,
        "max_new_tokens": NEW_TOKENS_PER_TURN,
        "ignore_eos": True,
        **sampling_extra,
    }
    response = requests.post(
        f"{server.base_url}/generate",
        json={"input_ids": input_ids, "sampling_params": sampling_params},
        timeout=300,
    )
    response.raise_for_status()
    return response.json()


def _abort_mid_decode(server, input_ids, rid="e2e-long-request", **extra):
    """Start a request far too long to finish, abort it while it decodes; return its reply."""
    reply = {}

    def run():
        reply.update(server.generate(input_ids, 1500, rid=rid, **extra))

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    # Abort only once the request runs (is past its prefill), so it holds a live state slot.
    while time.monotonic() < deadline and server.num_running_requests() == 0:
        time.sleep(0.2)
    time.sleep(1.0)
    requests.post(f"{server.base_url}/abort_request", json={"rid": rid}, timeout=30)
    thread.join(timeout=120)
    assert not thread.is_alive(), "aborted request did not return"
    return reply


def test_edited_session_matches_no_cache_and_reuses_checkpoints(servers):
    semantic, no_cache = servers
    rng = random.Random(SEEDS[0])

    turn1 = _tokens(rng, 40)
    out1, cached1, _ = _ask_both(semantic, no_cache, turn1)
    assert cached1 == 0

    # Turn 2 extends turn 1's prompt and answer: the checkpoint stored when turn 1
    # finished covers all of it but the last generated token (whose KV was never computed).
    turn2 = turn1 + out1 + _tokens(rng, 12)
    out2, cached2, _ = _ask_both(semantic, no_cache, turn2)
    assert cached2 == len(turn1) + len(out1) - 1

    # The same prompt again: turn 2's own finish checkpoint lies past its prompt, but the
    # planner had turn 2's prefill capture the state one token before its prompt end.
    out3, cached3, _ = _ask_both(semantic, no_cache, turn2)
    assert out3 == out2
    assert cached3 == len(turn2) - 1

    # An edit in the middle (position 20): nothing after the edit is reusable, and no
    # checkpoint exists before it.
    turn4 = turn2[:20] + _tokens(rng, 5) + turn2[25:]
    _, cached4, _ = _ask_both(semantic, no_cache, turn4)
    assert cached4 <= 20

    aborted = _abort_mid_decode(semantic, _tokens(rng, 30))
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < 1500

    # After the abort the server still serves, and turn 2's finish checkpoint is intact.
    turn5 = turn2 + out2 + _tokens(rng, 6)
    _, cached5, _ = _ask_both(semantic, no_cache, turn5)
    assert cached5 == len(turn2) + len(out2) - 1

    # Let the scheduler go idle, where it checks both state pools for leaks.
    time.sleep(3)
    assert semantic.process.poll() is None
    assert requests.get(f"{semantic.base_url}/health_generate", timeout=60).ok
    assert "memory leak detected" not in semantic.log_tail(10**7)


def test_one_prefill_captures_every_anchor_across_chunks(servers):
    """A 700-token prompt prefilled in two chunks (--chunked-prefill-size 512) with anchors
    at 40, 100 and 600: each later request that leaves the prompt just after an anchor
    restores exactly that anchor's state, captured inside the prefill forward that crossed it
    (600 in the second chunk), and answers exactly as a server without cache."""
    semantic, no_cache = servers
    rng = random.Random(SEEDS[1])
    prompt = _tokens(rng, 700)
    _, cached, _ = _ask_both(semantic, no_cache, prompt, checkpoint_hints=[40, 100, 600])
    assert cached == 0

    for anchor in (600, 100, 40):
        edited = prompt[:anchor] + _tokens(rng, 30)
        _, cached, _ = _ask_both(semantic, no_cache, edited)
        assert cached == anchor, f"edit after anchor {anchor} restored {cached} tokens"


def test_close_session_ends_the_checkpoint_session(servers):
    """``/close_session`` with the name an agent session's requests carry as
    ``checkpoint_session`` ends that session in the semantic cache's planning (the scheduler
    logs it); SGLang, which has no session of its own by that id, only warns, and the server
    keeps serving."""
    semantic, _ = servers
    session = "e2e-closed-session"
    prompt = _tokens(random.Random(SEEDS[1] + 7), 24)
    _generate(semantic, prompt, {"custom_params": {"checkpoint_session": session}})
    requests.post(f"{semantic.base_url}/close_session", json={"session_id": session}, timeout=60).raise_for_status()
    ended = f"checkpoint session {session!r} ended"
    deadline = time.monotonic() + 30
    while ended not in semantic.log_tail(10**6) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ended in semantic.log_tail(10**6)
    assert _generate(semantic, prompt, {})["meta_info"]["cached_tokens"] > 0


@pytest.fixture(scope="module")
def streaming_server(tmp_path_factory):
    """A semantic server with SGLang's streaming sessions on (off by default)."""
    from tiny_server import PAIR_CHECKPOINT_SLOTS, SGLangServer, write_tiny_qwen3_next

    model_dir = write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next_streaming"))
    server = SGLangServer(
        model_dir,
        ["--radix-cache-backend", "semantic", "--enable-streaming-session"],
        env={"SGLANG_HYBRID_CONFIG": json.dumps({"state_checkpoint_slots": PAIR_CHECKPOINT_SLOTS})},
        log_path=tmp_path_factory.mktemp("streaming_server_log") / "semantic.log",
    )
    try:
        server.wait_ready(timeout_s=600)
        yield server
    finally:
        server.stop()


def test_a_streaming_session_goes_on_after_an_aborted_turn(streaming_server):
    """SGLang's streaming sessions build each turn by extending the previous turn's token
    arrays in place. A turn the semantic cache planned and that was aborted mid-decode (it
    never finishes) must leave them resizable: the session's next turn is served."""
    semantic = streaming_server
    opened = requests.post(f"{semantic.base_url}/open_session",
                           json={"capacity_of_str_len": 1 << 20, "streaming": True}, timeout=60)
    opened.raise_for_status()
    session_id = opened.json()
    session = {"session_params": {"id": session_id}}
    rng = random.Random(SEEDS[1] + 11)
    semantic.generate(_tokens(rng, 20), NEW_TOKENS_PER_TURN, **session)
    aborted = _abort_mid_decode(semantic, _tokens(rng, 10), rid="e2e-streaming-turn", **session)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    after = semantic.generate(_tokens(rng, 10), NEW_TOKENS_PER_TURN, **session)
    assert len(after["output_ids"]) == NEW_TOKENS_PER_TURN
    requests.post(f"{semantic.base_url}/close_session", json={"session_id": session_id}, timeout=60).raise_for_status()

"""The real SGLang server, end to end on this CPU host, serving tiny Mamba2 hybrids
(NemotronH, GraniteMoeHybrid) with the ``semantic`` backend and in-prefill anchor checkpoints.

For each model a ``--radix-cache-backend semantic`` server and a ``--disable-radix-cache`` one
get the same requests; greedy outputs must agree token for token. A 700-token prompt is
prefilled in two chunks (``--chunked-prefill-size 512``) with anchors on both sides of the
chunk boundary (40, 100 | 600); the states the Mamba2 layers captured there inside those
forwards (``runtime/mamba2_hooks.py``) are what later requests, edited just after each
anchor, restore: the restore depth shows in ``meta_info`` and the answers equal uncached
serving. (The captured states themselves are compared with separate prefills in
``test_mamba2_capture.py``.) A follow-up turn restores the previous request's end state.
"""

import json
import random

import pytest
import requests

from tiny_mamba2_server import write_tiny_granite_moe_hybrid, write_tiny_nemotron_h
from tiny_server import SERVER_ON_CPU_HOST, SGLangServer

pytestmark = list(SERVER_ON_CPU_HOST)

NEW_TOKENS = 4
CHECKPOINT_SLOTS = 16
WRITERS = {"nemotron_h": write_tiny_nemotron_h, "granitemoehybrid": write_tiny_granite_moe_hybrid}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def servers(request, tmp_path_factory):
    """(semantic, no-cache) servers of one model, started together; one model at a time."""
    model_dir = WRITERS[request.param](tmp_path_factory.mktemp(request.param))
    logs = tmp_path_factory.mktemp(f"{request.param}_logs")
    semantic = SGLangServer(
        model_dir,
        ["--radix-cache-backend", "semantic"],
        env={"SGLANG_HYBRID_CONFIG": json.dumps({"state_checkpoint_slots": CHECKPOINT_SLOTS})},
        log_path=logs / "semantic.log",
    )
    no_cache = SGLangServer(model_dir, ["--disable-radix-cache"], log_path=logs / "no_cache.log")
    try:
        semantic.wait_ready()
        no_cache.wait_ready()
        yield semantic, no_cache
    finally:
        semantic.stop()
        no_cache.stop()


def _tokens(rng, n):
    # Token 0 and the EOS id (vocab - 1) are left out so that every prompt is plain text.
    return [rng.randrange(1, 511) for _ in range(n)]


def _ask_both(semantic, no_cache, input_ids, checkpoint_hints=None):
    """One request to both servers; returns the semantic server's (output ids, cached
    tokens, restored tokens reported in meta_info)."""
    extra = {} if checkpoint_hints is None else {"custom_params": {"checkpoint_hints": checkpoint_hints}}
    answer, reference = (_generate(server, input_ids, extra) for server in (semantic, no_cache))
    assert answer["output_ids"] == reference["output_ids"], "greedy output differs from no cache"
    meta = answer["meta_info"]
    return answer["output_ids"], meta["cached_tokens"], meta["semantic_cache"][0]["restored_tokens"]


def _generate(server, input_ids, sampling_extra):
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, **sampling_extra}
    response = requests.post(
        f"{server.base_url}/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=300
    )
    response.raise_for_status()
    return response.json()


def test_anchors_captured_across_prefill_chunks_restore_edited_prompts_exactly(servers):
    semantic, no_cache = servers
    rng = random.Random(1)
    prompt = _tokens(rng, 700)
    output, cached, restored = _ask_both(semantic, no_cache, prompt, checkpoint_hints=[40, 100, 600])
    assert cached == restored == 0

    for anchor in (600, 100, 40):
        edited = prompt[:anchor] + _tokens(rng, 30)
        _, cached, restored = _ask_both(semantic, no_cache, edited)
        assert cached == restored == anchor, f"an edit after anchor {anchor} restored {restored} tokens"

    # The next turn extends the first prompt and its answer: the end-of-request checkpoint
    # covers all of it but the last generated token (whose KV was never computed).
    follow_up = prompt + output + _tokens(rng, 12)
    _, cached, restored = _ask_both(semantic, no_cache, follow_up)
    assert cached == restored == len(prompt) + len(output) - 1
    assert "memory leak detected" not in semantic.log_tail(10**7)

"""The agent examples in examples/, run against a real SGLang server with the semantic cache.

The server is the one docs/serving.md starts on a machine without a GPU
(``sglang-hybrid launch --tiny-model qwen3-next``, the ``documented_cpu_server`` fixture): a
tiny random-weight Qwen3-Next with an offline character-level tokenizer, so the SGLang
frontend can send text.
Each example's ``main()`` runs a few calls of its scripted agent. Every call must print its
cache line, and must have been served from at least the deepest end-of-call checkpoint its
prompt extends: the state the server keeps when a call finishes covers that call's prompt
and reply, so a later prompt that starts with them must restore at least that deep. The
examples' edits are chosen so that each run has calls that reuse a prefix after an edit,
and calls whose edit leaves no such checkpoint.
"""

import contextlib
import io
import sys
from pathlib import Path

import pytest

from sglang_hybrid.replay.shared_data import QWEN3_TEMPLATE
from tiny_server import SERVER_ON_CPU_HOST

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import agent_observation_masking  # noqa: E402
import agent_reasoning_stripping  # noqa: E402
import agent_summarization  # noqa: E402

pytestmark = list(SERVER_ON_CPU_HOST)

# Small on purpose: every prompt token is one character, and two CPU cores serve them.
MAX_TOKENS = 4
# example module -> its arguments besides --url and --max-tokens
RUNS = {
    # keep 1: the third call masks the first tool output; the first call's checkpoint
    # (system, task, first thought) lies before it.
    "masking": (agent_observation_masking, ["--turns", "3", "--keep", "1"]),
    # Query 1 takes calls 1-2 (a tool call, the answer); query 2 starts at call 3, which
    # drops the reasoning of calls 1-2.
    "reasoning": (agent_reasoning_stripping, ["--turns", "4"]),
    # max-events 8: call 5 sees 10 messages and summarizes all but the first two and the
    # last one (8 // 2 - 2 - 1); call 6 appends to the summary.
    "summarization": (
        agent_summarization,
        ["--turns", "6", "--keep-first", "2", "--max-events", "8", "--summary-words", "12"],
    ),
}


@pytest.fixture(scope="module")
def server(documented_cpu_server):
    return documented_cpu_server


@pytest.fixture(scope="module")
def runs(server):
    """example name -> (its call records, what it printed)."""
    results = {}
    for name, (module, args) in RUNS.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            records = module.main(
                ["--url", server.base_url, "--max-tokens", str(MAX_TOKENS), *args]
            )
        results[name] = (records, printed.getvalue())
    return results


def checkpointed_depth(records, index):
    """Tokens covered by the deepest end-of-call state an earlier call left on this prompt.

    A finished call's state covers its prompt and reply but the last generated token. The
    test tokenizer encodes text one character per id and decodes every generated id but
    three specials back to its character, so text prefixes are token prefixes.
    """
    prompt = records[index].prompt
    return max(
        (
            earlier.prompt_tokens + earlier.completion_tokens - 1
            for earlier in records[:index]
            if prompt.startswith(earlier.prompt + earlier.reply)
        ),
        default=0,
    )


@pytest.mark.parametrize("name", RUNS)
def test_each_call_prints_its_cache_line(runs, name):
    records, printed = runs[name]
    lines = printed.strip().splitlines()
    assert lines[0].split()[:6] == ["call", "prompt", "cached", "restored", "kv_hit", "recomputed"]
    assert len(lines) == len(records) + 2
    for record, line in zip(records, lines[1:]):
        columns = line.split()
        assert [int(value) for value in columns[:6]] == [
            record.turn,
            record.prompt_tokens,
            record.cached_tokens,
            record.restored_tokens,
            record.kv_hit_tokens,
            record.prompt_tokens - record.cached_tokens,
        ]
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    assert lines[-1].startswith(f"total: {prompt} prompt tokens, {cached} cached")


@pytest.mark.parametrize("name", RUNS)
def test_calls_restore_the_checkpoints_their_prompts_extend(runs, name):
    records, _ = runs[name]
    assert [r.turn for r in records] == list(range(1, len(records) + 1))
    for index, record in enumerate(records):
        depth = checkpointed_depth(records, index)
        assert record.restored_tokens == record.cached_tokens
        assert depth <= record.cached_tokens <= record.kv_hit_tokens < record.prompt_tokens, (
            f"call {record.turn}: checkpoint at {depth} on its prompt, {record.cached_tokens} "
            f"cached, {record.kv_hit_tokens} in the KV tree, {record.prompt_tokens} in the prompt"
        )
        if depth:
            assert record.cached_tokens > 0


def _edits(records):
    return [record.edit for record in records]


def test_masking_reuses_the_unmasked_head(runs):
    records, _ = runs["masking"]
    assert _edits(records) == [
        "first call",
        "appended",
        "edited from prompt message 3 (user)",  # the first tool output, masked
    ]
    assert "Old environment output" in records[2].prompt
    # The masked call still restores the first call's checkpoint.
    assert checkpointed_depth(records, 1) > 0 and checkpointed_depth(records, 2) > 0


def test_reasoning_is_dropped_at_a_new_query(runs):
    records, _ = runs["reasoning"]
    assert _edits(records) == [
        "first call",
        "appended",
        "edited from prompt message 2 (assistant)",  # query 2: reasoning of calls 1-2 dropped
        "appended",
    ]
    history = [record.prompt.rsplit("<|im_start|>assistant", 1)[0] for record in records]
    assert "<think>" in history[1] and "<think>" not in history[2]
    depths = [checkpointed_depth(records, index) for index in range(len(records))]
    assert depths[1] > 0 and depths[3] > 0
    # Every checkpoint of query 1 lies past the first turn whose reasoning was dropped.
    assert depths[2] == 0


def test_summary_replaces_the_middle_of_the_history(runs):
    records, _ = runs["summarization"]
    assert _edits(records) == [
        "first call",
        "appended",
        "appended",
        "appended",
        "edited from prompt message 2 (assistant)",  # summary after system and task
        "appended",
    ]
    assert [m["role"] for m in records[4].messages] == ["system", "user", "user", "tool"]
    assert records[4].messages[2]["content"].startswith("Summary of earlier events:")
    depths = [checkpointed_depth(records, index) for index in range(len(records))]
    assert all(depths[index] > 0 for index in (1, 2, 3, 5))
    assert depths[4] == 0


@pytest.mark.skipif(not QWEN3_TEMPLATE.exists(), reason="../shared/data not present")
@pytest.mark.parametrize("name", RUNS)
def test_prompts_are_what_the_qwen3_template_renders(runs, name):
    from sglang_hybrid.replay.rendering import render_chat

    records, _ = runs[name]
    generation_prefix = "<think>\n" if name == "reasoning" else ""
    for record in records:
        expected = render_chat(record.messages, template_path=QWEN3_TEMPLATE)
        assert record.prompt == expected + generation_prefix


def test_server_served_every_call_without_errors(server, runs):
    assert server.process.poll() is None
    log = server.log_tail(10**7)
    assert "Traceback" not in log
    assert "memory leak detected" not in log

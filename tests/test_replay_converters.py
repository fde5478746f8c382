"""Converters and edit emulators on the real traces in ../shared/data/traces.

Each edit test checks *where* the first divergence between a call's prompt and the previous
call's prompt+output lands, against where the framework puts it.
"""

import json

import numpy as np
import pytest

from sglang_hybrid.replay.rendering import qwen3_encoding
from sglang_hybrid.replay.converters import (
    RenderConfig, calls_to_trace, convert, history_calls, mooncake_trace, sweagent_calls, sweagent_history, taubench_calls,
)
from sglang_hybrid.replay.emulators import LastNObservations, make_emulator
from sglang_hybrid.replay.shared_data import (
    MOONCAKE_CONVERSATIONS,
    QWEN3_TEMPLATE,
    SWE_AGENT_TRAJ,
    TAU_BENCH_AIRLINE,
    TRACES,
)

SWE, TAU, MOONCAKE = SWE_AGENT_TRAJ, TAU_BENCH_AIRLINE, MOONCAKE_CONVERSATIONS
QWEN3 = str(QWEN3_TEMPLATE)
IM_END = 151645

pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason="shared trace data not present")


def lcp(a, b):
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def open_message(text):
    """The rendered message the text ends inside of (from its <|im_start|> on), or None if it ended."""
    last = text.rsplit("<|im_start|>", 1)[-1]
    return None if "<|im_end|>" in last else last


def divergences(trace):
    """(previous prompt+output, decoded text before the divergence, lcp) per consecutive call pair."""
    decode = qwen3_encoding().decode
    by_session = {}
    for r in trace.requests:
        by_session.setdefault(r.session, []).append(r)
    out = []
    for requests in by_session.values():
        requests.sort(key=lambda r: r.turn)
        for prev, cur in zip(requests, requests[1:]):
            seq = np.concatenate([prev.input_ids, prev.output_ids])
            k = lcp(seq, cur.input_ids)
            out.append((seq, decode(seq[:k].tolist()), k))
    return out


def test_sweagent_emulator_reproduces_the_recorded_prompts():
    recorded = sweagent_calls(SWE)
    history = sweagent_history(SWE)
    rebuilt = LastNObservations(n=5).apply(
        [c.__class__(c.session, c.turn, history[: len(c.messages)], c.output) for c in recorded])
    assert len(recorded) == 13
    for original, emulated in zip(recorded, rebuilt):
        assert [m["content"] for m in emulated.messages] == [m["content"] for m in original.messages]


def test_sweagent_divergence_moves_to_the_newly_omitted_observation():
    trace = convert("swe-agent", SWE)
    assert all(r.output_ids[-1] == IM_END for r in trace.requests)
    pairs = divergences(trace)
    appended = [k == len(seq) for seq, _, k in pairs]
    # Calls 1..5 only append; from call 6 on each call rewrites an observation inside a tool response.
    assert appended[:5] == [True] * 5
    for seq, text, k in pairs[5:]:
        assert k < len(seq) and open_message(text).startswith("user\n<tool_response>")


def test_taubench_append_only_under_chatml():
    trace = convert("tau-bench", TAU, limit=5)
    assert trace.meta["arrival_s"]["assigned_by"] == "ArrivalModel"
    assert all(k == len(seq) for seq, _, k in divergences(trace))


def _tau_with(emulator, template=None, runs=6):
    return calls_to_trace(taubench_calls(TAU, limit=runs), source=str(TAU), converter="tau-bench",
                          emulator=emulator, render=RenderConfig(template))


def test_qwen3_reasoning_dropped_once_per_user_turn():
    trace = _tau_with(make_emulator("qwen3-reasoning"), QWEN3)
    pairs = divergences(trace)
    diverged = [(text, k) for seq, text, k in pairs if k < len(seq)]
    assert 0 < len(diverged) < len(pairs)  # only calls that follow a new user query
    assert all(text.endswith("<|im_start|>assistant\n") for text, _ in diverged)


def test_qwen3_no_thinking_diverges_every_call_at_the_previous_assistant():
    pairs = divergences(_tau_with(make_emulator("qwen3-no-thinking"), QWEN3))
    assert all(k < len(seq) and text.endswith("<|im_start|>assistant\n") for seq, text, k in pairs)


@pytest.mark.parametrize("name, params, diverging_message", [
    ("openhands-masking", {"attention_window": 5}, "user\n<tool_response>"),
    ("swe-agent-last-n", {"n": 2}, "user\n<tool_response>"),
    ("claude-code-clear", {"idle_probability": 1.0, "keep_recent": 1}, "user\n<tool_response>"),
    # The chat-files block (a user message) now sits where the previous history ended.
    ("aider", {}, "user\n"),
])
def test_edit_lands_where_the_framework_puts_it(name, params, diverging_message):
    pairs = divergences(_tau_with(make_emulator(name, **params)))
    diverged = [text for seq, text, k in pairs if k < len(seq)]
    assert diverged and all((open_message(text) or "").startswith(diverging_message) for text in diverged)


@pytest.mark.parametrize("name, params", [
    ("letta", {"edit_probability": 0.5}),
    ("date-line", {"seconds_per_call": 43_200.0}),
])
def test_system_prompt_edits_diverge_inside_the_system_prompt(name, params):
    pairs = divergences(_tau_with(make_emulator(name, **params)))
    diverged = [text for seq, text, k in pairs if k < len(seq)]
    assert diverged and all((open_message(text) or "").startswith("system\n") for text in diverged)


@pytest.mark.parametrize("name, params, kept_messages", [
    ("openhands-summarize", {"keep_first": 4, "max_size": 12}, 4),
    ("openhands-recent", {"keep_first": 1, "max_events": 8}, 1),
    ("claude-code-compact", {"context_tokens": 3000}, 1),
])
def test_condensers_diverge_after_the_kept_head(name, params, kept_messages):
    trace = _tau_with(make_emulator(name, **params))
    pairs = divergences(trace)
    diverged = [(seq, k) for seq, _, k in pairs if k < len(seq)]
    assert diverged
    for seq, k in diverged:
        # The kept head (system + kept_messages-1 events) is reused; a condensed view shifts
        # everything after it, so the divergence sits right after the head (messages whose
        # rendering happens to coincide can push it a little further, never into the head).
        starts = np.flatnonzero(seq[:k] == 151644)
        assert kept_messages + 1 <= len(starts) <= kept_messages + 3


def test_mooncake_equal_hashes_give_equal_tokens():
    lines = [json.loads(line) for _, line in zip(range(300), MOONCAKE.open())]
    trace = mooncake_trace(MOONCAKE, limit=300)
    assert [len(r.input_ids) for r in trace.requests] == [line["input_length"] for line in lines]
    for i, j in [(0, 1), (0, 2), (5, 9)]:
        a, b = lines[i]["hash_ids"], lines[j]["hash_ids"]
        shared = lcp(a, b)
        k = lcp(trace.requests[i].input_ids, trace.requests[j].input_ids)
        assert shared * 512 <= k < (shared + 1) * 512 or k == min(len(trace.requests[i].input_ids),
                                                                   len(trace.requests[j].input_ids))
    assert trace.requests[10].arrival_s == lines[10]["timestamp"] / 1000


def test_openai_jsonl_keeps_sessions_and_timestamps(tmp_path):
    history = json.loads(TAU.read_text())[0]["traj"]
    calls = history_calls("a", history)[:3]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"session": "a", "arrival_s": float(i), "messages": c.messages,
                                        "output": c.output}) + "\n" for i, c in enumerate(calls)))
    trace = convert("openai-jsonl", path)
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0, 2.0]
    assert [r.turn for r in trace.requests] == [0, 1, 2]
    assert all(k == len(seq) for seq, _, k in divergences(trace))

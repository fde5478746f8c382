"""A seeded synthetic agent workload the project generates itself (no external data).

Sessions of a coding agent: a system prompt with tool schemas, a user task, then steps of
assistant tool calls and tool results, with an occasional follow-up user turn. Rendered with our
ChatML (render_chatml) and tokenized with the Qwen3 tokenizer; the SWE-agent last-5-observations
edit is applied so the default replay shows history edits, not only appends.
"""

from __future__ import annotations

import random

from .converters import ArrivalModel, calls_to_trace, history_calls
from .emulators import LastNObservations, synthetic_text
from .trace import Trace

TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                     "required": ["command"]}}},
    {"type": "function", "function": {"name": "edit", "description": "Replace text in a file.",
                                      "parameters": {"type": "object",
                                                     "properties": {"path": {"type": "string"},
                                                                    "old": {"type": "string"},
                                                                    "new": {"type": "string"}},
                                                     "required": ["path", "old", "new"]}}},
]


def synthetic_history(rng: random.Random, steps: int) -> list[dict]:
    history = [
        {"role": "system", "content": "You are a coding agent working in a repository. " + synthetic_text(rng, 300)},
        {"role": "user", "content": "Fix this issue: " + synthetic_text(rng, rng.randint(60, 200))},
    ]
    for step in range(steps):
        call_id = f"call_{step}"
        name = rng.choice(["bash", "edit"])
        arguments = ('{"command": "pytest -x tests"}' if name == "bash"
                     else '{"path": "src/app.py", "old": "a", "new": "b"}')
        history.append({"role": "assistant", "content": synthetic_text(rng, rng.randint(10, 60)),
                        "tool_calls": [{"id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": arguments}}]})
        lines = rng.randint(1, 60)
        history.append({"role": "tool", "tool_call_id": call_id,
                        "content": "\n".join(synthetic_text(rng, rng.randint(4, 14)) for _ in range(lines))})
        if rng.random() < 0.1:
            history.append({"role": "assistant", "content": synthetic_text(rng, 40)})
            history.append({"role": "user", "content": "Also: " + synthetic_text(rng, rng.randint(10, 50))})
    history.append({"role": "assistant", "content": "Done. " + synthetic_text(rng, 30)})
    return history


def synthetic_agent_trace(sessions: int = 8, seed: int = 0, min_steps: int = 8, max_steps: int = 30) -> Trace:
    rng = random.Random(seed)
    calls = []
    for index in range(sessions):
        history = synthetic_history(rng, rng.randint(min_steps, max_steps))
        calls.extend(history_calls(f"synthetic-{index}", history, tools=TOOLS))
    trace = calls_to_trace(calls, source=f"synthetic agent sessions (seed {seed}, {sessions} sessions)",
                           converter="synthetic", emulator=LastNObservations(seed=seed),
                           arrivals=ArrivalModel(seed=seed))
    trace.meta["name"] = f"synthetic-agent-seed{seed}"
    return trace

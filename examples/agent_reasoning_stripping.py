"""A Qwen3 agent whose chat template strips the reasoning of earlier turns.

Qwen3's chat template shows an assistant turn's reasoning (its ``<think>`` block) only for
the turns after the last user query; when a new query arrives, the reasoning of every turn
before it disappears from the prompt. The history is never edited by the client, yet the
first call of each new query diverges from the previous call's prompt at the first
assistant turn of the previous query. Calls within one query only append.

The agent is scripted: it answers a fixed series of questions about a small repository,
each with fixed tool calls and a fixed final answer that do not depend on what the model
writes. The model's text is the turn's reasoning: the generation prompt opens a ``<think>``
block (as Qwen3's thinking templates do) and the model's text goes into the history as the
turn's ``reasoning_content``, which the template then keeps or drops. The example behaves the
same on a random-weight test model as on a real one.

    python examples/agent_reasoning_stripping.py --url http://127.0.0.1:30000 [--turns N]
"""

from __future__ import annotations

from typing import Any, Optional

from agent_loop import CallRecord, Task, ToolCall, argument_parser, run_agent

TASKS = [
    Task(
        "What is 17 * 23?",
        (ToolCall("calculator", {"expression": "17 * 23"}),),
        "17 * 23 = 391.",
    ),
    Task(
        "Which file defines add?",
        (ToolCall("search", {"pattern": "def add"}),),
        "calc/ops.py, on line 1.",
    ),
    Task(
        "Does test_add pass?",
        (
            ToolCall("read_file", {"path": "tests/test_ops.py"}),
            ToolCall("read_file", {"path": "calc/ops.py"}),
        ),
        "No: add returns a - b, so add(2, 3) is -1, not 5.",
    ),
    Task(
        "How many files does the repository have?",
        (ToolCall("list_files", {"directory": "."}),),
        "Three.",
    ),
]


def unedited(turn: int, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The client sends its whole history; the chat template does the stripping."""
    return history


def main(argv: Optional[list[str]] = None) -> list[CallRecord]:
    args = argument_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    return run_agent(
        args.url, TASKS, unedited, turns=args.turns, max_tokens=args.max_tokens, thinking=True
    )


if __name__ == "__main__":
    main()

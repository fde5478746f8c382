"""The scripted tool-calling agent the examples share: tools, chat rendering, the loop.

An agent framework keeps the whole conversation, but what it *sends* on each call is an
edited view of it. The examples differ only in that edit; everything else lives here:

- ``Workspace``: the agent's tools (a small file system, search, a calculator), computed
  locally and deterministically.
- ``Task`` and ``scripted_steps``: the policy. Which tool the agent calls next is scripted,
  never parsed from the model's text, so the examples behave the same whether the server
  runs a real model or a random-weight test model that writes gibberish.
- ``chat_blocks``: the Qwen3 chat template's rendering of OpenAI-style messages (tool calls,
  tool responses, and reasoning, which the template drops from assistant turns before the
  last user query), as (role, text) blocks for the SGLang frontend's ``chatml`` roles.
- ``agent_call``: the ``sgl.function`` program of one LLM call.
- ``run_agent``: the loop. Each call sends the edited view, appends the model's text and the
  scripted action to the history, and prints what the server's prefix cache did.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import operator
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TextIO

import sglang as sgl

from sglang_hybrid.replay.emulators import Call, Emulator

# The frontend picks a chat template by matching the served model path against its own
# registry (sglang.lang.chat_template); it does not ask the server. ``chatml`` has exactly
# Qwen3's role markers and no default system prompt, unlike ``qwen``, which adds one that
# Qwen3's template does not.
FRONTEND_CHAT_TEMPLATE = "chatml"
SESSION = "example"

SYSTEM_PROMPT = "You are a coding agent. Call one tool per turn."


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def as_message_entry(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry chat templates read."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class Workspace:
    """The agent's environment: a read-only toy repository and a calculator."""

    FILES = {
        "README.md": "calc: a tiny calculator",
        "calc/ops.py": "def add(a, b):\n    return a - b",
        "tests/test_ops.py": "from calc.ops import add\n\ndef test_add():\n    assert add(2, 3) == 5",
    }
    _OPERATORS = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
        ast.USub: operator.neg,
    }

    def run(self, call: ToolCall) -> str:
        tools: dict[str, Callable[..., str]] = {
            "list_files": self.list_files,
            "read_file": self.read_file,
            "search": self.search,
            "calculator": self.calculator,
        }
        if call.name not in tools:
            raise ValueError(f"unknown tool {call.name!r}; tools: {', '.join(tools)}")
        return tools[call.name](**call.arguments)

    def list_files(self, directory: str) -> str:
        prefix = "" if directory in ("", ".") else directory.rstrip("/") + "/"
        names = sorted(path for path in self.FILES if path.startswith(prefix))
        return "\n".join(names) if names else f"no such directory: {directory}"

    def read_file(self, path: str) -> str:
        if path not in self.FILES:
            return f"no such file: {path}"
        return "\n".join(f"{number} {line}" for number, line in enumerate(self.FILES[path].splitlines(), 1))

    def search(self, pattern: str) -> str:
        hits = [
            f"{path}:{number}: {line.strip()}"
            for path, text in sorted(self.FILES.items())
            for number, line in enumerate(text.splitlines(), 1)
            if pattern in line
        ]
        return "\n".join(hits) if hits else f"no match for {pattern!r}"

    def calculator(self, expression: str) -> str:
        try:
            return repr(self._evaluate(ast.parse(expression, mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError) as error:
            return f"error: {error}"

    def _evaluate(self, node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in self._OPERATORS:
            return self._OPERATORS[type(node.op)](self._evaluate(node.left), self._evaluate(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._OPERATORS:
            return self._OPERATORS[type(node.op)](self._evaluate(node.operand))
        raise ValueError(f"not an arithmetic expression: {ast.unparse(node)}")


@dataclass(frozen=True)
class Task:
    """A user query and the scripted actions the agent answers it with.

    With an ``answer`` the agent makes the tool calls in order, then replies with the answer,
    and the next task's query follows. Without one the task is open-ended: the agent keeps
    calling the tools in ``tool_calls`` round and round, as long as the session runs.
    """

    query: str
    tool_calls: tuple[ToolCall, ...]
    answer: Optional[str] = None

    def __post_init__(self):
        if not self.tool_calls:
            raise ValueError(f"task {self.query!r} has no tool calls")


Action = ToolCall | str  # a tool call or a final answer

# The open-ended task of the masking and summarization examples: finding why a test fails.
INVESTIGATION = Task(
    query="tests/test_ops.py::test_add fails. Find out why.",
    tool_calls=(
        ToolCall("list_files", {"directory": "."}),
        ToolCall("read_file", {"path": "tests/test_ops.py"}),
        ToolCall("search", {"pattern": "def add"}),
        ToolCall("read_file", {"path": "calc/ops.py"}),
        ToolCall("calculator", {"expression": "2 - 3"}),
    ),
)


def scripted_steps(tasks: list[Task]) -> Iterator[tuple[Optional[str], Action]]:
    """(user query that precedes the call, or None; the action the call ends with), forever.

    Tasks with answers repeat in order; an open-ended task, last, runs for the rest of the
    session.
    """
    if not tasks:
        raise ValueError("no tasks")
    if any(task.answer is None for task in tasks[:-1]):
        raise ValueError("only the last task may be open-ended (no answer)")
    while True:
        for task in tasks:
            query: Optional[str] = task.query
            if task.answer is None:
                while True:
                    for call in task.tool_calls:
                        yield query, call
                        query = None
            for call in task.tool_calls:
                yield query, call
                query = None
            yield query, task.answer


def _is_tool_response(message: dict[str, Any]) -> bool:
    content = message["content"]
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def _tool_call_text(entry: dict[str, Any]) -> str:
    function = entry.get("function", entry)
    arguments = function["arguments"]
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>'


def chat_blocks(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Qwen3's chat template (its jinja, without a tools block) as (role, body) blocks.

    Wrapped in the ChatML role markers the blocks render to the text Qwen3's template does:
    tool results become user turns of ``<tool_response>`` elements (consecutive ones sharing
    one turn), tool calls follow the content as ``<tool_call>`` JSON, and an assistant turn's
    ``reasoning_content`` is shown in a ``<think>`` block only after the last real user
    query: reasoning of earlier turns is dropped from the prompt.
    """
    last_query = len(messages) - 1
    for index in range(len(messages) - 1, -1, -1):
        if messages[index]["role"] == "user" and not _is_tool_response(messages[index]):
            last_query = index
            break
    blocks: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        if role in ("system", "user"):
            blocks.append((role, content))
        elif role == "assistant":
            reasoning = message.get("reasoning_content") or ""
            if index > last_query and (reasoning or index == len(messages) - 1):
                reasoning, shown = reasoning.strip("\n"), content.lstrip("\n")
                body = f"<think>\n{reasoning}\n</think>\n\n{shown}"
            else:
                body = content
            for number, entry in enumerate(message.get("tool_calls") or ()):
                body += ("\n" if number or content else "") + _tool_call_text(entry)
            blocks.append(("assistant", body))
        elif role == "tool":
            element = f"<tool_response>\n{content}\n</tool_response>"
            if index and messages[index - 1]["role"] == "tool":
                blocks[-1] = ("user", f"{blocks[-1][1]}\n{element}")
            else:
                blocks.append(("user", element))
        else:
            raise ValueError(f"message {index} has unknown role {role!r}")
    return blocks


_ROLE_EXPRESSIONS = {"system": sgl.system, "user": sgl.user, "assistant": sgl.assistant}


@sgl.function
def agent_call(s, blocks, generation_prefix, max_tokens):
    """One LLM call: the rendered history, then the assistant's turn up to ``max_tokens``."""
    for role, body in blocks:
        s += _ROLE_EXPRESSIONS[role](body)
    s += sgl.assistant_begin()
    s += generation_prefix + sgl.gen("reply", max_tokens=max_tokens, temperature=0)


@dataclass
class CallRecord:
    """One call: what was sent, what came back, and what the server's cache did."""

    turn: int
    messages: list[dict[str, Any]]  # the edited view that was rendered
    prompt: str  # the prompt text sent
    reply: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    restored_tokens: Optional[int]  # None: the server does not run the semantic cache
    kv_hit_tokens: Optional[int]
    edit: str

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def describe_edit(blocks: list[tuple[str, str]], previous: Optional[list[tuple[str, str]]]) -> str:
    """How this call's history differs from the previous call's (new turns aside)."""
    if previous is None:
        return "first call"
    for index, (now, before) in enumerate(zip(blocks, previous)):
        if now != before:
            return f"edited from prompt message {index} ({before[0]})"
    return "appended"


HistoryEdit = Callable[[int, list[dict[str, Any]]], list[dict[str, Any]]]


def emulator_edit(emulator: Emulator) -> HistoryEdit:
    """A framework edit from the replay emulators: (turn, full history) -> the view sent."""
    state: dict[str, Any] = {}

    def edit(turn: int, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        call = Call(session=SESSION, turn=turn, messages=copy.deepcopy(history), output={})
        return emulator.edit(call, state).messages

    return edit


def run_agent(
    url: str,
    tasks: list[Task],
    edit: HistoryEdit,
    *,
    turns: int,
    max_tokens: int,
    thinking: bool = False,
    out: Optional[TextIO] = None,
) -> list[CallRecord]:
    """Run ``turns`` LLM calls of the scripted agent against the SGLang server at ``url``.

    With ``thinking`` the model's text is the turn's reasoning (the generation prompt opens
    a ``<think>`` block, as Qwen3's thinking templates do) and the turn's content is only the
    scripted action; otherwise the model's text is the turn's content, before the action.
    Prints a line per call to ``out`` (standard output by default).
    """
    out = sys.stdout if out is None else out
    if turns < 1 or max_tokens < 1:
        raise ValueError(f"turns and max_tokens must be positive, got {turns} and {max_tokens}")
    backend = sgl.RuntimeEndpoint(url, chat_template_name=FRONTEND_CHAT_TEMPLATE)
    workspace = Workspace()
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    steps = scripted_steps(tasks)
    records: list[CallRecord] = []
    previous_blocks: Optional[list[tuple[str, str]]] = None
    print_header(out)
    for turn in range(1, turns + 1):
        query, action = next(steps)
        if query is not None:
            history.append({"role": "user", "content": query})
        view = edit(turn, history)
        blocks = chat_blocks(view)
        state = agent_call.run(
            blocks=blocks,
            generation_prefix="<think>\n" if thinking else "",
            max_tokens=max_tokens,
            backend=backend,
            use_thread=False,
        )
        reply = state["reply"]
        meta = state.get_meta_info("reply")
        semantic = (meta.get("semantic_cache") or [{}])[0]
        record = CallRecord(
            turn=turn,
            messages=copy.deepcopy(view),
            prompt=state.text()[: len(state.text()) - len(reply)],
            reply=reply,
            prompt_tokens=meta["prompt_tokens"],
            completion_tokens=meta["completion_tokens"],
            cached_tokens=meta["cached_tokens"],
            restored_tokens=semantic.get("restored_tokens"),
            kv_hit_tokens=semantic.get("kv_hit_tokens"),
            edit=describe_edit(blocks, previous_blocks),
        )
        records.append(record)
        print_record(record, out)
        previous_blocks = blocks

        assistant = {
            "role": "assistant",
            # Set even when empty: Qwen3's template would otherwise look for </think> in the
            # content, which a random model's text may contain.
            "reasoning_content": reply if thinking else "",
            "content": "" if thinking else reply,
        }
        if isinstance(action, ToolCall):
            assistant["tool_calls"] = [action.as_message_entry()]
            history += [assistant, {"role": "tool", "content": workspace.run(action)}]
        else:
            assistant["content"] = f"{assistant['content']}\n{action}".lstrip("\n")
            history.append(assistant)
    print_totals(records, out)
    return records


_COLUMNS = ("call", "prompt", "cached", "restored", "kv_hit", "recomputed")


def print_header(out: TextIO) -> None:
    print("  ".join(f"{name:>10}" for name in _COLUMNS) + "  history", file=out)


def print_record(record: CallRecord, out: TextIO) -> None:
    values = (
        record.turn,
        record.prompt_tokens,
        record.cached_tokens,
        "-" if record.restored_tokens is None else record.restored_tokens,
        "-" if record.kv_hit_tokens is None else record.kv_hit_tokens,
        record.recomputed_tokens,
    )
    print("  ".join(f"{value:>10}" for value in values) + f"  {record.edit}", file=out, flush=True)


def print_totals(records: list[CallRecord], out: TextIO) -> None:
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    print(
        f"total: {prompt} prompt tokens, {cached} cached ({cached / prompt:.0%}), "
        f"{prompt - cached} recomputed",
        file=out,
    )


def argument_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="SGLang server address")
    parser.add_argument("--turns", type=int, default=8, help="LLM calls the agent makes")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per call")
    return parser

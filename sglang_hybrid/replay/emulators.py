"""Agent-framework history edits, emulated on append-only chats.

Each emulator turns the message list a call would send if history were append-only into what
the framework actually sends (see notes/agent-edit-patterns.md). An emulator is applied per
call, in order within each session; all randomness comes from `random.Random` seeded by
(emulator seed, session, position), so a trace is reproducible and the same message gets the
same synthetic text in every call that carries it. "Events" are the chat messages, system
message included (OpenHands counts its system prompt as the first event).
"""

from __future__ import annotations

import copy
import datetime as dt
import inspect
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Sequence

_WORDS = (
    "check the failing test then inspect the function that parses the input and compare it with the expected "
    "output before editing the file so the fix stays minimal and covers the reported case plus the edge case of "
    "empty values reservation user flight policy refund baggage cabin update verify confirm"
).split()


@dataclass
class Call:
    """One LLM call of an agent session: the messages it sent and the assistant message it got."""

    session: str
    turn: int
    messages: list[dict[str, Any]]
    output: dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool = True


def synthetic_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(words, 1)))


class Emulator(ABC):
    name: ClassVar[str]

    def __init__(self, seed: int = 0):
        self.seed = seed

    def rng(self, session: str, *position: Any) -> random.Random:
        return random.Random(f"{self.name}:{self.seed}:{session}:{':'.join(map(str, position))}")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}

    def apply(self, calls: Sequence[Call]) -> list[Call]:
        """Edit every call; calls of a session must appear in turn order."""
        states: dict[str, dict[str, Any]] = {}
        edited = []
        for call in calls:
            state = states.setdefault(call.session, {})
            edited.append(self.edit(replace(call, messages=copy.deepcopy(call.messages),
                                            output=copy.deepcopy(call.output)), state))
        return edited

    @abstractmethod
    def edit(self, call: Call, state: dict[str, Any]) -> Call:
        """Rewrite one call (a private copy); `state` persists across the calls of its session."""


class LastNObservations(Emulator):
    """SWE-agent `last_n_observations` history processor: tool outputs older than the last `n`
    become "Old environment output: (N lines omitted)"."""

    name = "swe-agent-last-n"

    def __init__(self, seed: int = 0, n: int = 5):
        super().__init__(seed)
        self.n = n

    def edit(self, call, state):
        observations = [i for i, m in enumerate(call.messages) if m["role"] == "tool"]
        for index in observations[: max(len(observations) - self.n, 0)]:
            message = call.messages[index]
            lines = len(message["content"].splitlines())
            message["content"] = f"Old environment output: ({lines} lines omitted)"
        return call


class ObservationMasking(Emulator):
    """OpenHands ObservationMaskingCondenser: observations outside the last `attention_window`
    events are replaced by '<MASKED>'."""

    name = "openhands-masking"

    def __init__(self, seed: int = 0, attention_window: int = 5):
        super().__init__(seed)
        self.attention_window = attention_window

    def edit(self, call, state):
        cutoff = len(call.messages) - self.attention_window
        for index, message in enumerate(call.messages[:max(cutoff, 0)]):
            if message["role"] == "tool":
                message["content"] = "<MASKED>"
        return call


class RecentEvents(Emulator):
    """OpenHands RecentEventsCondenser: the first `keep_first` events plus the most recent ones,
    `max_events` in all."""

    name = "openhands-recent"

    def __init__(self, seed: int = 0, keep_first: int = 1, max_events: int = 10):
        super().__init__(seed)
        self.keep_first = keep_first
        self.max_events = max_events

    def edit(self, call, state):
        if len(call.messages) > self.max_events:
            tail = self.max_events - self.keep_first
            call.messages = call.messages[: self.keep_first] + call.messages[-tail:]
        return call


class SummarizingCondenser(Emulator):
    """OpenHands LLMSummarizingCondenser: when the view exceeds `max_size` events, the events
    after the first `keep_first` are replaced by one summary message, keeping the last
    max_size//2 - keep_first - 1; later calls see head + summary + everything after the
    summarized range, until the view overflows again. The summary is seeded synthetic text of
    `summary_words` words."""

    name = "openhands-summarize"

    def __init__(self, seed: int = 0, keep_first: int = 4, max_size: int = 120, summary_words: int = 200):
        super().__init__(seed)
        if max_size // 2 - keep_first - 1 < 1:
            # OpenHands validates the same pair: a condensed view keeps some recent events.
            raise ValueError(f"max_size // 2 - keep_first - 1 events are kept from the tail; with "
                             f"max_size={max_size}, keep_first={keep_first} that is none")
        self.keep_first = keep_first
        self.max_size = max_size
        self.summary_words = summary_words

    def edit(self, call, state):
        history = call.messages
        forgotten_until = state.get("forgotten_until", 0)
        view_len = len(history) if not forgotten_until else self.keep_first + 1 + len(history) - forgotten_until
        if view_len > self.max_size:
            keep_tail = self.max_size // 2 - self.keep_first - 1
            forgotten_until = len(history) - keep_tail
            state["forgotten_until"] = forgotten_until
            rng = self.rng(call.session, forgotten_until)
            state["summary"] = {"role": "user", "content": "Summary of earlier events: " +
                                synthetic_text(rng, self.summary_words)}
        if forgotten_until:
            call.messages = history[: self.keep_first] + [dict(state["summary"])] + history[forgotten_until:]
        return call


class Compaction(Emulator):
    """Whole-history compaction when the prompt nears the context window.

    `claude-code` (autocompact at 83.5% of 200k): the history after the system prompt becomes
    one user message with a 9-section summary. `codex` (compact at 90% of the window): the initial
    context (system + first user message) and the most recent user messages (<= 20k tokens) are
    kept, followed by a summary. Later calls append to the compacted view until it overflows
    again. Prompt size is estimated as characters / 4; summaries are seeded synthetic text.
    """

    name = "compact"
    PRESETS = {
        "claude-code": {"context_tokens": 200_000, "trigger_fraction": 0.835, "keep_recent_user_tokens": 0},
        "codex": {"context_tokens": 272_000, "trigger_fraction": 0.9, "keep_recent_user_tokens": 20_000},
    }

    def __init__(self, seed: int = 0, style: str = "claude-code", context_tokens: int | None = None,
                 summary_words: int = 600):
        super().__init__(seed)
        preset = self.PRESETS[style]
        self.style = style
        self.context_tokens = context_tokens or preset["context_tokens"]
        self.trigger_fraction = preset["trigger_fraction"]
        self.keep_recent_user_tokens = preset["keep_recent_user_tokens"]
        self.summary_words = summary_words

    @staticmethod
    def _tokens(messages) -> int:
        return sum(len(m.get("content") or "") for m in messages) // 4

    def edit(self, call, state):
        history = call.messages
        compacted_until = state.get("compacted_until", 0)
        view = state.get("head", []) + history[compacted_until:] if compacted_until else history
        if self._tokens(view) > self.trigger_fraction * self.context_tokens:
            head = [dict(history[0])] if history and history[0]["role"] == "system" else []
            if self.keep_recent_user_tokens:
                first_user = next((m for m in history if m["role"] == "user"), None)
                head += [dict(first_user)] if first_user is not None else []
                recent, budget = [], self.keep_recent_user_tokens
                for message in reversed(history):
                    if message["role"] == "user" and self._tokens([message]) <= budget:
                        recent.insert(0, dict(message))
                        budget -= self._tokens([message])
                head += recent
            rng = self.rng(call.session, len(history))
            sections = [f"{i}. {synthetic_text(rng, self.summary_words // 9)}" for i in range(1, 10)]
            head.append({"role": "user", "content": "This session is being continued from a previous "
                         "conversation. Summary:\n" + "\n".join(sections)})
            state["head"], state["compacted_until"] = head, len(history)
            compacted_until = len(history)
        if compacted_until:
            call.messages = [dict(m) for m in state["head"]] + history[compacted_until:]
        return call

    def describe(self):
        return {"name": f"{self.style}-compact", **{k: v for k, v in vars(self).items() if not k.startswith("_")}}


class ToolResultClearing(Emulator):
    """Claude Code microcompact: after the user was idle past the prompt-cache TTL, tool results
    older than the `keep_recent` newest become '[Old tool result content cleared]'. Idleness is
    drawn per call with probability `idle_probability`; cleared results stay cleared."""

    name = "claude-code-clear"

    def __init__(self, seed: int = 0, idle_probability: float = 0.1, keep_recent: int = 3):
        super().__init__(seed)
        self.idle_probability = idle_probability
        self.keep_recent = keep_recent

    def edit(self, call, state):
        cleared: set[int] = state.setdefault("cleared", set())
        results = [i for i, m in enumerate(call.messages) if m["role"] == "tool"]
        if self.rng(call.session, call.turn).random() < self.idle_probability:
            cleared.update(results[: max(len(results) - self.keep_recent, 0)])
        for index in cleared:
            call.messages[index]["content"] = "[Old tool result content cleared]"
        return call


class AiderFileBlock(Emulator):
    """Aider's prompt layout: system, chat history, then the chat-files block (a user message with
    the files plus an assistant acknowledgement), then the current exchange (from the last user
    message on). The files block moves to the end of the history every turn, so each call diverges
    where the previous call's history ended. File contents are seeded synthetic text."""

    name = "aider"

    def __init__(self, seed: int = 0, file_words: int = 400):
        super().__init__(seed)
        self.file_words = file_words

    def edit(self, call, state):
        if "files" not in state:
            state["files"] = "I have *added these files to the chat*:\n\nsrc/app.py\n```\n" + synthetic_text(
                self.rng(call.session, "files"), self.file_words) + "\n```"
        users = [i for i, m in enumerate(call.messages) if m["role"] == "user"]
        current = users[-1] if users else len(call.messages)
        block = [{"role": "user", "content": state["files"]}, {"role": "assistant", "content": "Ok."}]
        call.messages = call.messages[:current] + block + call.messages[current:]
        return call


class LettaMemory(Emulator):
    """Letta/MemGPT: the system message is recompiled with the core-memory blocks and a
    'memory last updated' counter; the agent edits memory on a call with probability
    `edit_probability`, which changes the system prompt from that point on."""

    name = "letta"

    def __init__(self, seed: int = 0, edit_probability: float = 0.3, fact_words: int = 20):
        super().__init__(seed)
        self.edit_probability = edit_probability
        self.fact_words = fact_words

    def edit(self, call, state):
        facts: list[str] = state.setdefault("facts", [])
        rng = self.rng(call.session, call.turn)
        if rng.random() < self.edit_probability:
            facts.append(synthetic_text(rng, self.fact_words))
        memory = "\n".join(f"- {fact}" for fact in facts) or "(empty)"
        block = f"\n\n<memory_blocks>\n<human>\n{memory}\n</human>\n</memory_blocks>\nMemory edits: {len(facts)}"
        if call.messages and call.messages[0]["role"] == "system":
            call.messages[0]["content"] += block
        else:
            call.messages.insert(0, {"role": "system", "content": block.lstrip()})
        return call


class Qwen3Reasoning(Emulator):
    """Synthetic `reasoning_content` on every assistant message (seeded, `reasoning_words` words on
    average). The Qwen3 chat template drops it for assistant turns before the last real user
    query, so the history diverges once per user turn; render with the Qwen3 template
    (qwen3.jinja) to see that."""

    name = "qwen3-reasoning"

    def __init__(self, seed: int = 0, reasoning_words: int = 120):
        super().__init__(seed)
        self.reasoning_words = reasoning_words

    def _reasoning(self, session: str, index: int) -> str:
        rng = self.rng(session, index)
        return synthetic_text(rng, int(rng.expovariate(1.0 / self.reasoning_words)) + 1)

    def edit(self, call, state):
        assistants = [m for m in call.messages if m["role"] == "assistant"]
        for index, message in enumerate(assistants):
            message["reasoning_content"] = self._reasoning(call.session, index)
        call.output["reasoning_content"] = self._reasoning(call.session, len(assistants))
        return call


class Qwen3NoThinking(Emulator):
    """Qwen3 with enable_thinking=False: the generation prompt carries an empty think block that
    the re-rendered history does not, so every call diverges at the previous assistant turn."""

    name = "qwen3-no-thinking"

    def edit(self, call, state):
        call.enable_thinking = False
        return call


class DateLine(Emulator):
    """A date line at the top of the system prompt (Aider, Claude Code, Goose...). Each session
    starts at a seeded time of day on `start_date`; call k happens `seconds_per_call` x k later,
    so the line changes when a session crosses midnight."""

    name = "date-line"

    def __init__(self, seed: int = 0, start_date: str = "2025-01-06", seconds_per_call: float = 90.0):
        super().__init__(seed)
        self.start_date = start_date
        self.seconds_per_call = seconds_per_call

    def edit(self, call, state):
        if "start" not in state:
            offset = self.rng(call.session).uniform(0, 86_400)
            state["start"] = dt.datetime.fromisoformat(self.start_date) + dt.timedelta(seconds=offset)
        now = state["start"] + dt.timedelta(seconds=self.seconds_per_call * call.turn)
        line = f"Today's date: {now:%A, %B %d, %Y}.\n\n"
        if call.messages and call.messages[0]["role"] == "system":
            call.messages[0]["content"] = line + call.messages[0]["content"]
        else:
            call.messages.insert(0, {"role": "system", "content": line.rstrip()})
        return call


EMULATORS: dict[str, type[Emulator] | tuple[type[Emulator], dict[str, Any]]] = {
    LastNObservations.name: LastNObservations,
    ObservationMasking.name: ObservationMasking,
    SummarizingCondenser.name: SummarizingCondenser,
    RecentEvents.name: RecentEvents,
    "claude-code-compact": (Compaction, {"style": "claude-code"}),
    "codex-compact": (Compaction, {"style": "codex"}),
    ToolResultClearing.name: ToolResultClearing,
    AiderFileBlock.name: AiderFileBlock,
    LettaMemory.name: LettaMemory,
    Qwen3Reasoning.name: Qwen3Reasoning,
    Qwen3NoThinking.name: Qwen3NoThinking,
    DateLine.name: DateLine,
}


def make_emulator(name: str, seed: int = 0, **params: Any) -> Emulator:
    """Emulator `name` with its documented defaults, overridden by `params`."""
    cls, preset = _entry(name)
    known = emulator_parameters(name)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"emulator {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                         f"its parameters: {', '.join(known) or 'none'}")
    return cls(seed=seed, **preset, **params)


def emulator_parameters(name: str) -> dict[str, Any]:
    """The parameters `name` takes (besides its seed) and their defaults."""
    cls, preset = _entry(name)
    signature = inspect.signature(cls.__init__)
    return {key: param.default for key, param in signature.parameters.items()
            if key not in ("self", "seed") and key not in preset}


def parse_emulator_params(name: str, assignments: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings -> parameters of emulator `name`, each typed like its default (a
    parameter without a default, or with None, is read as an int, else a float, else text).
    A key the emulator does not take is kept as text, for ``make_emulator`` to reject."""
    defaults = emulator_parameters(name)
    params: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"emulator parameter {assignment!r} is not KEY=VALUE")
        params[key] = _typed_like(defaults[key], key, text) if key in defaults else text
    return params


def _typed_like(default: Any, key: str, text: str) -> Any:
    kinds = [type(default)] if isinstance(default, (int, float, str)) else [int, float, str]
    for kind in kinds:
        try:
            return kind(text)
        except ValueError:
            continue
    raise ValueError(f"emulator parameter {key}={text!r} is not of type {kinds[0].__name__}")


def _entry(name: str) -> tuple[type[Emulator], dict[str, Any]]:
    try:
        entry = EMULATORS[name]
    except KeyError:
        raise ValueError(f"unknown emulator {name!r}; known: {', '.join(EMULATORS)}") from None
    return entry if isinstance(entry, tuple) else (entry, {})

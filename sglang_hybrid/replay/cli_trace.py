"""`sglang-hybrid trace convert|edit`: make canonical traces from public agent traces."""

from __future__ import annotations

import argparse
from typing import Sequence

from .rendering import qwen3_encoding
from .converters import SOURCES, ArrivalModel, RenderConfig, calls_to_trace, convert
from .emulators import EMULATORS, Call, make_emulator, parse_emulator_params
from .trace import Trace, load_trace, write_trace


def _arrival_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("assigned arrival times (sources without timestamps)")
    group.add_argument("--session-gap-s", type=float, default=ArrivalModel.session_gap_s)
    group.add_argument("--seed", type=int, default=0, help="seed of arrival times and emulator edits")


def convert_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-hybrid trace convert",
                                     description="Convert an agent trace into a canonical replay trace (JSONL).")
    parser.add_argument("source", choices=SOURCES)
    parser.add_argument("path", help="source file (.traj, tau-bench .json, chat .jsonl, Mooncake .jsonl)")
    parser.add_argument("--out", required=True, help="canonical trace to write (.jsonl)")
    parser.add_argument("--template", help="Jinja chat template file (e.g. qwen3.jinja); default: our ChatML")
    parser.add_argument("--limit", type=int, help="first N runs (tau-bench) or lines (Mooncake)")
    _arrival_args(parser)
    args = parser.parse_args(argv)
    trace = convert(args.source, args.path, template_path=args.template, limit=args.limit,
                    arrival_model=ArrivalModel(session_gap_s=args.session_gap_s, seed=args.seed))
    write_trace(args.out, trace.requests, trace.meta)
    print(f"{len(trace.requests)} requests, {trace.prompt_tokens:,} prompt tokens -> {args.out}")
    return 0


def calls_from_trace(trace: Trace) -> list[Call]:
    """The calls of a canonical trace that carries `messages` (an append-only conversion).

    A call's output message is the message its session's next call has right after the
    call's own messages; a session's last call gets its decoded output text as the reply.
    """
    encoding = qwen3_encoding()
    by_session: dict[str, list] = {}
    for request in sorted(trace.requests, key=lambda r: (r.session, r.turn)):
        if request.messages is None:
            raise ValueError(f"session {request.session} turn {request.turn} has no messages to edit")
        by_session.setdefault(request.session, []).append(request)
    calls = []
    for session, requests in by_session.items():
        for current, following in zip(requests, [*requests[1:], None]):
            position = len(current.messages)
            if following is not None and len(following.messages) > position \
                    and following.messages[position]["role"] == "assistant":
                output = following.messages[position]
            else:
                text = encoding.decode(current.output_ids.tolist()).removesuffix("<|im_end|>")
                output = {"role": "assistant", "content": text}
            calls.append(Call(session, current.turn, current.messages, output, current.tools))
    return calls


def edit_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-hybrid trace edit",
                                     description="Apply an agent-framework edit emulator to a canonical trace "
                                                 "converted from an append-only chat, and re-render it.")
    parser.add_argument("trace", help="canonical trace with messages (.jsonl)")
    parser.add_argument("--emulator", required=True, choices=sorted(EMULATORS))
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override one of the emulator's parameters (repeatable), e.g. max_size=16")
    parser.add_argument("--out", required=True)
    parser.add_argument("--template", help="Jinja chat template file (e.g. qwen3.jinja); default: our ChatML")
    _arrival_args(parser)
    args = parser.parse_args(argv)
    try:
        emulator = make_emulator(args.emulator, seed=args.seed, **parse_emulator_params(args.emulator, args.param))
    except ValueError as error:
        parser.error(str(error))
    source = load_trace(args.trace)
    trace = calls_to_trace(calls_from_trace(source), source=args.trace, converter="edit",
                           emulator=emulator,
                           render=RenderConfig(args.template),
                           arrivals=ArrivalModel(session_gap_s=args.session_gap_s, seed=args.seed))
    trace.meta["edited_from"] = source.meta
    write_trace(args.out, trace.requests, trace.meta)
    print(f"{len(trace.requests)} requests, {trace.prompt_tokens:,} prompt tokens -> {args.out}")
    return 0


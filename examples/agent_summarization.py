"""An agent whose framework summarizes its history once it grows (OpenHands).

OpenHands' ``LLMSummarizingCondenser``: when the history passes ``max_size`` events
(messages, the system prompt included), the events after the first ``keep_first`` are
replaced by one summary message, keeping the most recent ``max_size // 2 - keep_first - 1``;
later calls append to that condensed view until it overflows again. The call that
summarizes diverges from the previous prompt right after the kept head; the calls after it
only append.

The agent is scripted: it investigates a failing test with a fixed sequence of tool calls
that does not depend on what the model writes. The model's text is the thought before each
tool call and goes into the history as the turn's content. The summary is seeded filler text
(the replay emulator's) where OpenHands asks the LLM for one: its wording does not matter to
the cache, only where it sits. The example behaves the same on a random-weight test model as
on a real one.

    python examples/agent_summarization.py --url http://127.0.0.1:30000 [--turns N]
"""

from __future__ import annotations

from typing import Optional

from agent_loop import INVESTIGATION, CallRecord, argument_parser, emulator_edit, run_agent

from sglang_hybrid.replay.emulators import SummarizingCondenser


def main(argv: Optional[list[str]] = None) -> list[CallRecord]:
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keep-first", type=int, default=2, help="leading messages never summarized"
    )
    parser.add_argument(
        "--max-events", type=int, default=8, help="history length (messages) that triggers a summary"
    )
    parser.add_argument("--summary-words", type=int, default=40, help="length of the summary")
    args = parser.parse_args(argv)
    if args.keep_first < 1:
        parser.error(f"--keep-first must be >= 1, got {args.keep_first}")
    try:
        condenser = SummarizingCondenser(
            keep_first=args.keep_first, max_size=args.max_events, summary_words=args.summary_words
        )
    except ValueError as error:
        parser.error(str(error))
    return run_agent(
        args.url, [INVESTIGATION], emulator_edit(condenser), turns=args.turns, max_tokens=args.max_tokens
    )


if __name__ == "__main__":
    main()

"""A coding agent whose framework masks old tool outputs (SWE-agent, OpenHands).

SWE-agent's ``LastNObservations`` history processor replaces every tool output but the last
N with "Old environment output: (K lines omitted)"; OpenHands' ``ObservationMaskingCondenser``
replaces the tool outputs outside its window of recent events with "<MASKED>". Once the
history is long enough, every call masks one more output, so its prompt diverges from the
previous call's inside the history, at the output that just left the window. A prefix cache
can reuse only what lies before that point, and a hybrid model only from a recurrent-state
checkpoint before it; the columns show how much that was on each call.

The agent is scripted: it investigates a failing test with a fixed sequence of tool calls
(list, read, search, calculate) that does not depend on what the model writes. The model's
text is the thought before each tool call and goes into the history as the turn's content,
so the example behaves the same on a random-weight test model as on a real one.

    python examples/agent_observation_masking.py --url http://127.0.0.1:30000 [--turns N]
"""

from __future__ import annotations

from typing import Optional

from agent_loop import INVESTIGATION, CallRecord, argument_parser, emulator_edit, run_agent

from sglang_hybrid.replay.emulators import LastNObservations, ObservationMasking


FRAMEWORKS = {
    "swe-agent": lambda keep: LastNObservations(n=keep),
    "openhands": lambda keep: ObservationMasking(attention_window=keep),
}


def main(argv: Optional[list[str]] = None) -> list[CallRecord]:
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="swe-agent")
    parser.add_argument(
        "--keep",
        type=int,
        default=3,
        help="swe-agent: tool outputs kept (the last N); openhands: window of recent messages",
    )
    args = parser.parse_args(argv)
    if args.keep < 0:
        parser.error(f"--keep must be >= 0, got {args.keep}")
    edit = emulator_edit(FRAMEWORKS[args.framework](args.keep))
    return run_agent(args.url, [INVESTIGATION], edit, turns=args.turns, max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()

"""``sglang-hybrid``: the project's command line.

    sglang-hybrid launch [SGLang server args] [cache flags]
                                         SGLang's HTTP server with the semantic state cache
    sglang-hybrid replay [TRACE] ...     replay agent traffic against checkpoint policies
    sglang-hybrid trace convert|edit ... canonical traces from agent logs; framework edits

Each subcommand's own ``--help`` lists its options.
"""

from __future__ import annotations

import sys
from typing import Sequence

USAGE = __doc__.strip()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "launch":
        from sglang_hybrid.launch import launch_main

        return launch_main(rest)
    if command == "replay":
        from sglang_hybrid.replay.cli_replay import replay_main

        return replay_main(rest)
    if command == "trace":
        from sglang_hybrid.replay.cli_trace import convert_main, edit_main

        actions = {"convert": convert_main, "edit": edit_main}
        if not rest or rest[0] not in actions:
            print("usage: sglang-hybrid trace convert|edit ...", file=sys.stderr)
            return 2
        return actions[rest[0]](rest[1:])
    print(f"sglang-hybrid: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

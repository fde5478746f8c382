"""``sglang-hybrid``: the project's command line.

    sglang-hybrid launch [SGLang server args] [cache flags]
                                         SGLang's HTTP server with the semantic state cache
    sglang-hybrid replay [TRACE] ...     replay agent traffic against checkpoint policies
    sglang-hybrid trace convert|edit ... canonical traces from agent logs; framework edits
    sglang-hybrid patch --check          check that patches/ applies to the installed sglang

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
    if command == "patch":
        return patch_main(rest)
    print(f"sglang-hybrid: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def patch_main(argv: Sequence[str]) -> int:
    import argparse

    from sglang_hybrid import patches

    parser = argparse.ArgumentParser(
        prog="sglang-hybrid patch",
        description="The changes to SGLang's source that sglang-hybrid applies at run time "
        f"(upstream-ready diffs against sglang {patches.SGLANG_VERSION} in {patches.PATCH_DIR}).",
    )
    parser.add_argument("--check", action="store_true", required=True,
                        help="apply every diff, in order, to the installed sglang in memory; "
                        "exit 1 naming the first that does not apply")
    parser.parse_args(argv)
    try:
        for line in patches.check():
            print(line)
    except patches.PatchError as error:
        print(f"sglang-hybrid patch: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

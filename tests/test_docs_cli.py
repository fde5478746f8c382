"""The command lines answer ``--help``, and the README and docs name only what they accept.

Every flag written in README.md or docs/ must be one a command's ``--help`` lists (the
sglang-hybrid commands, SGLang's own flags through ``launch``, the examples' agent scripts);
every converter, emulator, policy and backend they name must be among that command's choices.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from sglang_hybrid.replay.shared_data import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
COMMANDS = {
    "sglang-hybrid": [],
    "launch": ["launch"],
    "replay": ["replay"],
    "trace convert": ["trace", "convert"],
    "trace edit": ["trace", "edit"],
}
# The agent scripts (agent_loop.py is their library).
EXAMPLES = sorted(p for p in (REPO_ROOT / "examples").glob("*.py") if "__main__" in p.read_text())
# sglang-router (the router extra, also in the test extra): the flags the docs give it.
ROUTER = ["-m", "sglang_router.launch_router"]
HELP_TIMEOUT_S = 300
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
NAME = r"([a-z0-9][a-z0-9._-]*)"


def _help(argv: list[str]) -> str:
    result = subprocess.run(
        [sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=HELP_TIMEOUT_S
    )
    assert result.returncode == 0, f"{argv} --help failed:\n{result.stderr[-2000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    texts = {name: _help(["-m", "sglang_hybrid.cli", *argv]) for name, argv in COMMANDS.items()}
    texts.update({path.name: _help([str(path)]) for path in EXAMPLES})
    texts["router"] = _help(ROUTER)
    return texts


@pytest.fixture(scope="module")
def docs() -> str:
    return "\n".join(path.read_text() for path in DOCS)


def _choices(help_text: str) -> set[str]:
    """Every value of every ``{a,b,c}`` choice list in a help text."""
    return {value for group in re.findall(r"\{([^{}\s]+)\}", help_text) for value in group.split(",")}


def _listed(docs: str, heading: str) -> set[str]:
    """The names in backticks that open each item of a prose list "Heading: `a`, `b` (...)"."""
    names = set()
    for sentence in re.findall(rf"{heading}: (.*?)\.(?:\s|$)", docs, flags=re.S):
        names.update(re.findall(rf"(?:^|, |\), )`{NAME}`", sentence))
    return names


def test_every_command_answers_help(helps):
    assert set(COMMANDS) <= set(helps) and len(EXAMPLES) >= 3
    assert "sglang-hybrid launch" in helps["sglang-hybrid"]
    assert "--state-checkpoint-slots" in helps["launch"] and "--model-path" in helps["launch"]


def test_every_flag_the_docs_name_is_accepted(helps, docs):
    accepted = {flag for text in helps.values() for flag in FLAG.findall(text)}
    named = set(FLAG.findall(docs))
    assert {"--state-checkpoint-slots", "--emulator", "--turns"} <= named
    assert named - accepted == set()


def test_every_converter_the_docs_name_is_accepted(helps, docs):
    named = set(re.findall(rf"trace convert {NAME}", docs)) | _listed(docs, "Converters")
    assert "openai-jsonl" in named
    assert named - _choices(helps["trace convert"]) == set()


def test_every_emulator_the_docs_name_is_accepted(helps, docs):
    named = set(re.findall(rf"--emulator {NAME}", docs)) | _listed(docs, "Emulators")
    assert "openhands-masking" in named
    assert named - _choices(helps["trace edit"]) == set()


def test_every_policy_and_backend_the_docs_name_is_accepted(helps, docs):
    replay = helps["replay"]
    policies = set(re.search(r"from: ([a-z0-9, -]+);", " ".join(replay.split())).group(1).replace(" ", "").split(","))
    named = {name for group in re.findall(r"every policy side by side \((.*?)\)", docs, flags=re.S)
             for name in re.findall(rf"`{NAME}`", group)}
    named |= {name for group in re.findall(r"--policies ([a-z0-9,-]+)", docs) for name in group.split(",")}
    assert "semantic" in named
    assert named - policies == set()
    backends = _listed(docs, "Backends")
    assert backends == {"sim", "engine", "server"}
    assert backends - _choices(replay) == set()


def test_the_lists_are_read_as_lists():
    prose = "Converters: `a-b`, `c` (what `d` does), `e`. Emulators: listed by `f --help`."
    assert _listed(prose, "Converters") == {"a-b", "c", "e"}
    assert _listed(prose, "Emulators") == set()
    assert _choices("usage: x {a,b-c} [--y {1,2}]") == {"a", "b-c", "1", "2"}

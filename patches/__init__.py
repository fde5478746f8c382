"""Changes to SGLang's own source that sglang-hybrid needs, as upstream-ready diffs.

Each ``NNNN-*.diff`` beside this file is a unified diff against sglang 0.5.23 with paths as
in SGLang's repository (``python/sglang/...``), preceded by a header saying why. They form
a series: each applies on top of the ones before it, in name order. A user never patches
site-packages: ``install()`` (called by the plugin in every SGLang process) makes the
modules they touch load from the patched source, and ``sglang-hybrid patch --check`` proves
every diff applies to the installed sglang.

Hunks apply strictly: their context must match at the line the hunk names (shifted only by
the hunks before it), no fuzz, so a diff that no longer fits the installed SGLang is an
error, never a silent misapplication. This module imports no sglang, so the GPU check can
patch a copy of SGLang's kernels on a host where SGLang is not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

PATCH_DIR = Path(__file__).resolve().parent
SGLANG_VERSION = "0.5.23"
# Diff paths are relative to SGLang's repository; the package lives under python/.
REPO_PACKAGE_ROOT = "python/"

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    """A diff does not apply to the source it names."""


@dataclass(frozen=True)
class Hunk:
    old_start: int  # 1-based line of the first old line
    old_lines: tuple[str, ...]  # context and removed lines, as in the source
    new_lines: tuple[str, ...]  # context and added lines


@dataclass(frozen=True)
class FileDiff:
    path: str  # relative to the sglang package's parent directory: "sglang/..."
    hunks: tuple[Hunk, ...]

    @property
    def module(self) -> str:
        return self.path[: -len(".py")].replace("/", ".")


@dataclass(frozen=True)
class SourcePatch:
    name: str
    why: str  # the header before the first file
    files: tuple[FileDiff, ...]


def load_series(directory: Path = PATCH_DIR) -> list[SourcePatch]:
    """Every ``*.diff`` of ``directory``, parsed, in name order."""
    return [parse_diff(path.name, path.read_text()) for path in sorted(directory.glob("*.diff"))]


def parse_diff(name: str, text: str) -> SourcePatch:
    lines = text.splitlines(keepends=True)
    header: list[str] = []
    files: list[FileDiff] = []
    i = 0
    while i < len(lines) and not lines[i].startswith("diff --git ") and not lines[i].startswith("--- "):
        header.append(lines[i])
        i += 1
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ b/"):
            raise PatchError(f"{name}: '--- ' at line {i + 1} is not followed by '+++ b/<path>'")
        path = _package_path(name, lines[i + 1][len("+++ b/"):].strip())
        i += 2
        hunks = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(name, lines, i)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"{name}: {path} has no hunks")
        files.append(FileDiff(path, tuple(hunks)))
    if not files:
        raise PatchError(f"{name}: no file diffs found")
    return SourcePatch(name, "".join(header).strip(), tuple(files))


def _package_path(name: str, repo_path: str) -> str:
    if not repo_path.startswith(REPO_PACKAGE_ROOT + "sglang/") or not repo_path.endswith(".py"):
        raise PatchError(f"{name}: {repo_path} is not a Python file of SGLang's python/sglang/")
    return repo_path[len(REPO_PACKAGE_ROOT):]


def _parse_hunk(name: str, lines: list[str], i: int) -> tuple[Hunk, int]:
    match = _HUNK_HEADER.match(lines[i])
    if match is None:
        raise PatchError(f"{name}: malformed hunk header at line {i + 1}: {lines[i].rstrip()}")
    old_start = int(match.group(1))
    old_count = int(match.group(2) or 1)
    new_count = int(match.group(4) or 1)
    old: list[str] = []
    new: list[str] = []
    i += 1
    while len(old) < old_count or len(new) < new_count:
        if i >= len(lines):
            raise PatchError(f"{name}: hunk at line {old_start} ends early")
        line = lines[i]
        tag, body = line[:1], line[1:]
        if line.startswith("\\"):  # "\ No newline at end of file"
            i += 1
            continue
        if tag == " " or line in ("\n", ""):
            old.append(body if tag == " " else "\n")
            new.append(body if tag == " " else "\n")
        elif tag == "-":
            old.append(body)
        elif tag == "+":
            new.append(body)
        else:
            raise PatchError(f"{name}: unexpected line in hunk at line {i + 1}: {line.rstrip()}")
        i += 1
    return Hunk(old_start, tuple(old), tuple(new)), i


def apply_file_diff(source: str, diff: FileDiff, patch_name: str) -> str:
    """``source`` with every hunk of ``diff`` applied; ``PatchError`` if one does not fit."""
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0  # index into lines of the first line not yet copied
    for hunk in diff.hunks:
        start = hunk.old_start - 1 if hunk.old_lines else hunk.old_start
        found = lines[start:start + len(hunk.old_lines)]
        if start < cursor or tuple(found) != hunk.old_lines:
            raise PatchError(
                f"{patch_name} does not apply to {diff.path}: the hunk at line {hunk.old_start} "
                f"expects {hunk.old_lines[:1]!r}... there (is this sglang {SGLANG_VERSION}?)"
            )
        out.extend(lines[cursor:start])
        out.extend(hunk.new_lines)
        cursor = start + len(hunk.old_lines)
    out.extend(lines[cursor:])
    return "".join(out)


def patched_sources(read_original: Callable[[str], str], series: Optional[Iterable[SourcePatch]] = None) -> dict[str, str]:
    """Apply the series to the files it touches: package path -> patched source.

    ``read_original(path)`` returns the unpatched text of ``sglang/...`` paths.
    """
    sources: dict[str, str] = {}
    for patch in load_series() if series is None else series:
        for diff in patch.files:
            if diff.path not in sources:
                sources[diff.path] = read_original(diff.path)
            sources[diff.path] = apply_file_diff(sources[diff.path], diff, patch.name)
    return sources


def _installed_sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("sglang is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


def check() -> list[str]:
    """One line per diff of the series, each applied to the installed sglang in turn;
    ``PatchError`` names the first that does not apply (or does not compile)."""
    root = _installed_sglang_root()
    series = load_series()
    for path, source in patched_sources(lambda path: (root / path).read_text(), series).items():
        try:
            compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as error:
            raise PatchError(f"the patched {path} does not compile: {error}") from error
    return [f"{patch.name}: applies ({', '.join(d.path for d in patch.files)})" for patch in series]


# --------------------------------------------------------------------------------------
# Loading patched modules


def patched_filename(origin: str) -> str:
    """The name patched code is compiled under: tracebacks and ``inspect`` (Triton reads a
    kernel's source through it) see the patched text, never the file on disk."""
    return f"{origin}[sglang-hybrid patched]"


def _compile_patched(source: str, origin: str):
    filename = patched_filename(origin)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return compile(source, filename, "exec", dont_inherit=True)


class _PatchedSourceLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname: str, path: str, source: str):
        super().__init__(fullname, path)
        self._source = source

    def get_source(self, fullname):
        return self._source

    def get_code(self, fullname):
        return _compile_patched(self._source, self.path)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def __init__(self, sources: dict[str, str]):
        self.sources = sources  # module name -> patched source

    def find_spec(self, fullname, path, target=None):
        source = self.sources.get(fullname)
        if source is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        loader = _PatchedSourceLoader(fullname, spec.origin, source)
        return importlib.util.spec_from_file_location(fullname, spec.origin, loader=loader)


_finder: Optional[_PatchFinder] = None


def install() -> None:
    """Make this process load the patched modules from the patched source (idempotent).

    A module not imported yet is patched when it is imported. One already imported (a test
    process, an embedding application) is re-executed in place from the patched source and
    every reference other loaded modules hold to its old functions and classes is pointed
    at the new ones; objects created from its classes before that keep the old methods.
    """
    global _finder
    if _finder is not None:
        return
    root = _installed_sglang_root()
    by_path = patched_sources(lambda path: (root / path).read_text())
    sources = {path[: -len(".py")].replace("/", "."): text for path, text in by_path.items()}
    _finder = _PatchFinder(sources)
    sys.meta_path.insert(0, _finder)
    for name in sources:
        module = sys.modules.get(name)
        if module is not None and not isinstance(getattr(module, "__loader__", None), _PatchedSourceLoader):
            _reexecute(module, sources[name])


def _reexecute(module, source: str) -> None:
    old = dict(vars(module))
    exec(_compile_patched(source, module.__file__), vars(module))
    module.__loader__ = _PatchedSourceLoader(module.__name__, module.__file__, source)
    replaced = {id(value): vars(module)[name] for name, value in old.items()
                if name in vars(module) and vars(module)[name] is not value and callable(value)}
    if not replaced:
        return
    for other in list(sys.modules.values()):
        namespace = getattr(other, "__dict__", None)
        if other is module or not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            new = replaced.get(id(value))
            if new is not None:
                namespace[name] = new

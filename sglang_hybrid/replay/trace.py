"""Canonical replay trace: JSONL, one request a line (DESIGN.md, "Interfaces").

    {"session": "s1", "turn": 3, "arrival_s": 12.5,
     "input_ids": [...], "output_ids": [...],
     "messages": [...], "tools": [...], "anchors": [...]}

`input_ids`/`output_ids` are required; `messages`, `tools` (OpenAI chat format) and `anchors`
(client-hinted token positions) are optional and carried through untouched. A trace may start
with one metadata line `{"trace_meta": {...}}` that states how it was produced (source file,
converter, emulator, how arrival times were assigned); replay ignores it, readers keep it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

REQUIRED_FIELDS = ("session", "turn", "arrival_s", "input_ids", "output_ids")


class TraceFormatError(ValueError):
    """A trace line that does not follow the canonical format; names the file and line."""


@dataclass
class Request:
    session: str
    turn: int
    arrival_s: float
    input_ids: np.ndarray  # int32, the prompt as sent
    output_ids: np.ndarray  # int32, the generated tokens
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    anchors: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "session": self.session,
            "turn": self.turn,
            "arrival_s": round(float(self.arrival_s), 6),
            "input_ids": self.input_ids.tolist(),
            "output_ids": self.output_ids.tolist(),
        }
        for name in ("messages", "tools", "anchors"):
            value = getattr(self, name)
            if value is not None:
                record[name] = value
        return record


@dataclass
class Trace:
    requests: list[Request]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.requests)


def _token_array(value: Any, name: str, where: str) -> np.ndarray:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TraceFormatError(f"{where}: '{name}' must be a list of integer token ids")
    array = np.asarray(value, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise TraceFormatError(f"{where}: '{name}' holds a token id outside 0..2^31-1")
    return array.astype(np.int32)


def parse_request(record: Any, where: str) -> Request:
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    if not isinstance(record["turn"], int):
        raise TraceFormatError(f"{where}: 'turn' must be an integer")
    if not isinstance(record["arrival_s"], (int, float)) or isinstance(record["arrival_s"], bool):
        raise TraceFormatError(f"{where}: 'arrival_s' must be a number")
    input_ids = _token_array(record["input_ids"], "input_ids", where)
    if input_ids.size == 0:
        raise TraceFormatError(f"{where}: 'input_ids' is empty")
    anchors = record.get("anchors")
    if anchors is not None and not (isinstance(anchors, list) and all(isinstance(a, int) for a in anchors)):
        raise TraceFormatError(f"{where}: 'anchors' must be a list of integer token positions")
    return Request(
        session=str(record["session"]),
        turn=record["turn"],
        arrival_s=float(record["arrival_s"]),
        input_ids=input_ids,
        output_ids=_token_array(record["output_ids"], "output_ids", where),
        messages=record.get("messages"),
        tools=record.get("tools"),
        anchors=anchors,
    )


def load_trace(path: str | Path) -> Trace:
    """Read a canonical JSONL trace. Raises TraceFormatError naming the line of the first bad record."""
    path = Path(path)
    requests: list[Request] = []
    meta: dict[str, Any] = {}
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceFormatError(f"{where}: not valid JSON ({error.msg})") from None
            if isinstance(record, dict) and "trace_meta" in record and not requests and not meta:
                meta = dict(record["trace_meta"])
                continue
            requests.append(parse_request(record, where))
    if not requests:
        raise TraceFormatError(f"{path}: no requests")
    return Trace(requests=requests, meta=meta)


def write_trace(path: str | Path, requests: Iterable[Request], meta: dict[str, Any] | None = None) -> Path:
    """Write requests as canonical JSONL (sorted by arrival, then session and turn), meta line first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.session, r.turn))
    with path.open("w", encoding="utf-8") as handle:
        if meta:
            handle.write(json.dumps({"trace_meta": meta}) + "\n")
        for request in ordered:
            handle.write(json.dumps(request.to_json(), separators=(",", ":")) + "\n")
    return path

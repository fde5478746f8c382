import json

import numpy as np
import pytest

from sglang_hybrid.replay.trace import Request, TraceFormatError, load_trace, write_trace


def _request(session="s", turn=0, arrival=0.0, prompt=(1, 2, 3), output=(4,)):
    return Request(session, turn, arrival, np.asarray(prompt, np.int32), np.asarray(output, np.int32))


def test_round_trip_keeps_fields_and_meta(tmp_path):
    requests = [_request(turn=1, arrival=2.0, prompt=(5, 6)), _request(arrival=1.0)]
    requests[0].messages = [{"role": "user", "content": "hi"}]
    path = write_trace(tmp_path / "t.jsonl", requests, {"converter": "test"})
    trace = load_trace(path)
    assert trace.meta == {"converter": "test"}
    assert [r.turn for r in trace.requests] == [0, 1]  # sorted by arrival
    assert trace.requests[1].messages == [{"role": "user", "content": "hi"}]
    assert trace.requests[1].input_ids.dtype == np.int32
    assert trace.requests[1].input_ids.tolist() == [5, 6]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"session": "s", "turn": 1, "arrival_s": 0, "output_ids": []}), "missing field(s) input_ids"),
        (json.dumps({"session": "s", "turn": 1, "arrival_s": 0, "input_ids": [1, "x"], "output_ids": []}),
         "'input_ids' must be a list of integer token ids"),
        (json.dumps({"session": "s", "turn": "1", "arrival_s": 0, "input_ids": [1], "output_ids": []}),
         "'turn' must be an integer"),
    ],
)
def test_malformed_line_error_names_the_line(tmp_path, bad_line, message):
    good = json.dumps(_request().to_json())
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good, good, bad_line, good]) + "\n")
    with pytest.raises(TraceFormatError) as error:
        load_trace(path)
    assert f"bad.jsonl:3: {message}" in str(error.value)

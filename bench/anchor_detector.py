"""Anchor detector throughput on Qwen3 token ids.

Input: the last SWE-agent step rendered with the Qwen3 template (a real agent prompt), or our
own ChatML rendering of a synthetic session when ../shared/data is absent, repeated to at
least --tokens ids. Prints ``anchor_detector_mtok_s: <value>`` last and writes JSON under
results/bench/.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from sglang_hybrid.anchors.detector import AnchorDetector
from sglang_hybrid.replay import rendering
from sglang_hybrid.replay.shared_data import QWEN3_TEMPLATE, REPO_ROOT, SWE_AGENT_TRAJ


def _source_rendering() -> tuple[str, str]:
    if QWEN3_TEMPLATE.exists() and SWE_AGENT_TRAJ.exists():
        step = json.loads(SWE_AGENT_TRAJ.read_text())["trajectory"][-1]["messages"]
        messages = [{k: m[k] for k in ("role", "content", "tool_calls") if k in m} for m in step]
        return "sweagent_last_step_qwen3_template", rendering.render_chat(messages, template_path=QWEN3_TEMPLATE)
    rng = np.random.default_rng(0)
    messages = [{"role": "system", "content": "You are a coding agent. " * 200}]
    for turn in range(60):
        body = " ".join(map(str, rng.integers(0, 10_000, size=300)))
        messages.append({"role": "assistant", "content": f"Step {turn}", "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]})
        messages.append({"role": "tool", "content": body})
    return "synthetic_chatml_session", rendering.render_chatml(messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000_000, help="minimum ids per detect call")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls; the median is reported")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench" / "anchor_detector.json")
    args = parser.parse_args()

    source, text = _source_rendering()
    base = np.array(rendering.qwen3_encode(text), dtype=np.int32)
    ids = np.tile(base, -(-args.tokens // base.shape[0]))
    detector = AnchorDetector.for_family("chatml")
    anchors = detector.detect(ids)  # warm-up, and the anchor count for the record

    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        detector.detect(ids)
        seconds.append(time.perf_counter() - start)
    median = float(np.median(seconds))
    mtok_s = ids.shape[0] / median / 1e6

    list_ids = ids[: 1_000_000].tolist()
    start = time.perf_counter()
    detector.detect(list_ids)
    list_mtok_s = len(list_ids) / (time.perf_counter() - start) / 1e6

    result = {
        "bench": "anchor_detector",
        "family": "chatml",
        "source": source,
        "source_tokens": int(base.shape[0]),
        "tokens": int(ids.shape[0]),
        "dtype": str(ids.dtype),
        "anchors": len(anchors),
        "repeats": args.repeats,
        "median_s": median,
        "min_s": float(min(seconds)),
        "mtok_s": mtok_s,
        "python_list_input_mtok_s": list_mtok_s,
        "machine": platform.processor() or platform.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"anchor_detector_mtok_s: {mtok_s:.1f}")


if __name__ == "__main__":
    main()

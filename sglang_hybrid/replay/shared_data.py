"""Where the tests and benchmarks find the real agent traces and the Qwen3 chat template.

They live in ``../shared/data``, a checkout beside this repository's, not in the package: a
test or benchmark that needs them skips or falls back when they are absent.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
QWEN3_TEMPLATE = SHARED_DATA / "qwen3.jinja"
TRACES = SHARED_DATA / "traces"
SWE_AGENT_TRAJ = TRACES / "sweagent_marshmallow-1867_fc_last_n_observations.traj"
TAU_BENCH_AIRLINE = TRACES / "tau-bench_gpt-4o-airline.json"
MOONCAKE_CONVERSATIONS = TRACES / "mooncake_fast25_conversation_trace.jsonl"

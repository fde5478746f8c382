"""results.json: one row per policy and the envelope around them, for every replay backend.

The schema is DESIGN.md's ("Interfaces users depend on"): per policy the requests, prompt,
cached and recomputed tokens, hit rate, checkpoints taken, slot peak and the TTFT
distribution; around them the trace, backend, cost profile and budget. A backend adds its own
fields after the standard ones (the engine its exactness and timings, a host tier its host
restores, the server what it measured), never instead of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np


def distribution(values) -> Optional[dict[str, float]]:
    """Mean and p50/p95/p99 of ``values``, as results.json reports a time; None without samples."""
    samples = np.asarray(values, dtype=np.float64)
    if samples.size == 0:
        return None
    return {
        "mean": float(samples.mean()),
        "p50": float(np.percentile(samples, 50)),
        "p95": float(np.percentile(samples, 95)),
        "p99": float(np.percentile(samples, 99)),
    }


def policy_row(
    *,
    requests: int,
    prompt_tokens: int,
    cached_tokens: int,
    recomputed_tokens: int,
    checkpoints_taken: Optional[int],
    checkpoint_slots_peak: Optional[int],
    ttft_s: Sequence[float],
    **backend_fields: Any,
) -> dict[str, Any]:
    """One policy's row: the standard fields, then ``backend_fields`` in the order given."""
    return {
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "recomputed_tokens": recomputed_tokens,
        "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "checkpoints_taken": checkpoints_taken,
        "checkpoint_slots_peak": checkpoint_slots_peak,
        "ttft_s": distribution(ttft_s),
        **backend_fields,
    }


def results_envelope(
    *,
    trace: str,
    backend: str,
    profile: str,
    budget_slots: Optional[int],
    policies: dict[str, dict[str, Any]],
    host_slots: int = 0,
    server: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The whole of results.json; ``host_slots`` (when a host tier was replayed) and ``server``
    (backend `server`) extend DESIGN.md's schema."""
    results: dict[str, Any] = {"trace": trace, "backend": backend, "profile": profile, "budget_slots": budget_slots}
    if host_slots:
        results["host_slots"] = host_slots
    results["policies"] = policies
    if server is not None:
        results["server"] = server
    return results


def write_json(path: Path, value: Any, indent: int = 2) -> None:
    path.write_text(json.dumps(value, indent=indent) + "\n")


def write_results(out_dir: str | Path, results: dict[str, Any]) -> Path:
    """Write ``results`` to ``out_dir``/results.json (the folder is made); return the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    return out

"""Tuning and test trace sets: the same agent edit patterns, drawn from disjoint seeds and tasks.

A policy is tuned on one set and reported on the other (DESIGN.md: tune on one trace set,
report on another). Each set is a seed and the tau-bench airline tasks it may draw from; the
two share neither. From its seed a set draws

* which of its tasks' runs make the trace (every trial of a drawn task, so trials that replay
  one conversation stay together, as in the source),
* the emulator's edits (an emulator's randomness is seeded by the set's seed),
* the arrival times (``ArrivalModel`` seeded by it), with the mean interval between session
  starts set so that on average ``concurrency`` sessions are active at once (Little's law:
  active sessions = mean session duration / mean interval between session starts; session
  durations do not depend on that interval).

Patterns are the edit families of the held-out traces of issue 21: reasoning kept or stripped,
observation masking, history condensation, a Letta-style memory block rewritten in the system
prompt, aider-style repo-map rewrites, all rendered with the Qwen3 template and tokenizer; and
the SWE-agent trajectory, a recording with no seed, which belongs to the test set only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .converters import ArrivalModel, RenderConfig, calls_to_trace, convert, taubench_calls
from .emulators import Call, make_emulator
from .shared_data import QWEN3_TEMPLATE, SWE_AGENT_TRAJ, TAU_BENCH_AIRLINE
from .trace import Trace

# Pattern -> (emulator, its parameters scaled to tau-bench sessions of 10-60 messages).
TAU_PATTERNS: dict[str, tuple[str, dict[str, int]]] = {
    "reasoning-kept": ("qwen3-reasoning", {}),
    "reasoning-stripped": ("qwen3-no-thinking", {}),
    "observation-masking": ("openhands-masking", {}),
    "condensation": ("openhands-summarize", {"max_size": 16}),
    "memory-block": ("letta", {}),
    "repo-map": ("aider", {}),
}
SWE_AGENT = "swe-agent"
CONCURRENCY_LEVELS = (2, 6, 10, 20)
DEFAULT_CONCURRENCY = 10
TAU_TRIALS_PER_TASK = 4


@dataclass(frozen=True)
class TraceSet:
    name: str
    seed: int
    task_parity: int  # tau-bench task ids this set draws from: id % 2 == task_parity
    includes_swe_agent: bool

    def patterns(self) -> list[str]:
        return [*TAU_PATTERNS, *([SWE_AGENT] if self.includes_swe_agent else [])]


TUNING = TraceSet("tuning", seed=1103, task_parity=0, includes_swe_agent=False)
TEST = TraceSet("test", seed=2207, task_parity=1, includes_swe_agent=True)
TRACE_SETS = {s.name: s for s in (TUNING, TEST)}


def draw_tasks(trace_set: TraceSet, tasks: int) -> list[int]:
    """The ``tasks`` tau-bench task ids the set draws, ascending."""
    runs = taubench_calls_by_task()
    eligible = sorted(task for task in runs if task % 2 == trace_set.task_parity)
    if tasks > len(eligible):
        raise ValueError(f"set {trace_set.name!r} has {len(eligible)} tasks, {tasks} asked")
    rng = np.random.default_rng(trace_set.seed)
    return sorted(int(t) for t in rng.choice(eligible, size=tasks, replace=False))


_CALLS_BY_TASK: dict[int, list[Call]] = {}


def taubench_calls_by_task() -> dict[int, list[Call]]:
    """tau-bench airline calls grouped by task id (sessions ``task<id>-trial<n>``), read once."""
    if not _CALLS_BY_TASK:
        for call in taubench_calls(TAU_BENCH_AIRLINE):
            task = int(call.session.removeprefix("task").partition("-")[0])
            _CALLS_BY_TASK.setdefault(task, []).append(call)
    return _CALLS_BY_TASK


def mean_session_duration(trace: Trace) -> float:
    """Mean time from a session's first to its last request's arrival."""
    spans: dict[str, list[float]] = {}
    for request in trace.requests:
        span = spans.setdefault(request.session, [request.arrival_s, request.arrival_s])
        span[0], span[1] = min(span[0], request.arrival_s), max(span[1], request.arrival_s)
    return float(np.mean([end - start for start, end in spans.values()]))


def mean_active_sessions(trace: Trace) -> float:
    """Sessions active (between their first and last arrival) at each request's arrival, averaged."""
    spans: dict[str, list[float]] = {}
    for request in trace.requests:
        span = spans.setdefault(request.session, [request.arrival_s, request.arrival_s])
        span[1] = max(span[1], request.arrival_s)
    starts = np.sort([s for s, _ in spans.values()])
    ends = np.sort([e for _, e in spans.values()])
    times = np.array([r.arrival_s for r in trace.requests])
    active = np.searchsorted(starts, times, side="right") - np.searchsorted(ends, times, side="left")
    return float(active.mean())


def build_trace(trace_set: TraceSet, pattern: str, concurrency: int, tasks: int) -> Trace:
    """The set's trace of ``pattern`` at ``concurrency`` sessions active at once, from ``tasks``
    of its tasks (all their trials)."""
    template = str(QWEN3_TEMPLATE)
    if pattern == SWE_AGENT:
        if not trace_set.includes_swe_agent:
            raise ValueError(f"set {trace_set.name!r} has no SWE-agent trace")
        return convert("swe-agent", SWE_AGENT_TRAJ, template_path=template)
    if pattern not in TAU_PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; known: {', '.join([*TAU_PATTERNS, SWE_AGENT])}")
    by_task = taubench_calls_by_task()
    calls = [call for task in draw_tasks(trace_set, tasks) for call in by_task[task]]
    emulator_name, params = TAU_PATTERNS[pattern]
    emulator = make_emulator(emulator_name, seed=trace_set.seed, **params)
    render = RenderConfig(template)
    source = str(TAU_BENCH_AIRLINE)
    unit = ArrivalModel(session_gap_s=1.0, seed=trace_set.seed)
    trace = calls_to_trace(calls, source=source, converter="edit", emulator=emulator, render=render, arrivals=unit)
    # The same draws at the interval that gives ``concurrency`` active sessions: only session
    # starts scale with it, so the durations measured at the unit interval hold.
    model = replace(unit, session_gap_s=mean_session_duration(trace) / concurrency)
    edited = emulator.apply(calls)
    output_lengths = {(r.session, r.turn): len(r.output_ids) for r in trace.requests}
    times = model.assign(edited, [output_lengths[(c.session, c.turn)] for c in edited])
    timed = {(c.session, c.turn): t for c, t in zip(edited, times)}
    requests = sorted((replace(r, arrival_s=timed[(r.session, r.turn)]) for r in trace.requests),
                      key=lambda r: (r.arrival_s, r.session, r.turn))
    meta = {**trace.meta, "arrival_s": {"assigned_by": "ArrivalModel", "session_gap_s": model.session_gap_s,
                                        "seed": model.seed, "target_active_sessions": concurrency},
            "trace_set": trace_set.name, "tasks": draw_tasks(trace_set, tasks)}
    return Trace(requests=requests, meta=meta)

"""The benchmark's tuning and test trace sets stay disjoint: no seed, no task in common."""

import pytest

from sglang_hybrid.replay.shared_data import TAU_BENCH_AIRLINE
from sglang_hybrid.replay.trace_sets import (
    SWE_AGENT, TEST, TRACE_SETS, TUNING, build_trace, draw_tasks, mean_active_sessions,
)

needs_data = pytest.mark.skipif(not TAU_BENCH_AIRLINE.exists(), reason="shared tau-bench trace absent")


def test_tuning_and_test_sets_share_no_seed_and_the_swe_agent_trace_is_test_only():
    assert set(TRACE_SETS.values()) == {TUNING, TEST}
    assert TUNING.seed != TEST.seed
    assert TUNING.task_parity != TEST.task_parity
    assert SWE_AGENT in TEST.patterns() and SWE_AGENT not in TUNING.patterns()
    with pytest.raises(ValueError, match="no SWE-agent trace"):
        build_trace(TUNING, SWE_AGENT, 10, 1)


@needs_data
def test_drawn_traces_share_no_task_and_no_session_and_reach_the_concurrency_asked():
    tuning, test = draw_tasks(TUNING, 20), draw_tasks(TEST, 20)
    assert not set(tuning) & set(test)
    assert draw_tasks(TEST, 20) == test  # seeded: the same draw every time
    a = build_trace(TUNING, "memory-block", 6, 2)
    b = build_trace(TEST, "memory-block", 6, 2)
    assert not {r.session for r in a.requests} & {r.session for r in b.requests}
    assert a.meta["arrival_s"]["seed"] == TUNING.seed and b.meta["arrival_s"]["seed"] == TEST.seed
    wide = build_trace(TEST, "repo-map", 6, 4)
    narrow = build_trace(TEST, "repo-map", 2, 4)
    assert mean_active_sessions(narrow) < mean_active_sessions(wide)

"""The semantic cache's eviction victim is the brute-force minimum of the planner's values.

The planner keeps every held checkpoint's value in a table (``HeldValues``) between the changes
that move it, and the cache picks victims from it by slot with its own recency stamps, walking
neither the tree nor the LRU list. On random agent sessions (appends, edits in the middle,
repeats; message starts for the planner's anchors) through the real cache this checks that the
victim is the one a scan computing everything afresh picks (the lowest value, ties to the least
recently restored), that a cache picking every victim by such a scan ends every request holding
the same checkpoints, and that every value in the table equals a fresh valuation after each
request and each eviction.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from sglang_hybrid.anchors.special_tokens import QWEN3_SPECIAL_IDS
from sglang_hybrid.cache import semantic_component
from sglang_hybrid.cache.planning import CheckpointId
from sglang_hybrid.planning import planner as planner_module
from sglang_hybrid.planning.admission import Candidates
from sglang_hybrid.planning.state import Purpose
from sglang_hybrid.planning.valuation import checkpoint_value
from sglang_hybrid.replay.cost_model import DEFAULT_PROFILE, get_profile
from sglang_hybrid.replay.policies import drive
from sglang_hybrid.replay.policies.semantic import SemanticPolicy, tiny_state_spec
from sglang_hybrid.replay.trace import Request

MAMBA = ComponentType.MAMBA
IM_START = QWEN3_SPECIAL_IDS["<|im_start|>"]


def walked_depth(node) -> int:
    depth = 0
    while node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


def brute_force_victim(policy: SemanticPolicy):
    planner = policy.planner
    lru = policy.cache.tree_core.lru_lists[MAMBA]
    node, best, best_slot, best_value = lru.get_lru_no_lock(), None, None, None
    while node is not None:
        checkpoint = CheckpointId.device(int(node.component_data[MAMBA].value))
        record = planner.records.get(checkpoint)
        known = record is not None and record.depth == walked_depth(node)
        fresh = checkpoint_value(record, checkpoint, planner.sessions, planner.stream) if known else 0.0
        if best_value is None or fresh < best_value:
            best, best_slot, best_value = node, checkpoint.slot, fresh
        node = lru.get_prev_no_lock(node)
    return best, best_slot, best_value


def brute_force_victims(policy: SemanticPolicy):
    """``brute_force_victim`` again after each victim is taken."""
    while (victim := brute_force_victim(policy))[0] is not None:
        yield victim


def message(rng: np.random.Generator, size: int) -> np.ndarray:
    return np.concatenate([[IM_START], rng.integers(1000, 50_000, size)]).astype(np.int32)


def random_sessions(seed, steps) -> list[Request]:
    rng = np.random.default_rng(seed)
    histories: dict[int, list[np.ndarray]] = {}
    requests = []
    for turn, (session, kind, size) in enumerate(steps):
        history = histories.setdefault(session, [message(rng, 30)])
        if kind == "append":
            history.append(message(rng, size))
        elif kind == "edit" and len(history) > 1:
            history[int(rng.integers(0, len(history)))] = message(rng, size)
        elif kind == "fork":
            # Repeats another session's history and goes on from it (a trial of the same task):
            # it follows that session, whose shared-path checkpoints are then worth more.
            source = histories.get((session + 1) % 4)
            if source is not None:
                history[:] = [*source, message(rng, size)]
        # Outputs closing with few tokens, as an agent's do: sessions share closings, and
        # the counts after each.
        output = np.concatenate([rng.integers(1000, 50_000, 2), rng.integers(5, 8, 2)]).astype(np.int32)
        requests.append(Request(f"s{session}", turn, float(turn), np.concatenate(history), output))
    return requests


def replay_policy(slots: int) -> SemanticPolicy:
    return SemanticPolicy(slots, get_profile(DEFAULT_PROFILE), spec=tiny_state_spec(kv_tokens=1 << 14))


def held(policy: SemanticPolicy) -> list[tuple[int, int]]:
    """(depth, purpose) of every held checkpoint, sorted."""
    return sorted((record.depth, int(record.purpose)) for record in policy.planner.records.values())


SESSIONS = dict(seed=st.integers(0, 2**32 - 1), slots=st.integers(2, 6),
                steps=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["append", "edit", "repeat", "fork"]),
                                         st.integers(1, 40)), min_size=4, max_size=16))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SESSIONS)
def test_victim_is_the_brute_force_minimum(seed, slots, steps):
    policy = replay_policy(slots)
    component = policy.cache.components[MAMBA]
    for _ in drive(random_sessions(seed, steps), [policy]):
        assert next(component._victims(), (None, None, None)) == brute_force_victim(policy)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SESSIONS)
def test_evicting_in_order_keeps_what_a_brute_force_scan_keeps(seed, slots, steps):
    ordered, scanned = replay_policy(slots), replay_policy(slots)
    scanned.cache.components[MAMBA]._victims = lambda: brute_force_victims(scanned)
    # One rank selected at a time: every victim after the first extends the selection.
    with mock.patch.object(semantic_component, "_FIRST_RANKS", 1):
        for _ in drive(random_sessions(seed, steps), [ordered, scanned]):
            assert held(ordered) == held(scanned)


@settings(max_examples=200, deadline=None)
@given(pool=st.lists(st.tuples(st.booleans(), st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.integers(0, 3)),
                     min_size=1, max_size=40),
       count=st.integers(1, 45))
def test_lowest_slots_are_the_sorted_prefix(pool, count):
    """The selection gives the first ``count`` of the held slots sorted by value, then
    recency, then slot (ties abound: many checkpoints are worth 0)."""
    held = np.array([entry[0] for entry in pool])
    values = np.array([entry[1] for entry in pool])
    recency = np.array([float(entry[2]) for entry in pool])
    slots = np.flatnonzero(held)
    expected = slots[np.lexsort((slots, recency[slots], values[slots]))][:count]
    lowest_values, lowest_recency, lowest_slots = semantic_component._lowest(held, values, recency, count)
    assert lowest_slots.tolist() == expected.tolist()
    assert lowest_values.tolist() == values[expected].tolist()
    assert lowest_recency.tolist() == recency[expected].tolist()


def assert_values_are_fresh(planner) -> None:
    for checkpoint, record in planner.records.items():
        fresh = checkpoint_value(record, checkpoint, planner.sessions, planner.stream)
        assert planner.value(checkpoint, record.depth) == fresh, (checkpoint, record)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SESSIONS)
def test_held_values_equal_fresh_valuations_after_every_change(seed, slots, steps):
    """The planner's table of held values (``HeldValues``) keeps values between changes; after
    every request, and after each of the evictions that follow it, every one equals a fresh
    scalar valuation. So do candidates serving other sessions, which a plan values in bulk.
    The planner forgets the sessions holding nothing every other request here (silent for a
    gap: their table indices go to the next new sessions)."""
    policy = replay_policy(slots + 4)
    planner = policy.planner
    with mock.patch.object(planner_module, "FORGET_SWEEP_REQUESTS", 2), \
            mock.patch.object(planner_module, "FORGET_AFTER_GAPS", 1):
        for step, _ in drive(random_sessions(seed, steps), [policy]):
            assert_values_are_fresh(planner)
            # A request's candidates serving other sessions are valued in bulk: the same values.
            # (Branch points first, as ``propose`` gives them.)
            pairs = [(depth, purpose) for purpose in (Purpose.BRANCH, Purpose.SHARED_PATH)
                     for depth in range(1, step.prompt_len, 7)]
            session = step.request.session
            spans = planner.sessions[session].planned_spans
            paths = sum(purpose is Purpose.SHARED_PATH for _, purpose in pairs)
            candidates = Candidates([], [depth for depth, _ in pairs], [purpose for _, purpose in pairs],
                                    [spans.get(depth, depth) for depth, _ in pairs], paths)
            bulk = planner._shared_candidates(session, candidates).values.tolist()
            assert bulk == [checkpoint_value(planner._new_record(session, depth, purpose), None, planner.sessions,
                                             planner.stream) for depth, purpose in pairs]
            for _ in range(2):
                policy.cache.evict_checkpoints(1)
                assert_values_are_fresh(policy.planner)


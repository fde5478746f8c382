"""The semantic cache's eviction victim is the brute-force minimum of the planner's values.

Victim selection remembers each node's checkpoint and depth and the planner remembers held
values until its state changes; this checks, after every request of random agent sessions
(appends, edits in the middle, repeats; message starts for the planner's anchors) through the
real cache, that the victim it picks is the one a scan computing everything afresh picks:
the lowest value, ties to the least recently restored.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from sglang_hybrid.anchors.special_tokens import QWEN3_SPECIAL_IDS
from sglang_hybrid.cache.planning import CheckpointId
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
    node, best, best_value = lru.get_lru_no_lock(), None, None
    while node is not None:
        checkpoint = CheckpointId.device(int(node.component_data[MAMBA].value))
        record = planner.records.get(checkpoint)
        known = record is not None and record.depth == walked_depth(node)
        fresh = checkpoint_value(record, checkpoint, planner.sessions, planner.stream) if known else 0.0
        if best_value is None or fresh < best_value:
            best, best_value = node, fresh
        node = lru.get_prev_no_lock(node)
    return best, best_value


def message(rng: np.random.Generator, size: int) -> np.ndarray:
    return np.concatenate([[IM_START], rng.integers(1000, 50_000, size)]).astype(np.int32)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), slots=st.integers(2, 6),
       steps=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["append", "edit", "repeat"]),
                                st.integers(1, 40)), min_size=4, max_size=16))
def test_victim_is_the_brute_force_minimum(seed, slots, steps):
    rng = np.random.default_rng(seed)
    policy = SemanticPolicy(slots, get_profile(DEFAULT_PROFILE), spec=tiny_state_spec(kv_tokens=1 << 14))
    histories: dict[int, list[np.ndarray]] = {}
    requests = []
    for turn, (session, kind, size) in enumerate(steps):
        history = histories.setdefault(session, [message(rng, 30)])
        if kind == "append":
            history.append(message(rng, size))
        elif kind == "edit" and len(history) > 1:
            history[int(rng.integers(0, len(history)))] = message(rng, size)
        requests.append(Request(f"s{session}", turn, float(turn), np.concatenate(history),
                                rng.integers(1000, 50_000, 3).astype(np.int32)))
    component = policy.cache.components[MAMBA]
    for _ in drive(requests, [policy]):
        victim, value = component._pick_victim()
        expected, expected_value = brute_force_victim(policy)
        assert victim is expected
        assert value == expected_value

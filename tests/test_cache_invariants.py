"""Randomized operation sequences over the real semantic cache, invariants after every step.

Tiny pools make exhaustion constant: 3 checkpoint slots, 4 live request rows, a KV pool a few
requests deep. Sessions grow, get edited in the middle, repeat, branch; requests are admitted
(with a restore), get checkpoints staged inside their prefill, finish or abort; KV and
checkpoints are evicted under pressure; probe matches look without touching.

After every step: no slot is both free and used; slots in use = checkpoints in the tree +
staged captures; every checkpoint sits at a node end and holds the state of exactly the
tokens from the root to that node (a fingerprint written when it was taken); the MAMBA LRU
list holds exactly the nodes that have checkpoints; KV slots and live state slots are
conserved; SGLang's own ``sanity_check`` passes. A restore is checked against the prefix it
claims before the request "computes".

The default run is a few thousand operations; ``pytest -m stress`` runs about 100,000.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from sglang_hybrid.harness.lifecycle import KVExhausted

from cache_fixtures import (
    build_tiered,
    fingerprint,
    live_state_fingerprint,
    tree_nodes,
    write_checkpoint_slot,
    write_live_state,
)

MAMBA, FULL = ComponentType.MAMBA, ComponentType.FULL
MAX_IN_FLIGHT = 3


def path_tokens(node) -> list[int]:
    keys = []
    while node.parent is not None:
        keys.append(list(node.key.token_ids))
        node = node.parent
    return [t for key in reversed(keys) for t in key]


class SemanticCacheMachine(RuleBasedStateMachine):
    host_slots = 0

    def __init__(self):
        super().__init__()
        self.driver = build_tiered(3, self.host_slots, kv_size=600, max_num_reqs=MAX_IN_FLIGHT + 1)
        self.cache = self.driver.cache
        self.sessions: list[list[int]] = []
        self.in_flight: list = []
        self.next_token = 1000
        self.kv_total = self.driver.tree.allocator.available_size()
        self.live_total = self.driver.tree.req_to_token_pool.mamba_allocator.size

    def fresh_tokens(self, n: int) -> list[int]:
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return tokens

    # ---- operations ----

    @precondition(lambda self: len(self.in_flight) < MAX_IN_FLIGHT)
    @rule(
        data=st.data(),
        kind=st.sampled_from(["new", "append", "edit", "repeat", "branch"]),
        size=st.integers(1, 24),
        output=st.integers(0, 6),
    )
    def admit(self, data, kind, size, output):
        if kind == "new" or not self.sessions:
            prompt = self.fresh_tokens(size)
            self.sessions.append(prompt)
        else:
            index = data.draw(st.integers(0, len(self.sessions) - 1))
            base = self.sessions[index]
            if kind == "append":
                prompt = base + self.fresh_tokens(size)
            elif kind == "repeat":
                prompt = list(base)
            else:
                cut = data.draw(st.integers(0, len(base) - 1))
                tail = base[cut + 1:] if kind == "edit" else []
                prompt = base[:cut] + self.fresh_tokens(size) + tail
            self.sessions[index] = prompt
        req = self.driver.new_request(prompt, self.fresh_tokens(output))
        # The session continues from what the model produced, as an agent's next turn does.
        self.sessions[self.sessions.index(prompt)] = list(req.full_untruncated_fill_ids)
        try:
            result = self.driver.admit(req)
        except KVExhausted:  # the scheduler would leave it waiting; nothing may leak
            return
        self.driver.start([req])
        depth = result.device_prefix_len
        if depth > 0:
            assert live_state_fingerprint(self.driver.tree, req.kv.mamba_pool_idx) == fingerprint(
                req.full_untruncated_fill_ids[:depth]
            )
        self.in_flight.append(req)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def stage_checkpoint(self, data):
        req = data.draw(st.sampled_from(self.in_flight))
        total = len(req.full_untruncated_fill_ids)
        if req.prefix_len >= total:
            return
        depth = data.draw(st.integers(req.prefix_len + 1, total))
        slot = self.cache.alloc_checkpoint_slot()
        if slot is None:
            return
        write_checkpoint_slot(self.driver.tree, slot, req.full_untruncated_fill_ids[:depth])
        self.cache.stage_checkpoint(req, depth, slot)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), aborted=st.booleans())
    def release(self, data, aborted):
        req = data.draw(st.sampled_from(self.in_flight))
        self.in_flight.remove(req)
        if aborted:
            self.driver.abort(req)
        else:
            write_live_state(self.driver.tree, req.kv.mamba_pool_idx, req.full_untruncated_fill_ids)
            self.driver.finish(req)

    @precondition(lambda self: self.driver.tree.allocator.available_size() < 300)
    @rule(tokens=st.integers(1, 200))
    def evict_kv(self, tokens):
        self.cache.evict(EvictParams(num_tokens=tokens))

    @precondition(lambda self: self.cache.checkpoint_pool.available_size() == 0)
    @rule(num=st.integers(1, 3))
    def evict_checkpoints(self, num):
        self.cache.evict_checkpoints(num)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def probe(self, data):
        prompt = data.draw(st.sampled_from(self.sessions))
        before = {n.id: n.component_data[MAMBA].value for n in tree_nodes(self.cache)}
        self.driver.match(self.driver.new_request(prompt), cow=False)
        after = {n.id: n.component_data[MAMBA].value for n in tree_nodes(self.cache)}
        assert {k for k, v in before.items() if v is not None} <= set(after)

    # ---- invariants ----

    @invariant()
    def slots_are_accounted_for(self):
        pool = self.cache.checkpoint_pool
        in_tree = [int(n.component_data[MAMBA].value) for n in tree_nodes(self.cache)
                   if n.component_data[MAMBA].value is not None]
        free = pool.free_slot_ids()
        assert len(set(in_tree)) == len(in_tree)
        assert not set(in_tree) & set(free)
        assert len(set(free)) == len(free)
        assert pool.used_size() == len(in_tree) + self.cache.staged_slots()

    @invariant()
    def host_tier_is_accounted_for(self):
        tier = self.cache.checkpoint_pool.host_tier
        mamba = self.cache.components[MAMBA]
        if tier is None:
            assert not mamba.host_slots
            return
        host = [int(s) for s in mamba.host_slots.values()]
        assert len(set(host)) == len(host)
        assert not set(host) & set(tier.free_slot_ids())
        assert tier.used_size() == len(host) == len(mamba.host_lru)
        live = {n.id for n in tree_nodes(self.cache)}
        for node_id, slot in mamba.host_slots.items():
            node = mamba.host_lru[node_id]
            assert node_id in live and node.component_data[MAMBA].value is None
            held = {float(v) for v in tier.temporal[:, int(slot)].unique()}
            assert held == {fingerprint(path_tokens(node))}

    @invariant()
    def checkpoints_hold_the_state_of_their_path(self):
        pool = self.cache.checkpoint_pool
        for node in tree_nodes(self.cache):
            slot = node.component_data[MAMBA].value
            if slot is None:
                continue
            assert node.component_data[FULL].value is not None
            held = {float(v) for v in pool.temporal[:, int(slot)].unique()}
            assert held == {fingerprint(path_tokens(node))}

    @invariant()
    def lru_holds_exactly_the_checkpointed_nodes(self):
        lru = self.cache.tree_core.lru_lists[MAMBA]
        holders = {n.id for n in tree_nodes(self.cache) if n.component_data[MAMBA].value is not None}
        assert set(lru.cache) == holders
        # The component's slot map and recency stamps, which eviction reads instead of the
        # list, hold the same nodes in the same order.
        mamba = self.cache.components[MAMBA]
        held_slots = np.flatnonzero(mamba.slot_held)
        assert {mamba.slot_holders[s].id for s in held_slots} == holders
        for slot in held_slots:
            value = mamba.slot_holders[slot].component_data[MAMBA].value
            # One slot, as SGLang's ledgers count it (``reclaimable_value_len``).
            assert value.shape == (1,) and int(value) == slot
        by_recency = [mamba.slot_holders[s].id for s in held_slots[np.argsort(mamba.slot_recency[held_slots])]]
        walked, node = [], lru.tail.lru_prev[lru._pt]  # least recent first, locked ones too
        while node is not lru.head:
            walked.append(node.id)
            node = node.lru_prev[lru._pt]
        assert by_recency == walked

    @invariant()
    def pools_are_conserved(self):
        t = self.driver.tree
        tree_kv = sum(len(n.component_data[FULL].value) for n in tree_nodes(self.cache)
                      if n.component_data[FULL].value is not None)
        private_kv = sum(len(r.full_untruncated_fill_ids) - r.kv.cache_protected_len for r in self.in_flight)
        assert t.allocator.available_size() + tree_kv + private_kv == self.kv_total
        live = t.req_to_token_pool.mamba_allocator.available_size()
        assert live + len(self.in_flight) == self.live_total

    @invariant()
    def sglang_sanity_check(self):
        if not self.in_flight:
            self.cache.sanity_check()


class TieredCacheMachine(SemanticCacheMachine):
    """The same operations with a 3-slot host tier under the 3 device slots."""

    host_slots = 3


DEFAULT_RUN = settings(
    max_examples=40, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSemanticCacheInvariants = SemanticCacheMachine.TestCase
TestSemanticCacheInvariants.settings = DEFAULT_RUN
TestTieredCacheInvariants = TieredCacheMachine.TestCase
TestTieredCacheInvariants.settings = DEFAULT_RUN


@pytest.mark.stress
def test_stress_two_hundred_thousand_operations():
    run = settings(max_examples=1000, stateful_step_count=100, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(SemanticCacheMachine, settings=run)
    run_state_machine_as_test(TieredCacheMachine, settings=run)

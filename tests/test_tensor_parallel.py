"""Tensor-parallel ranks agree on every decision of the cache, the host-tier reclaim included.

Each TP rank runs its own scheduler and cache over the same request stream. A demotion to
the host tier frees its device slot only once its copy has finished, and on a GPU that moment
differs from rank to rank; the cache therefore frees, on every rank, the least number of
finished demotions any rank counts (a MIN all-reduce over the TP group). A CPU host has no
asynchronous copies, so these tests queue demotions whose completion they set per rank
(``FinishedOnRank``) and check that ranks which see different completions still allocate the
same slots and hold the same state (``state_digest``); and, as a control, that ranks
reclaiming on their own would not.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cache_fixtures import build_tiered, serve, small_spec

from sglang_hybrid.anchors.detector import NO_ANCHORS
from sglang_hybrid.config import SemanticCacheConfig
from sglang_hybrid.harness.lifecycle import RequestLifecycle
from sglang_hybrid.harness.pools import build_tree_cache

DEVICE_SLOTS = 4
# Per rank: which of the two queued demotions has finished its copy.
FINISHED = {0: (True, True), 1: (True, False)}


class FinishedOnRank:
    """A demotion's completion event as one rank sees it (on a GPU, a ``torch.cuda.Event``)."""

    def __init__(self, finished: bool):
        self.finished = finished

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        assert self.finished, "a rank waited for a copy it had not seen finish"


def _allocations_with_demotions_in_flight(driver: RequestLifecycle, finished: tuple[bool, ...]):
    """Take every free device slot, queue two of them as demotions in flight with the given
    completion, then allocate twice; return what each allocation got, the state digest and
    the demotions still pending."""
    cache = driver.cache
    pool, tier = cache.checkpoint_pool, cache.checkpoint_pool.host_tier
    held = []
    while (slot := pool.alloc(1)) is not None:
        held.append(slot)
    assert len(held) >= len(finished)
    for slot, done in zip(held, finished):
        # What HostCheckpointTier.demote queues on a GPU: the slot comes back once the copy ends.
        tier._pending_device_frees.append((FinishedOnRank(done), slot))
    got = []
    for _ in range(2):
        slot = cache.alloc_checkpoint_slot()
        got.append(None if slot is None else int(slot))
    return got, cache.state_digest(), len(tier.pending_device_slots())


def _tiered_driver(tp_group=None) -> RequestLifecycle:
    config = SemanticCacheConfig(
        state_checkpoint_slots=DEVICE_SLOTS,
        state_checkpoint_host_slots=4,
        checkpoint_planner="none",
        anchor_template_family=NO_ANCHORS,
    )
    return RequestLifecycle(build_tree_cache("semantic", small_spec(), config=config, tp_group=tp_group))


def _serve_sessions(driver: RequestLifecycle, count: int) -> None:
    for k in range(count):
        serve(driver, [100 + k] * 40, [1])


class MinAllReduceOfTwoThreads:
    """Stands in for the TP CPU group of two ranks run as threads: ``all_reduce`` with MIN."""

    def __init__(self):
        self.values: dict[int, torch.Tensor] = {}
        self.barrier = threading.Barrier(2)

    def all_reduce_of(self, rank: int):
        def all_reduce(tensor: torch.Tensor, op) -> None:
            assert op == dist.ReduceOp.MIN
            self.values[rank] = tensor.clone()
            self.barrier.wait()
            reduced = torch.minimum(self.values[0], self.values[1])
            self.barrier.wait()
            tensor.copy_(reduced)

        return all_reduce


def test_ranks_that_see_different_copies_finish_free_the_same_slots():
    group = MinAllReduceOfTwoThreads()
    outcomes: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int, driver: RequestLifecycle) -> None:
        try:
            driver.cache._all_reduce = group.all_reduce_of(rank)  # SGLang's TP (and PP) all-reduce
            outcomes[rank] = _allocations_with_demotions_in_flight(driver, FINISHED[rank])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            group.barrier.abort()

    drivers = {rank: _tiered_driver() for rank in FINISHED}
    threads = [threading.Thread(target=rank_main, args=(rank, drivers[rank])) for rank in FINISHED]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    # Both ranks free only the demotion both saw finish, and hand out the same slot.
    assert outcomes[0] == outcomes[1]
    got, _, still_pending = outcomes[0]
    assert got[0] is not None and got[1] is None and still_pending == 1


def test_ranks_reclaiming_alone_would_diverge():
    # The control: the same completions without the agreement give different allocations.
    alone = {rank: _allocations_with_demotions_in_flight(_tiered_driver(), FINISHED[rank]) for rank in FINISHED}
    assert alone[0][0] != alone[1][0]
    assert alone[0][1] != alone[1][1]


def test_state_digest_follows_the_tree_and_the_free_slots():
    first, second = build_tiered(device_slots=2, host_slots=4), build_tiered(device_slots=2, host_slots=4)
    assert first.cache.state_digest() == second.cache.state_digest()
    for driver in (first, second):
        _serve_sessions(driver, 5)  # more than the device slots: some are demoted
    assert first.cache.state_digest() == second.cache.state_digest()
    serve(first, [100] * 40 + [1, 7, 7], [2])
    assert first.cache.state_digest() != second.cache.state_digest()


def _gloo_rank(rank: int, world_size: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        driver = _tiered_driver(tp_group=dist.group.WORLD)
        _serve_sessions(driver, 2)  # two device slots hold checkpoints, two are free
        results[rank] = _allocations_with_demotions_in_flight(driver, FINISHED[rank])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_agree_on_the_reclaim_through_sglangs_all_reduce():
    from tiny_server import free_local_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_gloo_rank, args=(2, free_local_port(), results), nprocs=2, join=True)
        outcomes = dict(results)
    assert outcomes[0] == outcomes[1]
    got, _, still_pending = outcomes[0]
    # The second allocation found no free slot and evicted a tree checkpoint (to the host).
    assert None not in got and still_pending == 1

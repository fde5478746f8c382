"""Host-memory tier below the device checkpoint pool.

A consumer GPU can spare VRAM for a handful of checkpoints (a Qwen3.5-35B-A3B-class one is
about 63 MiB), while the host has tens of GB; restoring 63 MiB over PCIe 4 takes about 3 ms,
re-prefilling 10,000 tokens takes seconds. So a checkpoint evicted from the device pool is
demoted here instead of dropped, and promoted back when a request restores from it.

The host keeps each checkpoint as one contiguous run of bytes (``allocate_slot_major``), so a
move is one DMA of the whole checkpoint: a demotion gathers the device slot's layers into a
contiguous staging copy on the device (``copy_states``, at device bandwidth) and sends that;
a promotion receives into staging and scatters it into the slot. On a GPU the host rows are
pinned and both run on a side stream: a demotion is queued after the work that produced the
state and the scheduler never waits on it; its device slot is handed back only once the copy
has finished (``finished_demotions``, ``reclaim``), so it cannot be overwritten mid-copy.
When a copy finishes differs between tensor-parallel ranks, so the cache agrees with the
other ranks on how many to reclaim before it calls ``reclaim``. A promotion
orders the forward stream after its own copy before the restore reads it. On CPU (tests,
the reference engine) the copies are immediate, without staging.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Optional

import torch

from sglang_hybrid.cache.slots import SlotFreeList

if TYPE_CHECKING:
    from sglang_hybrid.cache.checkpoint_pool import StateCheckpointPool, StateLayout


class HostCheckpointTier:
    def __init__(self, layout: "StateLayout", num_slots: int, device_pool: "StateCheckpointPool"):
        if num_slots < 0:
            raise ValueError(f"host checkpoint slots must be >= 0, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.device_pool = device_pool
        self.on_gpu = device_pool.device.type == "cuda"
        # Row 0 reserved, as in the device pool.
        self.storage, self.conv, self.temporal = layout.allocate_slot_major(
            num_slots + 1, "cpu", pin_memory=self.on_gpu
        )
        self.slots = SlotFreeList(num_slots, "cpu")
        self.stream = torch.cuda.Stream(device=device_pool.device) if self.on_gpu else None
        # (event, device slot) of demotions in flight: the slot is freed when the copy is done.
        self._pending_device_frees: deque[tuple[torch.cuda.Event, int]] = deque()

    def alloc(self) -> Optional[torch.Tensor]:
        return self.slots.alloc(1)

    def free(self, slot: torch.Tensor) -> None:
        self.slots.free(slot)

    def used_size(self) -> int:
        return self.num_slots - self.slots.available_size()

    def free_slot_ids(self) -> list[int]:
        return self.slots.free_slot_ids()

    def clear(self) -> None:
        self.slots.clear()

    def demote(self, device_slot: int, host_slot: torch.Tensor) -> None:
        """Copy a device checkpoint to ``host_slot``, then give ``device_slot`` back (an index the
        caller knows: reading it off a device tensor would wait for the device)."""
        pool, d, h = self.device_pool, device_slot, int(host_slot)
        if not self.on_gpu:
            pool.copy_slots(pool.conv, pool.temporal, self.conv, self.temporal, _slot(d), _slot(h))
            pool.slots.free_ids([d])
            return
        self.stream.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.stream(self.stream):
            # Allocated on the side stream: the allocator reuses it only after this copy.
            staging, staged_conv, staged_temporal = pool.layout.allocate_slot_major(1, pool.device, zeroed=False)
            pool.copy_slots(pool.conv, pool.temporal, staged_conv, staged_temporal,
                            _slot(d, pool.device), _slot(0, pool.device))
            self.storage[h].copy_(staging[0], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending_device_frees.append((done, d))

    def promote(self, host_slot: torch.Tensor, device_slot: torch.Tensor) -> None:
        """Copy a host checkpoint into ``device_slot``; the host slot is given back."""
        pool = self.device_pool
        self._upload(int(host_slot), pool.conv, pool.temporal, int(device_slot))
        self.free(host_slot)

    def load_to_active(self, host_slot: torch.Tensor, active_mamba_pool, active_slot: torch.Tensor) -> None:
        """Restore straight from host into a live slot (used when no device slot is free)."""
        cache = active_mamba_pool.mamba_cache
        self._upload(int(host_slot), cache.conv, cache.temporal, int(active_slot))

    def _upload(self, host_row: int, dst_conv, dst_temporal, dst_slot: int) -> None:
        pool = self.device_pool
        if not self.on_gpu:
            pool.copy_slots(self.conv, self.temporal, dst_conv, dst_temporal, _slot(host_row), _slot(dst_slot))
            return
        forward_stream = torch.cuda.current_stream(pool.device)
        self.stream.wait_stream(forward_stream)  # after the forward's earlier use of dst
        with torch.cuda.stream(self.stream):
            staging, staged_conv, staged_temporal = pool.layout.allocate_slot_major(1, pool.device, zeroed=False)
            staging[0].copy_(self.storage[host_row], non_blocking=True)
            pool.copy_slots(staged_conv, staged_temporal, dst_conv, dst_temporal,
                            _slot(0, pool.device), _slot(dst_slot, pool.device))
        forward_stream.wait_stream(self.stream)  # before the restore reads it

    def finished_demotions(self) -> int:
        """How many demotions, oldest first, have finished their copy on this rank."""
        finished = 0
        for done, _ in self._pending_device_frees:
            if not done.query():
                break
            finished += 1
        return finished

    def reclaim(self, count: int) -> None:
        """Give back the device slots of the ``count`` oldest demotions.

        ``count`` is what every tensor-parallel rank agreed on (the least of their
        ``finished_demotions``), so a copy counted is finished here too; waiting on its
        event only orders this host thread after it.
        """
        if not 0 <= count <= len(self._pending_device_frees):
            raise ValueError(f"cannot reclaim {count} of {len(self._pending_device_frees)} pending demotions")
        for _ in range(count):
            done, slot = self._pending_device_frees.popleft()
            done.synchronize()
            self.device_pool.slots.free_ids([slot])

    def pending_device_slots(self) -> list[int]:
        """Device slots of demotions in flight, oldest first: neither free nor in the tree."""
        return [slot for _, slot in self._pending_device_frees]


def _slot(index: int, device="cpu") -> torch.Tensor:
    # A fill kernel, not a host-to-device copy: nothing here may wait for the device.
    return torch.full((1,), index, dtype=torch.int64, device=device)

"""Host-memory tier below the device checkpoint pool.

A consumer GPU can spare VRAM for a handful of checkpoints (a Qwen3.5-35B-A3B-class one is
about 63 MiB), while the host has tens of GB; restoring 63 MiB over PCIe 4 takes about 3 ms,
re-prefilling 10,000 tokens takes seconds. So a checkpoint evicted from the device pool is
demoted here instead of dropped, and promoted back when a request restores from it.

On a GPU the host rows are pinned and copies run on a side stream: a demotion is queued after
the work that produced the state and the scheduler never waits on it; its device slot is
handed back only once the copy has finished (``reclaim_finished``), so it cannot be
overwritten mid-copy. A promotion waits for its own copy before the restore reads it. On CPU
(tests, the reference engine) both tiers are plain tensors and copies are immediate.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

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
        self.conv, self.temporal = layout.allocate(num_slots + 1, "cpu", pin_memory=self.on_gpu)
        self.allocator = MambaSlotAllocator(size=num_slots, device="cpu")
        self.stream = torch.cuda.Stream(device=device_pool.device) if self.on_gpu else None
        # (event, device slot) of demotions in flight: the slot is freed when the copy is done.
        self._pending_device_frees: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()

    def alloc(self) -> Optional[torch.Tensor]:
        return self.allocator.alloc(1)

    def free(self, slot: torch.Tensor) -> None:
        self.allocator.free(slot.view(-1).to(torch.int64))

    def used_size(self) -> int:
        return self.num_slots - self.allocator.available_size()

    def free_slot_ids(self) -> list[int]:
        return self.allocator.free_slots.tolist()

    def clear(self) -> None:
        self.allocator.clear()

    def demote(self, device_slot: torch.Tensor, host_slot: torch.Tensor) -> None:
        """Copy a device checkpoint to ``host_slot``, then give ``device_slot`` back."""
        d, h = int(device_slot), int(host_slot)
        if not self.on_gpu:
            self._copy_rows(self.device_pool, d, self, h)
            self.device_pool.free(device_slot)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
        with torch.cuda.stream(self.stream):
            self._copy_rows(self.device_pool, d, self, h, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending_device_frees.append((done, device_slot))

    def promote(self, host_slot: torch.Tensor, device_slot: torch.Tensor) -> None:
        """Copy a host checkpoint into ``device_slot``; the host slot is given back."""
        h, d = int(host_slot), int(device_slot)
        if self.on_gpu:
            with torch.cuda.stream(self.stream):
                self._copy_rows(self, h, self.device_pool, d, non_blocking=True)
            torch.cuda.current_stream(self.device_pool.device).wait_stream(self.stream)
        else:
            self._copy_rows(self, h, self.device_pool, d)
        self.free(host_slot)

    def load_to_active(self, host_slot: torch.Tensor, active_mamba_pool, active_slot: torch.Tensor) -> None:
        """Restore straight from host into a live slot (used when no device slot is free)."""
        h, a = int(host_slot), int(active_slot)
        cache = active_mamba_pool.mamba_cache
        for src, dst in zip([*self.conv, self.temporal], [*cache.conv, cache.temporal]):
            dst[:, a].copy_(src[:, h], non_blocking=self.on_gpu)

    def reclaim_finished(self) -> None:
        """Give back the device slots of demotions whose copy has completed."""
        while self._pending_device_frees and self._pending_device_frees[0][0].query():
            _, slot = self._pending_device_frees.popleft()
            self.device_pool.free(slot)

    def pending_device_slots(self) -> int:
        return len(self._pending_device_frees)

    @staticmethod
    def _copy_rows(src, src_row: int, dst, dst_row: int, non_blocking: bool = False) -> None:
        for s, d in zip([*src.conv, src.temporal], [*dst.conv, dst.temporal]):
            d[:, dst_row].copy_(s[:, src_row], non_blocking=non_blocking)

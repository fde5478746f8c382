"""SlotFreeList: the free slots of a checkpoint tier, as Python ints.

SGLang's ``MambaSlotAllocator`` keeps its free list as a tensor: every alloc slices it and every
free concatenates to it, ~20 us of torch calls per eviction call on the scheduler thread, and
listing the free slots (once per finished request) reads the tensor, on a GPU a wait for the
device. This list hands slots out in the same order (from the front, freed ones to the back), each
as its one-element view of a tensor of slot indices on the tier's device, made once.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import torch


class SlotFreeList:
    """Slots 1..``num_slots`` (0 is reserved, as in ``MambaSlotAllocator``)."""

    def __init__(self, num_slots: int, device: str | torch.device):
        self.num_slots = num_slots
        self._views = list(torch.arange(num_slots + 1, dtype=torch.int64, device=device).split(1))
        self.clear()

    def alloc(self, n: int = 1) -> Optional[torch.Tensor]:
        """``n`` free slots as a tensor of their indices; None if fewer are free."""
        if n > len(self._free):
            return None
        taken = [self._free.popleft() for _ in range(n)]
        self._free_set.difference_update(taken)
        if n == 1:
            return self._views[taken[0]]
        return torch.cat([self._views[slot] for slot in taken])

    def free(self, slots: torch.Tensor) -> None:
        """Free ``slots``, a tensor of slot indices (as SGLang's pools take them)."""
        self.free_ids(slots.view(-1).tolist())

    def free_ids(self, slots: Sequence[int]) -> None:
        """Free the slots of these indices: a caller that knows them saves reading a tensor."""
        self._free.extend(slots)
        self._free_set.update(slots)

    def available_size(self) -> int:
        return len(self._free)

    def free_slot_ids(self) -> list[int]:
        return list(self._free)

    def is_allocated(self, slots: torch.Tensor) -> bool:
        """Whether every one of ``slots`` is a slot of this list that ``alloc`` handed out."""
        return all(1 <= slot <= self.num_slots and slot not in self._free_set for slot in slots.view(-1).tolist())

    def clear(self) -> None:
        """Every slot free, handed out in ascending order."""
        self._free: deque[int] = deque(range(1, self.num_slots + 1))
        self._free_set = set(self._free)

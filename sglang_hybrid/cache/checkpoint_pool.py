"""StateCheckpointPool: recurrent-state checkpoint slots, separate from the live requests' pool.

SGLang keeps the states of running requests in a ``MambaPool`` (conv states and the
temporal SSM / delta-rule state of every recurrent layer, one slot per request). A cached
checkpoint must never take one of those slots, or cache pressure starves admission; so the
checkpoints live here, in the same per-slot shapes and dtypes, with their own budget.

The pool speaks the interface SGLang 0.5.23 already defines for a radix-owned checkpoint
store (``MambaCheckpointPool``, ``req_to_token_pool.mamba_ckpt_pool``): ``alloc`` / ``free``
/ ``available_size`` / ``clear`` plus ``store_from_active`` (snapshot) and
``load_to_active`` (restore). Installing it there lets SGLang's own scheduler paths do the
two-pool accounting (``pool_stats_observer``, ``invariant_checker``) and run the restore on
the forward stream (``ModelRunner`` calls ``load_to_active`` for deferred copy-on-write).
Unlike the int8 store it keeps full precision, so a restored state is bit-identical.

Slot 0 is reserved, as in SGLang's ``MambaSlotAllocator``; slots handed out are 1..num_slots.
Recency (LRU) and lock counts for checkpoints live on the radix-tree nodes that own the
slots (SGLang's MAMBA LRU list and ``lock_ref``), not here: one place decides eviction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_hybrid.cache.host_tier import HostCheckpointTier
from sglang_hybrid.cache.slots import SlotFreeList
from sglang_hybrid.kernels import INTERPRET as KERNELS_INTERPRETED
from sglang_hybrid.kernels import copy_states, slot_major_pool
from sglang_hybrid.kernels.reference import copy_states_reference


@dataclass(frozen=True)
class StateLayout:
    """Per-slot layout of one recurrent state: every recurrent layer's conv and temporal state."""

    num_layers: int
    conv_shapes: tuple[tuple[int, ...], ...]
    conv_dtypes: tuple[torch.dtype, ...]
    temporal_shape: tuple[int, ...]
    temporal_dtype: torch.dtype

    @classmethod
    def of_mamba_pool(cls, mamba_pool) -> "StateLayout":
        cache = mamba_pool.mamba_cache
        return cls(
            num_layers=cache.temporal.shape[0],
            conv_shapes=tuple(tuple(c.shape[2:]) for c in cache.conv),
            conv_dtypes=tuple(c.dtype for c in cache.conv),
            temporal_shape=tuple(cache.temporal.shape[2:]),
            temporal_dtype=cache.temporal.dtype,
        )

    def allocate(self, rows: int, device):
        """Zeroed (conv list, temporal) tensors of ``rows`` slots, laid out as SGLang's
        ``MambaPool``: one contiguous ``(rows, *shape)`` block per layer, so a layer's slots
        are what SGLang's kernels read and write (the GDN scan writes checkpoints into them)."""
        conv = [
            torch.zeros((self.num_layers, rows, *shape), dtype=dtype, device=device)
            for shape, dtype in zip(self.conv_shapes, self.conv_dtypes)
        ]
        temporal = torch.zeros((self.num_layers, rows, *self.temporal_shape), dtype=self.temporal_dtype, device=device)
        return conv, temporal

    def allocate_slot_major(self, rows: int, device, *, pin_memory: bool = False, zeroed: bool = True):
        """``(storage, conv list, temporal)`` of ``rows`` slots, each slot one contiguous run of
        ``slot_major_bytes`` (``slot_major_pool``): what moves between memories in one copy."""
        return slot_major_pool(self.num_layers, self._tensor_specs(), rows, device, pin_memory, zeroed)

    def _tensor_specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [*zip(self.conv_shapes, self.conv_dtypes), (self.temporal_shape, self.temporal_dtype)]

    @property
    def bytes_per_slot(self) -> int:
        conv = sum(
            self.num_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in zip(self.conv_shapes, self.conv_dtypes)
        )
        temporal = (
            self.num_layers
            * math.prod(self.temporal_shape)
            * torch.empty((), dtype=self.temporal_dtype).element_size()
        )
        return conv + temporal


class StateCheckpointPool:
    def __init__(
        self,
        layout: StateLayout,
        num_slots: int,
        device: str | torch.device,
        host_slots: int = 0,
    ):
        if num_slots < 0:
            raise ValueError(f"checkpoint slots must be >= 0, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        # Row 0 is the reserved dummy slot.
        self.conv, self.temporal = layout.allocate(num_slots + 1, self.device)
        self.slots = SlotFreeList(num_slots, self.device)
        # Where device evictions go instead of being dropped; None keeps one tier.
        self.host_tier = HostCheckpointTier(layout, host_slots, self) if host_slots else None

    @staticmethod
    def slots_for_memory(mamba_pool, memory_bytes: int) -> int:
        """How many checkpoint slots fit in ``memory_bytes`` (the reserved row included)."""
        per_slot = StateLayout.of_mamba_pool(mamba_pool).bytes_per_slot
        return max(0, memory_bytes // per_slot - 1)

    # ---- slot lifecycle ----

    def alloc(self, n: int = 1) -> Optional[torch.Tensor]:
        return self.slots.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self.slots.free(slots)

    def available_size(self) -> int:
        return self.slots.available_size()

    def used_size(self) -> int:
        return self.num_slots - self.available_size()

    def free_slot_ids(self) -> Sequence[int]:
        return self.slots.free_slot_ids()

    def is_allocated(self, slots: torch.Tensor) -> bool:
        """Whether every one of ``slots`` is a slot of this pool that ``alloc`` handed out."""
        return self.slots.is_allocated(slots)

    def clear(self) -> None:
        self.slots.clear()
        if self.host_tier is not None:
            self.host_tier.clear()

    def mem_usage_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.conv) + (
            self.temporal.numel() * self.temporal.element_size()
        )

    # ---- state transfer with the live requests' MambaPool ----

    def store_from_active(
        self, active_mamba_pool, active_slots: torch.Tensor, ckpt_slots: torch.Tensor
    ) -> None:
        """Snapshot: copy live states into checkpoint slots (all layers, conv + temporal)."""
        cache = active_mamba_pool.mamba_cache
        self.copy_slots(
            cache.conv, cache.temporal, self.conv, self.temporal,
            active_slots.view(-1), ckpt_slots.view(-1),
        )

    def load_to_active(
        self, active_mamba_pool, ckpt_slots: torch.Tensor, active_slots: torch.Tensor
    ) -> None:
        """Restore: copy checkpoints into live slots; the checkpoints themselves are only read."""
        cache = active_mamba_pool.mamba_cache
        self.copy_slots(
            self.conv, self.temporal, cache.conv, cache.temporal,
            ckpt_slots.view(-1), active_slots.view(-1),
        )

    def copy_slots(self, src_conv, src_temporal, dst_conv, dst_temporal, src_slots, dst_slots):
        """Copy slots between two pools of this layout (any layer and slot strides)."""
        # The Triton kernel needs a GPU, or kernels decorated under the interpreter on CPU
        # (tests, the reference engine); a CPU process without them takes the torch
        # reference, which the kernel tests hold bit-identical to the kernel.
        if self.device.type == "cpu" and not KERNELS_INTERPRETED:
            copy_states_reference(
                src_conv, src_temporal, dst_conv, dst_temporal, src_slots, dst_slots
            )
        else:
            copy_states(
                src_conv, src_temporal, dst_conv, dst_temporal, src_slots, dst_slots,
                check_slots=False,
            )

"""SlotFreeList hands out and takes back slots as SGLang's MambaSlotAllocator does, without
its tensor free list."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

from sglang_hybrid.cache.slots import SlotFreeList

# An operation: allocate n slots, or free the held slots at these positions (as a tensor, or
# by their indices).
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 4)),
    st.tuples(st.sampled_from(["free", "free_ids"]), st.lists(st.integers(0, 40), max_size=4, unique=True)),
), max_size=60)


@settings(max_examples=200, deadline=None)
@given(num_slots=st.integers(0, 12), operations=OPERATIONS)
def test_slots_come_and_go_in_the_order_of_sglangs_allocator(num_slots, operations):
    ours, sglang = SlotFreeList(num_slots, "cpu"), MambaSlotAllocator(num_slots, "cpu")
    held: list[int] = []
    for operation, argument in operations:
        if operation == "alloc":
            got, expected = ours.alloc(argument), sglang.alloc(argument)
            assert (got is None) == (expected is None)
            if got is not None:
                assert got.tolist() == expected.tolist() and got.dtype == torch.int64
                held += got.tolist()
        else:
            freed = [held[i] for i in argument if i < len(held)]
            held = [slot for slot in held if slot not in freed]
            if operation == "free":
                ours.free(torch.tensor(freed, dtype=torch.int64))
            else:
                ours.free_ids(freed)
            sglang.free(torch.tensor(freed, dtype=torch.int64))
        assert ours.free_slot_ids() == sglang.free_slots.tolist()
        assert ours.available_size() == sglang.available_size()
        assert ours.is_allocated(torch.tensor(held, dtype=torch.int64))
        assert not any(ours.is_allocated(torch.tensor([slot])) for slot in ours.free_slot_ids())
    assert not ours.is_allocated(torch.tensor([0])) and not ours.is_allocated(torch.tensor([num_slots + 1]))
    ours.clear()
    assert ours.free_slot_ids() == list(range(1, num_slots + 1))


def test_a_slot_is_handed_out_as_the_same_view_each_time():
    """One tensor per slot, made once: handing a slot out creates none."""
    slots = SlotFreeList(2, "cpu")
    first = slots.alloc()
    slots.free_ids([int(first)])
    slots.alloc()
    assert slots.alloc() is first

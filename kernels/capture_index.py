"""Where each anchor state of one extend (prefill) batch goes, indexed once per forward.

A forward computes tokens of several sequences, packed one after another. A *capture* asks
for the state of sequence ``seq`` after ``pos`` of its tokens in this batch (``pos = 0``:
the state it entered with) to be written into checkpoint slot ``slot``. Every recurrent layer
of the forward captures the same positions, so the index arithmetic is done once, on the
host, from lengths the scheduler already holds there, and reaches the device as one packed
int32 tensor: the layers then capture with no further host work and no synchronisation.

Two consumers read it. The conv capture (``conv_capture_states``) gathers each capture's
window of pre-conv inputs. The recurrent state is written by SGLang's chunked GDN scan
itself (patches/0002, ``snapshot_*``): it walks the batch in 64-token chunks numbered per
sequence, and chunk ``c`` writes the captures ``snapshot_chunk_ptr[c]`` to
``snapshot_chunk_ptr[c + 1]`` of the chunk-ordered list, each the state after
``snapshot_offsets[i]`` of the chunk's tokens, into row ``snapshot_rows[i]``; it unrolls
``snapshots_per_chunk`` of them per chunk, a bound known here, on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

GDN_CHUNK_SIZE = 64
# Captures of one request planned closer than this to each other (AnchorPlanning drops the
# deeper one) would save fewer recomputed tokens than this; the spacing also bounds the
# captures in one chunk to GDN_CHUNK_SIZE / MIN_CAPTURE_SPACING + 1, the scan's unroll.
MIN_CAPTURE_SPACING = 16

_PER_CAPTURE = ("seq", "seq_start", "end", "slot", "continues", "snapshot_offsets", "snapshot_rows")


@dataclass(frozen=True)
class CaptureIndex:
    """Int32 device tensors, views of one packed buffer. Per capture ``q``:

    * ``seq[q]``, ``slot[q]``: the request (as above);
    * ``seq_start[q]``: packed index of the sequence's first token in the batch, and
      ``end[q] = seq_start[q] + pos``: the capture holds the state after the packed tokens
      before ``end[q]``;
    * ``continues[q]``: 1 if the sequence entered with a state (a restored or chunked
      prefix), 0 if it starts from zeros.

    In chunk order, for the scan: ``snapshot_chunk_ptr`` ``(num_chunks + 1,)``,
    ``snapshot_offsets`` (1 to 64, or 0 for the state a sequence entered with) and
    ``snapshot_rows`` (the slots); ``snapshots_per_chunk`` is the most captures any chunk
    holds, rounded up to a power of two (fewer compiled variants of the scan).
    """

    seq: torch.Tensor
    seq_start: torch.Tensor
    end: torch.Tensor
    slot: torch.Tensor
    continues: torch.Tensor
    snapshot_offsets: torch.Tensor
    snapshot_rows: torch.Tensor
    snapshot_chunk_ptr: torch.Tensor
    snapshots_per_chunk: int

    def __len__(self) -> int:
        return int(self.seq.shape[0])

    @classmethod
    def build(
        cls,
        extend_lens: Sequence[int],
        continues: Sequence[bool],
        seq: Sequence[int],
        pos: Sequence[int],
        slots: Sequence[int],
        device: torch.device | str,
        chunk_size: int = GDN_CHUNK_SIZE,
    ) -> "CaptureIndex":
        """Index the captures ``(seq[q], pos[q]) -> slots[q]`` of a batch whose sequences
        compute ``extend_lens[i]`` tokens, ``continues[i]`` telling whether sequence ``i``
        entered with a state. Raises ``ValueError`` / ``IndexError`` on inconsistent input."""
        lens = np.asarray(extend_lens, dtype=np.int64)
        seq_a = np.asarray(seq, dtype=np.int64)
        pos_a = np.asarray(pos, dtype=np.int64)
        slot_a = np.asarray(slots, dtype=np.int64)
        if len(continues) != lens.size:
            raise ValueError(f"{len(continues)} 'continues' flags for {lens.size} sequences")
        if not seq_a.size == pos_a.size == slot_a.size:
            raise ValueError(f"seq, pos and slots differ in length: {seq_a.size}, {pos_a.size}, {slot_a.size}")
        if (lens < 0).any():
            raise ValueError(f"negative extend lengths: {lens.tolist()}")
        if seq_a.size and (seq_a.min() < 0 or seq_a.max() >= lens.size):
            raise IndexError(f"capture sequences must lie in [0, {lens.size}), got {seq_a.tolist()}")
        if seq_a.size and (lens[seq_a] == 0).any():
            raise ValueError("a capture names a sequence with no tokens in this batch")
        if seq_a.size and ((pos_a < 0) | (pos_a > lens[seq_a])).any():
            raise IndexError("capture positions must lie in [0, tokens of their sequence in the batch]")
        if slot_a.size and slot_a.min() < 0:
            raise IndexError(f"checkpoint slots must be non-negative, got {slot_a.tolist()}")
        if np.unique(slot_a).size != slot_a.size:
            raise ValueError("two captures name the same checkpoint slot")

        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        chunks = (lens + chunk_size - 1) // chunk_size
        first_chunk = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(np.int64)
        # pos == len on a chunk boundary is the end of the last chunk, not a chunk of its own.
        local_chunk = np.minimum(pos_a // chunk_size, chunks[seq_a] - 1)
        global_chunk = first_chunk[seq_a] + local_chunk
        order = np.argsort(global_chunk, kind="stable")
        chunk_ptr = np.searchsorted(global_chunk[order], np.arange(int(chunks.sum()) + 1))

        per_capture = np.stack([
            seq_a,
            starts[seq_a],
            starts[seq_a] + pos_a,
            slot_a,
            np.asarray(continues, dtype=np.int64)[seq_a],
            (pos_a - local_chunk * chunk_size)[order],
            slot_a[order],
        ]) if seq_a.size else np.zeros((len(_PER_CAPTURE), 0), dtype=np.int64)
        packed = np.concatenate([per_capture.reshape(-1), chunk_ptr]).astype(np.int32)
        buffer = torch.from_numpy(packed)
        device = torch.device(device)
        if device.type == "cuda":
            buffer = buffer.pin_memory().to(device, non_blocking=True)
        else:
            buffer = buffer.to(device)
        num = seq_a.size
        fields = {name: buffer[i * num:(i + 1) * num] for i, name in enumerate(_PER_CAPTURE)}
        most_in_a_chunk = int(np.diff(chunk_ptr).max(initial=1))
        return cls(
            **fields,
            snapshot_chunk_ptr=buffer[len(_PER_CAPTURE) * num:],
            snapshots_per_chunk=1 << (most_in_a_chunk - 1).bit_length(),
        )

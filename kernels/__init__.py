"""Triton kernels of sglang-hybrid; their plain-torch references are in ``reference``.

No sglang import here: the kernels run on machines that only have torch and triton.
"""

from ._launch import INTERPRET
from .capture_index import GDN_CHUNK_SIZE, MIN_CAPTURE_SPACING, CaptureIndex
from .conv_capture import conv_capture_states
from .mamba2_capture import NEMOTRON_H_CHUNK_SIZE, mamba2_capture_states
from .state_copy import MAX_CONV_TENSORS, copy_states, slot_major_bytes, slot_major_pool

__all__ = [
    "GDN_CHUNK_SIZE",
    "INTERPRET",
    "MAX_CONV_TENSORS",
    "MIN_CAPTURE_SPACING",
    "NEMOTRON_H_CHUNK_SIZE",
    "CaptureIndex",
    "conv_capture_states",
    "copy_states",
    "mamba2_capture_states",
    "slot_major_bytes",
    "slot_major_pool",
]

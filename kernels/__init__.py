"""Triton kernels of sglang-hybrid, each beside its plain-torch reference.

No sglang import here: the kernels run on machines that only have torch and triton.
"""

from ._launch import INTERPRET
from .state_at_position import (
    GDN_CHUNK_SIZE,
    NEMOTRON_H_CHUNK_SIZE,
    conv_state_at_positions,
    conv_state_at_positions_reference,
    gdn_state_at_positions,
    gdn_state_at_positions_reference,
    mamba2_state_at_positions,
    mamba2_state_at_positions_reference,
)
from .state_copy import MAX_CONV_TENSORS, copy_states, copy_states_reference

__all__ = [
    "GDN_CHUNK_SIZE",
    "INTERPRET",
    "MAX_CONV_TENSORS",
    "NEMOTRON_H_CHUNK_SIZE",
    "conv_state_at_positions",
    "conv_state_at_positions_reference",
    "copy_states",
    "copy_states_reference",
    "gdn_state_at_positions",
    "gdn_state_at_positions_reference",
    "mamba2_state_at_positions",
    "mamba2_state_at_positions_reference",
]

"""Launch helpers shared by the kernels of this package."""

import contextlib
import os

import torch

# Under the CPU interpreter programs run one after another, so kernels pick few, large
# programs there; compiled kernels pick GPU-sized tiles.  Nothing else differs.  Triton fixes
# the mode when a kernel is decorated (at import), so this is read once, here, and callers
# choosing whether a kernel can run on CPU must ask this flag, not the environment now.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def on_device(device: torch.device):
    """Launch on the tensors' GPU rather than the current one (multi-GPU processes)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def drop_unit_batch(t: torch.Tensor, dims: int, name: str) -> torch.Tensor:
    """Accept ``(1, *shape)`` (the fla / SSD calling convention) as well as ``shape``."""
    if t.dim() == dims + 1 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions (or a leading 1), got {tuple(t.shape)}")
    return t

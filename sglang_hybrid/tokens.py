"""Helpers on token-id arrays shared by the planning and the replay's policies."""

from __future__ import annotations

import numpy as np


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    # The first difference alone: after an early edit every later token differs, and listing
    # them all costs a buffer the size of the prompt.
    differs = a[:n] != b[:n]
    first = int(differs.argmax())
    return first if differs[first] else n

"""Input validation shared by the pools, the tree and the facade.

Every public entry point converts its array arguments here first, so bad
input raises a ``TypeError``/``ValueError`` naming the argument before any
structure is touched.
"""

from __future__ import annotations

import numpy as np

__all__ = ["as_int_array", "as_token_array", "check_int"]

_INT32_MAX = np.iinfo(np.int32).max


def as_int_array(values: object, name: str, min_value: int = -1) -> np.ndarray:
    """``values`` (numpy, torch, list, tuple, range) as a 1-D int32 numpy array in
    ``[min_value, 2**31)``."""
    if isinstance(values, np.ndarray):
        arr = values
    elif hasattr(values, "cpu") and hasattr(values, "numpy"):  # a torch tensor
        arr = values.cpu().numpy()
    elif isinstance(values, (list, tuple, range)):
        arr = np.asarray(values)
        if arr.size == 0:
            arr = arr.astype(np.int32)
    else:
        raise TypeError(f"{name} must be a 1-D integer array, got {type(values).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size:
        # np.issubdtype is slow: ask it only about dtypes that are not plain ints
        if arr.dtype.kind not in "iu" and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        lo = arr.min()
        if lo < min_value:
            kind = "non-negative ids" if min_value == 0 else f"ids >= {min_value}"
            raise ValueError(f"{name} must hold {kind}, got {int(lo)}")
        if arr.dtype != np.int32:
            if arr.max() > _INT32_MAX:  # int32 cannot exceed it
                raise ValueError(f"{name} holds ids >= 2**31")
        elif arr.flags.c_contiguous:
            return arr  # already what the caller needs (ascontiguousarray would return it too)
    return np.ascontiguousarray(arr, dtype=np.int32)


def as_token_array(tokens: object, name: str = "tokens") -> np.ndarray:
    """``tokens`` as 1-D int32 numpy; token ids must be in ``[0, 2**31)``."""
    return as_int_array(tokens, name, min_value=0)


def check_int(value: object, name: str, minimum: int | None = None) -> int:
    """``value`` as a Python int: an int or numpy integer, not a bool (``True`` is an
    int to Python, never a page count).  ``minimum``: the smallest value allowed.
    Raises ``TypeError``/``ValueError`` naming ``name``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)

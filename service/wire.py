"""How NumPy arrays cross the socket between front-end processes and the engine process.

NumPy's own pickling of an array goes through a Python-level reconstructor and
costs 8-16 µs per message on the 2-core VM; a dtype string, the shape and the raw
buffer (``pickle.PickleBuffer``, protocol 5) cost 3-6 µs, and the engine process
pays that for every request in and every answer out.

While a front-end pickles a frame inside :func:`placing`, large arrays go into its shared-memory
arena instead and only their place is pickled (:mod:`service.dataplane.arena`).
"""
from __future__ import annotations

import pickle
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np


def _array(dtype: str, shape: tuple, raw: Any) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)


_placing: Any = None  # the arena placement of the frame being pickled (front-end processes), or None


@contextmanager
def placing(placement: Any) -> Iterator[Any]:
    """Pickle arrays through ``placement.place(array)`` (a reconstructor, or None for the socket) meanwhile."""
    global _placing
    _placing = placement
    try:
        yield placement
    finally:
        _placing = None


class WireArray:
    """Pickles as its array's dtype, shape and bytes; unpickles as the plain NumPy array."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple:
        a = np.asarray(self.array)
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        if _placing is not None:
            placed = _placing.place(a)
            if placed is not None:
                return placed
        return (_array, (a.dtype.str, a.shape, pickle.PickleBuffer(a)))


def wire(array: np.ndarray | None) -> WireArray | None:
    """``array`` wrapped for pickling (None stays None)."""
    return None if array is None else WireArray(array)

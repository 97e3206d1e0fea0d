"""Copying request rows into a batch without letting go of the GIL.

NumPy releases the GIL for any copy of more than a few hundred elements. In the
engine process the batch worker thread shares the GIL with a busy event loop, and
every release costs the worker a wait of up to Python's switch interval to get it
back: on an H200 host, merging 22 ragged requests took 0.14 ms alone and 0.83 ms
next to a busy event loop (bench/batch_path.py, 2026-11-21). A row of a request is
a few kilobytes, which ``memmove`` copies in well under a microsecond; calling it
through a ``PYFUNCTYPE`` prototype keeps the GIL for the call (ctypes releases it
only for ``CFUNCTYPE`` calls), so a merge is one uninterrupted stretch of work.
On this 2-core VM, next to a thread spinning in Python: 3 µs per row copy this way,
25 µs through a NumPy slice assignment.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

ROWS_PER_CALL = 4
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)


def copy_sequences(dst: np.ndarray, row: int, src: np.ndarray, steps: int) -> None:
    """``dst[row:row+B, :steps] = src[:, :steps]`` with the GIL held throughout.

    ``dst`` [N, T, F] and ``src`` [B, Ts, F] must be C-contiguous and of one dtype, with
    ``steps <= min(T, Ts)``; anything else takes NumPy's assignment.
    """
    b = src.shape[0]
    if (src.dtype != dst.dtype or not src.flags.c_contiguous or not dst.flags.c_contiguous
            or src.shape[2] != dst.shape[2] or steps > src.shape[1] or steps > dst.shape[1]):
        dst[row:row + b, :steps] = src[:, :steps]
        return
    item = dst.itemsize * dst.shape[2]
    dst_stride, src_stride = dst.shape[1] * item, src.shape[1] * item
    nbytes = steps * item
    dst_ptr = dst.ctypes.data + row * dst_stride
    src_ptr = src.ctypes.data
    if nbytes == dst_stride == src_stride:  # whole rows on both sides: one copy
        _memmove_holding_gil(dst_ptr, src_ptr, b * nbytes)
        return
    if b > ROWS_PER_CALL and threading.current_thread() is threading.main_thread():
        # many rows (a front-end's merged message) on the event loop's own thread, which a GIL release does
        # not make wait (a batch launched from the loop, a front-end's lane): one NumPy call loops over them
        # in C, where a call per row cost a Python iteration and a ctypes call each (a tenth of the engine
        # process's thread under binary-HTTP load, H100 host)
        dst[row:row + b, :steps] = src[:, :steps]
        return
    for i in range(b):
        _memmove_holding_gil(dst_ptr + i * dst_stride, src_ptr + i * src_stride, nbytes)

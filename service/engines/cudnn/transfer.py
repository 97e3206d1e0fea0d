"""Moving arrays between host and device, and between the caller's dtypes and the engine's.

Host inputs go through pinned blocks (:mod:`.pinned`): a merged batch is built in one by
the scheduler (``CudnnEngine.input_buffer``), small inputs are packed back to back into
one so that one host-to-device copy moves them together; large contiguous pageable
inputs are copied directly (see HostStaging.upload). Host outputs are copied into pinned memory from CuPy's pinned
pool and handed to the caller as NumPy arrays over that memory: one copy, no
second pass on the host.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..base import EngineOutput, Launched
from .copies import gather_rows, seq_major
from .host_rows import HostRows

_ALIGN = 256
DIRECT_BYTES = 1 << 20
_H2D, _D2H = 1, 2


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Converter:
    """Device-side dtype conversions between float arrays and the engine's storage dtype."""

    def __init__(self, cp, precision: str) -> None:
        self.cp = cp
        self.precision = precision
        self.store = np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[precision])
        self._to_bf16 = self._from_bf16 = None
        if precision == "bfloat16":
            self._to_bf16 = cp.ElementwiseKernel(
                "float32 x", "uint16 y",
                """
                unsigned int u = __float_as_uint(x);
                if ((u & 0x7fffffffu) > 0x7f800000u) { y = (unsigned short)((u >> 16) | 0x40u); }
                else { y = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
                """,
                "rnnserve_f32_to_bf16")
            self._from_bf16 = cp.ElementwiseKernel(
                "uint16 x", "float32 y", "y = __uint_as_float(((unsigned int)x) << 16);", "rnnserve_bf16_to_f32")

    def to_store(self, a):
        """A C-contiguous device array in the storage dtype (``a`` itself when it already is one)."""
        cp = self.cp
        if self._to_bf16 is not None:
            if a.dtype != np.float32:
                a = a.astype(np.float32)
            return self._to_bf16(cp.ascontiguousarray(a))
        if a.dtype == self.store and a.flags.c_contiguous:
            return a
        return cp.ascontiguousarray(a, dtype=self.store)

    def from_store(self, a, dtype):
        """``a`` (storage dtype) as ``dtype`` (float32 or float16) on the device."""
        if self._from_bf16 is not None:
            return self._from_bf16(a)
        return a if a.dtype == dtype else a.astype(dtype)

    def staging_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype a host array is staged in: the storage dtype, or float32 for bfloat16."""
        return np.dtype(np.float32) if self._to_bf16 is not None else self.store


class HostStaging:
    """Host-to-device copies of one engine through pinned blocks (see :mod:`.pinned`)."""

    def __init__(self, cp) -> None:
        from .pinned import PinnedBlocks

        self.cp = cp
        self.blocks = PinnedBlocks(cp.cuda.alloc_pinned_memory,
                                   lambda: cp.cuda.Event(block=False, disable_timing=True))

    def lend(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized pinned host array that :meth:`upload` copies to the device without a host copy."""
        return self.blocks.array(shape, dtype)

    def upload(self, arrays: list[tuple[np.ndarray, np.dtype]], stream) -> list:
        """Copy each (array, dtype) to the device as a C-contiguous array of that dtype.

        An array from :meth:`lend` goes straight from its pinned block. Small arrays are packed
        into one pinned block and moved by one DMA. A large array that is already contiguous in
        the right dtype is copied straight from its pageable memory: the driver pipelines that
        copy, which beats a host-side copy into pinned memory first.
        """
        cp = self.cp
        direct = {}
        for i, (arr, dtype) in enumerate(arrays):
            if arr.dtype != dtype or not arr.flags.c_contiguous:
                continue
            blk = self.blocks.owner(arr) if arr.base is not None else None
            if blk is None and arr.nbytes < DIRECT_BYTES:
                continue
            dev = direct[i] = cp.empty(arr.shape, dtype=dtype)
            cp.cuda.runtime.memcpyAsync(dev.data.ptr, arr.ctypes.data, dev.nbytes, _H2D, stream.ptr)
            if blk is not None:
                self.blocks.copied(blk, stream)
        if len(direct) == len(arrays):
            return [direct[i] for i in range(len(arrays))]
        staged = [(i, arr, dtype) for i, (arr, dtype) in enumerate(arrays) if i not in direct]
        views = self._stage([(arr, dtype) for _, arr, dtype in staged], stream)
        out = dict(direct)
        out.update({i: v for (i, _, _), v in zip(staged, views)})
        return [out[i] for i in range(len(arrays))]

    def upload_inputs(self, conv: "Converter", x: Any, h0: Any, c0: Any, lens: np.ndarray, t: int, stream: Any,
                      index: np.ndarray | None = None) -> tuple:
        """x, h0, c0, (for a ragged batch) the int32 lengths and the int32 stream ``index`` on the device, in
        the engine's storage dtype, states sequence-major: (x, h0, c0, lens or None, index or None).

        Host inputs go up in one staged copy, the lengths and index with them (CuPy's asarray of a
        small array cost more host time than the copy of x); device inputs are used in place. For
        :class:`.HostRows`, the row table goes up instead of x, and x is gathered on the device.
        """
        cp = self.cp
        if isinstance(x, cp.ndarray):
            states = [None if s is None else conv.to_store(seq_major(cp, s)) for s in (h0, c0)]
            return conv.to_store(x), states[0], states[1], None, None if index is None else cp.asarray(index)
        ragged = int(lens.min()) < t
        rows = x if isinstance(x, HostRows) else None
        staged = [(x.table, np.dtype(np.int64)) if rows is not None else (x, conv.staging_dtype(x.dtype))]
        for s in (h0, c0):
            if s is not None:
                s = s.get() if hasattr(s, "get") else np.asarray(s)
                staged.append((s.transpose(1, 0, 2), conv.staging_dtype(s.dtype)))
        if ragged:
            staged.append((lens.astype(np.int32), np.dtype(np.int32)))
        if index is not None:
            staged.append((index, np.dtype(np.int32)))
        dev = self.upload(staged, stream)
        index_d = dev.pop() if index is not None else None
        lens_d = dev.pop() if ragged else None
        if rows is not None:
            dev[0] = gather_rows(cp, dev[0], rows.unit, cp.empty(rows.shape, dtype=rows.dtype))
        dev = [conv.to_store(a) for a in dev]
        x_d = dev.pop(0)
        h0_d = dev.pop(0) if h0 is not None else None
        c0_d = dev.pop(0) if c0 is not None else None
        return x_d, h0_d, c0_d, lens_d, index_d

    def _stage(self, arrays: list[tuple[np.ndarray, np.dtype]], stream) -> list:
        cp = self.cp
        offsets, total = [], 0
        for arr, dtype in arrays:
            offsets.append(total)
            total += _round(arr.size * np.dtype(dtype).itemsize)
        total = max(total, _ALIGN)
        blk = self.blocks.block(total)
        view = None
        for (arr, dtype), off in zip(arrays, offsets):
            view = np.frombuffer(blk.mem, dtype=dtype, count=arr.size, offset=off).reshape(arr.shape)
            np.copyto(view, arr, casting="unsafe")
        del view
        dev = cp.empty(total, dtype=cp.uint8)
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, blk.mem.ptr, total, _H2D, stream.ptr)
        self.blocks.copied(blk, stream)
        return [cp.ndarray(arr.shape, dtype=dtype, memptr=dev.data + off) for (arr, dtype), off in zip(arrays, offsets)]


def blocks_with_pitch(a: Any) -> bool:
    """Whether 3-D ``a`` is ``a.shape[0]`` contiguous blocks of ``a[0].size`` elements at a fixed pitch.

    That is a C-contiguous array or a slice of one along axes 0 and 1 (the first rows of a padded
    graph buffer, the first steps of a longer output), which :func:`download_async` copies as one
    2-D copy, pitch to packed, with no device kernel.
    """
    if a.ndim != 3 or a.size == 0:
        return a.ndim == 3
    item = a.itemsize
    return (a.strides[2] == item and a.strides[1] == a.shape[2] * item
            and a.strides[0] >= a.shape[1] * a.strides[1])


def download_async(cp, arrays: list, stream) -> list[np.ndarray]:
    """Queue copies of device arrays (C-contiguous, or 3-D :func:`blocks_with_pitch`) into pinned host
    memory on ``stream``.

    Returns C-contiguous NumPy arrays over that memory; they hold the results once the stream has
    passed the copies (record an event after this call and wait on it).
    """
    out = []
    for a in arrays:
        nbytes = a.nbytes
        mem = cp.cuda.alloc_pinned_memory(max(nbytes, 1))
        host = np.frombuffer(mem, dtype=a.dtype, count=a.size).reshape(a.shape)
        if nbytes and a.flags.c_contiguous:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, a.data.ptr, nbytes, _D2H, stream.ptr)
        elif nbytes:
            if not blocks_with_pitch(a):
                raise ValueError(f"cannot download a {a.shape} array with strides {a.strides} in one copy")
            width = a.shape[1] * a.strides[1]
            cp.cuda.runtime.memcpy2DAsync(host.ctypes.data, width, a.data.ptr, a.strides[0], width, a.shape[0],
                                          _D2H, stream.ptr)
        out.append(host)
    return out


def download_results(cp, conv, stream, blocking_sync: bool, y, hy, cy, out_dtype, last_only: bool) -> Launched:
    """Queue the copies of a call's results to pinned host memory; the Launched waits for them.

    ``y`` [B, T, F] (or, ``last_only``, the [B, F] many-to-one result, handed back as ``last``) and
    the final states ``hy``/``cy`` [rows, B, W] (or None) are in the engine's storage dtype;
    the host arrays are in ``out_dtype``, states batch-first.
    """
    y = conv.from_store(y, out_dtype)
    hy = None if hy is None else conv.from_store(hy, out_dtype)
    cy = None if cy is None else conv.from_store(cy, out_dtype)
    # A sequence-major result is a transposed view of a [T, B, F] buffer (or of its first B rows):
    # copy that and hand back the same view of it on the host. Results that are the first rows or
    # steps of a larger buffer (a graph of a bucketed shape) are copied as they lie, pitch to packed:
    # making them contiguous on the device first cost a copy kernel, which CuPy compiled on a shape's
    # first call (NVRTC, 100-150 ms on an H100 host, while every request waited; bench/first_calls.py).
    as_it_lies = y.flags.c_contiguous or blocks_with_pitch(y)
    transposed = not as_it_lies and y.ndim == 3 and blocks_with_pitch(y.transpose(1, 0, 2))
    if not (as_it_lies or transposed):
        y = cp.ascontiguousarray(y)
    arrays = [a for a in (y.transpose(1, 0, 2) if transposed else y, hy, cy) if a is not None]
    host = download_async(cp, arrays, stream)
    done = cp.cuda.Event(block=blocking_sync, disable_timing=True)
    done.record(stream)

    def finish() -> EngineOutput:
        out: Any = host.pop(0)
        if transposed:
            out = out.transpose(1, 0, 2)
        h_n = None if hy is None else np.ascontiguousarray(host.pop(0).transpose(1, 0, 2))
        c_n = None if cy is None else np.ascontiguousarray(host.pop(0).transpose(1, 0, 2))
        return EngineOutput(None, h_n, c_n, last=out) if last_only else EngineOutput(out, h_n, c_n)

    return Launched(done, finish)

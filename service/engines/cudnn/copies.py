"""Device copy kernels of the cuDNN engine: batch-first <-> sequence-major transposes and state gathers.

cuDNN runs fastest on sequence-major data ([T, B, F], what PyTorch feeds it), while the
engine's contract is batch-first ([B, T, F]). CuPy's generic strided copy
(``cp.ascontiguousarray(x.transpose(1, 0, 2))``) moved these arrays at about half the
bandwidth of PyTorch's copy kernel (H200: 130 µs vs 72 µs for a [256, 100, 1024] float16
array), which left the engine 3-6 % behind PyTorch where both run the same cuDNN kernel.
:func:`swap01` copies whole rows with the widest vector the alignment allows.

A batch whose requests lie in device-mapped host memory is gathered from there row by row
(:func:`gather_rows`, see :mod:`.mapped`): the host writes a table of addresses, not the batch.

A many-to-one request wants only each sequence's last output: :func:`last_steps` picks
it on the device (one launch), so a batch downloads [B, F] instead of [B, T, F].

Stateful streams keep their states in slots of a pool (see service.engines.state_pool);
a batch of N chunks reads N slots into the batch's initial states and writes N final
states back: :func:`gather_slots` and :func:`scatter_slots` do each with one kernel per
block (h and c together) over a per-row index of slots, whatever N. (Profiled on an H100
host under 256 paced streams, a zero-fill and a copy per state array, each a CuPy call,
took a fifth of the engine process's time.)

The kernels copy bytes (as 16-, 8-, 4- or 2-byte units), so one compiled kernel serves
every dtype; they are compiled once per process (:func:`warm`).
"""
from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

_SOURCE = r"""
template<typename T>
__device__ __forceinline__ void swap01(const T* __restrict__ src, T* __restrict__ dst,
                                       long long a, long long b, long long r) {
    // src [a, b, r] -> dst [b, a, r], r units per row
    const long long total = a * b * r;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long col = i % r;
        const long long row = i / r;
        const long long ia = row / b, ib = row % b;
        dst[(ib * a + ia) * r + col] = src[i];
    }
}

template<typename T>
__device__ __forceinline__ void slots(T* __restrict__ pool_h, T* __restrict__ rows_h, long long r_h,
                                      T* __restrict__ pool_c, T* __restrict__ rows_c, long long r_c,
                                      const int* __restrict__ idx, long long layers, long long slots_n,
                                      long long n, int scatter, int keep) {
    // pool [layers, slots_n, r], rows [layers, n, r] for h and (r_c > 0) c; idx[b] is row b's slot or -1.
    // gather: rows[:, b] = pool[:, idx[b]], or zeros where idx[b] < 0 (left as it is with keep: bit 0 h, bit 1 c);
    // scatter: pool[:, idx[b]] = rows[:, b] where idx[b] >= 0
    const long long total_h = layers * n * r_h, total = total_h + layers * n * r_c;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const bool is_h = i < total_h;
        const long long k = is_h ? i : i - total_h, r = is_h ? r_h : r_c;
        const long long col = k % r, t = k / r;
        const long long b = t % n, layer = t / n;
        const int s = idx[b];
        const long long row = (layer * n + b) * r + col;
        if (scatter) {
            if (s >= 0) (is_h ? pool_h : pool_c)[(layer * slots_n + s) * r + col] = (is_h ? rows_h : rows_c)[row];
        } else if (s >= 0) {
            (is_h ? rows_h : rows_c)[row] = (is_h ? pool_h : pool_c)[(layer * slots_n + s) * r + col];
        } else if (!(keep & (is_h ? 1 : 2))) {
            T zero = {};
            (is_h ? rows_h : rows_c)[row] = zero;
        }
    }
}

template<typename T>
__device__ __forceinline__ void last_steps(const T* __restrict__ y, const int* __restrict__ lens, T* __restrict__ out,
                                           long long n, long long f, long long fwd, long long step_stride,
                                           long long row_stride) {
    // out [n, f]: columns below fwd from each sequence's last step (lens[s] - 1), the rest from step 0;
    // y is [n, t, f] or a transposed [t, n, f] buffer, read through its element strides
    const long long total = n * f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long col = i % f, s = i / f;
        const long long step = col < fwd ? (long long)lens[s] - 1 : 0;
        out[i] = y[step * step_stride + s * row_stride + col];
    }
}

template<typename T>
__device__ __forceinline__ void gather_rows(const long long* __restrict__ src, const long long* __restrict__ valid,
                                            T* __restrict__ dst, long long n, long long r) {
    // dst [n, r] units: row b's first valid[b] bytes from address src[b] (device-mapped host memory), zeros after
    const long long total = n * r;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long b = i / r, col = i % r;
        T v = {};
        if (col < valid[b] / (long long)sizeof(T)) v = reinterpret_cast<const T*>(src[b])[col];
        dst[i] = v;
    }
}

extern "C" __global__ void rnnserve_last_4(const unsigned int* y, const int* lens, unsigned int* o, long long n,
    long long f, long long fwd, long long ss, long long rs) { last_steps<unsigned int>(y, lens, o, n, f, fwd, ss, rs); }
extern "C" __global__ void rnnserve_last_2(const unsigned short* y, const int* lens, unsigned short* o, long long n,
    long long f, long long fwd, long long ss, long long rs) { last_steps<unsigned short>(y, lens, o, n, f, fwd, ss, rs); }

#define RNNSERVE_VARIANTS(W, T) \
extern "C" __global__ void rnnserve_swap01_##W(const T* s, T* d, long long a, long long b, long long r) \
    { swap01<T>(s, d, a, b, r); } \
extern "C" __global__ void rnnserve_slots_##W(T* ph, T* rh, long long r_h, T* pc, T* rc, \
    long long r_c, const int* idx, long long l, long long sn, long long n, int scatter, int keep) \
    { slots<T>(ph, rh, r_h, pc, rc, r_c, idx, l, sn, n, scatter, keep); } \
extern "C" __global__ void rnnserve_rows_##W(const long long* s, const long long* v, T* d, long long n, \
    long long r) { gather_rows<T>(s, v, d, n, r); }

RNNSERVE_VARIANTS(16, uint4)
RNNSERVE_VARIANTS(8, uint2)
RNNSERVE_VARIANTS(4, unsigned int)
RNNSERVE_VARIANTS(2, unsigned short)
RNNSERVE_VARIANTS(1, unsigned char)
"""

_WIDTHS = (16, 8, 4, 2, 1)
_THREADS = 256
_MAX_BLOCKS = 65535
_module_lock = threading.Lock()
_modules: dict[int, Any] = {}


def _kernels(cp: Any) -> dict[str, Any]:
    """Compiled kernels for the current device (NVRTC once per device and process)."""
    dev = cp.cuda.runtime.getDevice()
    mod = _modules.get(dev)
    if mod is not None:
        return mod
    with _module_lock:
        mod = _modules.get(dev)
        if mod is None:
            raw = cp.RawModule(code=_SOURCE, options=("-std=c++14",))
            mod = {f"{kind}_{w}": raw.get_function(f"rnnserve_{kind}_{w}")
                   for kind in ("swap01", "slots", "rows") for w in _WIDTHS}
            mod.update({f"last_{w}": raw.get_function(f"rnnserve_last_{w}") for w in (4, 2)})
            _modules[dev] = mod
    return mod


def warm(cp: Any) -> None:
    """Compile the kernels now (at engine load) rather than on the first request."""
    _kernels(cp)


def _width(row_bytes: int, *ptrs: int) -> int:
    """The widest copy unit that divides the row and every pointer's alignment."""
    for w in _WIDTHS:
        if row_bytes % w == 0 and all(p % w == 0 for p in ptrs):
            return w
    return 1


def _grid(total: int) -> int:
    return max(1, min(_MAX_BLOCKS, (total + _THREADS - 1) // _THREADS))


def swap01(cp: Any, a: Any, out: Any = None) -> Any:
    """``a`` [A, B, ...] with its first two axes swapped, C-contiguous, on the current stream.

    A copy, except where A or B is 1 (then a view: the memory order is the same). ``out``: a
    C-contiguous buffer of the swapped shape to write into (always written, also where a view
    would do), for callers that must not allocate (CUDA graph capture).
    """
    if a.ndim < 2:
        raise ValueError(f"swap01 needs at least 2 dimensions, got shape {a.shape}")
    d0, d1 = a.shape[0], a.shape[1]
    shape = (d1, d0) + a.shape[2:]
    if out is not None:
        if out.shape != shape or out.dtype != a.dtype or not out.flags.c_contiguous or not a.flags.c_contiguous:
            raise ValueError(f"swap01 out must be C-contiguous {shape} {a.dtype}, got {out.shape} {out.dtype}")
        if a.size == 0:
            return out
    elif not a.flags.c_contiguous:
        return cp.ascontiguousarray(a.swapaxes(0, 1))
    elif d0 == 1 or d1 == 1 or a.size == 0:  # same memory order: a view
        return a.reshape(shape)
    else:
        out = cp.empty(shape, a.dtype)
    row_bytes = a.itemsize * int(np.prod(a.shape[2:], dtype=np.int64))
    w = _width(row_bytes, a.data.ptr, out.data.ptr)
    r = row_bytes // w
    total = d0 * d1 * r
    _kernels(cp)[f"swap01_{w}"]((_grid(total),), (_THREADS,),
                                (a, out, np.int64(d0), np.int64(d1), np.int64(r)))
    return out


def gather_slots(cp: Any, pool: tuple[Any, Any], rows: tuple[Any, Any], index: Any, offset: int, n: int,
                 keep: tuple[bool, bool] = (False, False)) -> None:
    """Row ``b`` of ``rows`` (h, and c or None) [L, n, W] from slot ``index[offset + b]`` of ``pool`` [L, slots, W].

    Rows whose index is negative get zeros, or keep what they hold where ``keep`` says so (h, c).
    ``index``: an int32 device array; one kernel for h and c.
    """
    _slots(cp, pool, rows, index, offset, n, False, keep)


def scatter_slots(cp: Any, rows: tuple[Any, Any], pool: tuple[Any, Any], index: Any, offset: int, n: int) -> None:
    """Slot ``index[offset + b]`` of ``pool`` from row ``b`` of ``rows``, for each row with an index >= 0."""
    _slots(cp, pool, rows, index, offset, n, True, (False, False))


def _slots(cp: Any, pool: tuple[Any, Any], rows: tuple[Any, Any], index: Any, offset: int, n: int, scatter: bool,
           keep: tuple[bool, bool]) -> None:
    (pool_h, pool_c), (rows_h, rows_c) = pool, rows
    pairs = [(pool_h, rows_h)] + ([(pool_c, rows_c)] if rows_c is not None else [])
    for p, r in pairs:
        if (p.dtype != r.dtype or p.ndim != 3 or r.shape != (p.shape[0], n, p.shape[2])
                or p.shape[0] != pool_h.shape[0]):
            raise ValueError(f"state slots need pool [L, slots, W] and rows [L, {n}, W] of one dtype, got "
                             f"{p.shape} {p.dtype} and {r.shape} {r.dtype}")
        if not (p.flags.c_contiguous and r.flags.c_contiguous):
            raise ValueError("state slots need C-contiguous arrays")
    layers = int(pool_h.shape[0])
    item = pool_h.itemsize
    w = _width(math.gcd(*(int(p.shape[2]) * item for p, _ in pairs)),
               *(a.data.ptr for pr in pairs for a in pr))
    r_h = int(pool_h.shape[2]) * item // w
    r_c = int(pool_c.shape[2]) * item // w if rows_c is not None else 0
    total = layers * n * (r_h + r_c)
    if total == 0:
        return
    null = np.uint64(0)
    _kernels(cp)[f"slots_{w}"]((_grid(total),), (_THREADS,), (
        pool_h, rows_h, np.int64(r_h), pool_c if rows_c is not None else null,
        rows_c if rows_c is not None else null, np.int64(r_c), index[offset:offset + n] if offset else index,
        np.int64(layers), np.int64(pool_h.shape[1]), np.int64(n), np.int32(scatter),
        np.int32(int(keep[0]) | (2 * int(keep[1])))))


def last_steps(cp: Any, y: Any, lens_dev: Any, forward_cols: int, out: Any = None) -> Any:
    """[n, F] many-to-one outputs of ``y`` [n, t, F] (any strides, unit stride along F).

    Columns below ``forward_cols`` come from step ``lens_dev[s] - 1`` (int32 device array), the
    others from step 0 (a reverse direction ends there). 4- and 2-byte element types. ``out``: a
    C-contiguous [n, F] buffer of y's dtype to write into (for a CUDA graph capture, which must not allocate).
    """
    n, _, f = (int(d) for d in y.shape)
    item = y.itemsize
    if item not in (4, 2) or y.strides[2] != item:
        raise ValueError(f"last_steps needs 4- or 2-byte elements with unit stride, got {y.dtype} {y.strides}")
    if out is None:
        out = cp.empty((n, f), y.dtype)
    elif out.shape != (n, f) or out.dtype != y.dtype or not out.flags.c_contiguous:
        raise ValueError(f"last_steps out must be C-contiguous {(n, f)} {y.dtype}, got {out.shape} {out.dtype}")
    if out.size == 0:
        return out
    total = n * f
    _kernels(cp)[f"last_{item}"]((_grid(total),), (_THREADS,),
                                 (y, lens_dev, out, np.int64(n), np.int64(f), np.int64(forward_cols),
                                  np.int64(y.strides[1] // item), np.int64(y.strides[0] // item)))
    return out


def gather_rows(cp: Any, table: Any, unit: int, out: Any) -> Any:
    """Fill ``out`` (a C-contiguous [N, ...] device array) row by row from host memory the device can read.

    ``table`` is an int64 [2, N] device array: row b's device address (see :mod:`.mapped`) and how many
    bytes of it to copy; the rest of the row is zeroed. ``unit`` (16, 8, 4, 2 or 1 bytes) must divide every
    address, byte count and ``out``'s row. Returns ``out``.
    """
    n = int(out.shape[0])
    if out.size == 0:
        return out
    r = out.nbytes // n // unit
    total = n * r
    ptr = table.data.ptr  # the table's two rows by address: a CuPy slice per row cost more than the launch
    _kernels(cp)[f"rows_{unit}"]((_grid(total),), (_THREADS,),
                                 (np.uint64(ptr), np.uint64(ptr + 8 * n), out, np.int64(n), np.int64(r)))
    return out


def seq_major(cp: Any, a: Any) -> Any:
    """A batch-first state [n, rows, W] (NumPy or CuPy) as a C-contiguous sequence-major [rows, n, W] device array."""
    a = cp.asarray(a)
    view = a.transpose(1, 0, 2)
    return view if view.flags.c_contiguous else swap01(cp, a)

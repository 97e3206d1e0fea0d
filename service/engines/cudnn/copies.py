"""Device copy kernels of the cuDNN engine: batch-first <-> sequence-major transposes and state gathers.

cuDNN runs fastest on sequence-major data ([T, B, F], what PyTorch feeds it), while the
engine's contract is batch-first ([B, T, F]). CuPy's generic strided copy
(``cp.ascontiguousarray(x.transpose(1, 0, 2))``) moved these arrays at about half the
bandwidth of PyTorch's copy kernel (H200: 130 µs vs 72 µs for a [256, 100, 1024] float16
array), which left the engine 3-6 % behind PyTorch where both run the same cuDNN kernel.
:func:`swap01` copies whole rows with the widest vector the alignment allows.

A many-to-one request wants only each sequence's last output: :func:`last_steps` picks
it on the device (one launch), so a batch downloads [B, F] instead of [B, T, F].

Stateful streams keep their states in slots of a pool (see service.engines.state_pool);
a batch of N chunks reads N slots into the batch's initial states and writes N final
states back: :func:`copy_pairs` does each with one kernel over an index array of
(source, destination) pairs, whatever N.

The kernels copy bytes (as 16-, 8-, 4- or 2-byte units), so one compiled kernel serves
every dtype; they are compiled once per process (:func:`warm`).
"""
from __future__ import annotations

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
__device__ __forceinline__ void copy_pairs(const T* __restrict__ src, T* __restrict__ dst,
                                           const int* __restrict__ pairs, long long count, long long layers,
                                           long long n_src, long long n_dst, long long r) {
    // src [layers, n_src, r], dst [layers, n_dst, r]: for each j, dst[:, pairs[2j+1]] = src[:, pairs[2j]]
    const long long total = layers * count * r;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long col = i % r;
        const long long t = i / r;
        const long long j = t % count, layer = t / count;
        dst[(layer * n_dst + pairs[2 * j + 1]) * r + col] = src[(layer * n_src + pairs[2 * j]) * r + col];
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

extern "C" __global__ void rnnserve_last_4(const unsigned int* y, const int* lens, unsigned int* o, long long n,
    long long f, long long fwd, long long ss, long long rs) { last_steps<unsigned int>(y, lens, o, n, f, fwd, ss, rs); }
extern "C" __global__ void rnnserve_last_2(const unsigned short* y, const int* lens, unsigned short* o, long long n,
    long long f, long long fwd, long long ss, long long rs) { last_steps<unsigned short>(y, lens, o, n, f, fwd, ss, rs); }

#define RNNSERVE_VARIANTS(W, T) \
extern "C" __global__ void rnnserve_swap01_##W(const T* s, T* d, long long a, long long b, long long r) \
    { swap01<T>(s, d, a, b, r); } \
extern "C" __global__ void rnnserve_pairs_##W(const T* s, T* d, const int* p, long long c, long long l, \
    long long ns, long long nd, long long r) { copy_pairs<T>(s, d, p, c, l, ns, nd, r); }

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
    dev = cp.cuda.Device().id
    with _module_lock:
        mod = _modules.get(dev)
        if mod is None:
            raw = cp.RawModule(code=_SOURCE, options=("-std=c++14",))
            mod = {f"{kind}_{w}": raw.get_function(f"rnnserve_{kind}_{w}")
                   for kind in ("swap01", "pairs") for w in _WIDTHS}
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


def copy_pairs(cp: Any, src: Any, dst: Any, pairs: Any, count: int) -> None:
    """``dst[:, d] = src[:, s]`` for each of ``count`` (s, d) int32 pairs in device array ``pairs``, one kernel.

    ``src`` [L, n_src, W] and ``dst`` [L, n_dst, W]: C-contiguous, same dtype, on the current stream.
    """
    if src.dtype != dst.dtype or src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2]:
        raise ValueError(f"copy_pairs needs [L, n, W] arrays of one dtype, L and W, got {src.shape} {src.dtype} "
                         f"and {dst.shape} {dst.dtype}")
    if not (src.flags.c_contiguous and dst.flags.c_contiguous):
        raise ValueError("copy_pairs needs C-contiguous arrays")
    layers, width = int(src.shape[0]), int(src.shape[2])
    if count == 0 or layers == 0 or width == 0:
        return
    row_bytes = width * src.itemsize
    w = _width(row_bytes, src.data.ptr, dst.data.ptr)
    r = row_bytes // w
    total = layers * count * r
    _kernels(cp)[f"pairs_{w}"]((_grid(total),), (_THREADS,),
                               (src, dst, pairs, np.int64(count), np.int64(layers), np.int64(src.shape[1]),
                                np.int64(dst.shape[1]), np.int64(r)))


def last_steps(cp: Any, y: Any, lens_dev: Any, forward_cols: int) -> Any:
    """[n, F] many-to-one outputs of ``y`` [n, t, F] (any strides, unit stride along F).

    Columns below ``forward_cols`` come from step ``lens_dev[s] - 1`` (int32 device array), the
    others from step 0 (a reverse direction ends there). 4- and 2-byte element types.
    """
    n, _, f = (int(d) for d in y.shape)
    item = y.itemsize
    if item not in (4, 2) or y.strides[2] != item:
        raise ValueError(f"last_steps needs 4- or 2-byte elements with unit stride, got {y.dtype} {y.strides}")
    out = cp.empty((n, f), y.dtype)
    if out.size == 0:
        return out
    total = n * f
    _kernels(cp)[f"last_{item}"]((_grid(total),), (_THREADS,),
                                 (y, lens_dev, out, np.int64(n), np.int64(f), np.int64(forward_cols),
                                  np.int64(y.strides[1] // item), np.int64(y.strides[0] // item)))
    return out

"""Find libcudnn.so.9 and bind the RNN part of its C API through ctypes.

CuPy 14 dropped its cuDNN bindings and the cuDNN Python frontend has no RNN API,
so the engine calls the C library directly. Importing this module needs nothing
but the standard library; the library is loaded on first use by
:func:`get_library`, which raises :class:`EngineUnavailable` naming every place it
looked.

Where it looks, in order:

1. ``RNNSERVE_CUDNN_LIBRARY`` (a file path), when set: an explicit setting wins
   over anything found on its own;
2. the ``nvidia-cudnn-cu13`` wheel: ``nvidia/cudnn/lib/libcudnn.so.9``. Its
   sub-libraries (``libcudnn_graph``, ``libcudnn_ops``, ``libcudnn_adv``, which holds
   the RNN code) are loaded first with RTLD_GLOBAL so the dispatcher finds them
   by soname whatever the process's library path is;
3. the system loader: ``libcudnn.so.9``.

Enum values are those of ``cudnn_adv.h`` / ``cudnn_graph.h`` (layouts.md section 1.1).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any
from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_size_t, c_uint32, c_ulonglong, c_void_p

from ...errors import EngineUnavailable, RNNServeError

ENV_LIBRARY = "RNNSERVE_CUDNN_LIBRARY"
MIN_VERSION = 90000

# cudnnRNNAlgo_t
ALGO_STANDARD, ALGO_PERSIST_STATIC, ALGO_PERSIST_DYNAMIC, ALGO_PERSIST_STATIC_SMALL_H = 0, 1, 2, 3
ALGO_NAMES = {0: "standard", 1: "persist_static", 2: "persist_dynamic", 3: "persist_static_small_h"}
ALGO_BY_NAME = {v: k for k, v in ALGO_NAMES.items()}
# cudnnRNNMode_t
CELL_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
BIAS_DOUBLE = 2
DIR_UNIDIRECTIONAL, DIR_BIDIRECTIONAL = 0, 1
INPUT_LINEAR = 0
LAYOUT_SEQ_MAJOR_UNPACKED, LAYOUT_SEQ_MAJOR_PACKED, LAYOUT_BATCH_MAJOR_UNPACKED = 0, 1, 2
PADDED_IO_DISABLED, PADDED_IO_ENABLED = 0, 1
FWD_MODE_INFERENCE = 0
# cudnnDataType_t
DATA_FLOAT, DATA_DOUBLE, DATA_HALF, DATA_INT32, DATA_BFLOAT16 = 0, 1, 2, 4, 9
# cudnnMathType_t
MATH_DEFAULT, MATH_TENSOR_OP, MATH_TENSOR_OP_ALLOW_CONVERSION, MATH_FMA = 0, 1, 2, 3
MATH_NAMES = {0: "default", 1: "tensor_op", 2: "tensor_op_allow_conversion", 3: "fma"}

_STATUS_NAMES = {
    0: "CUDNN_STATUS_SUCCESS", 1001: "CUDNN_STATUS_NOT_INITIALIZED", 2000: "CUDNN_STATUS_BAD_PARAM",
    3000: "CUDNN_STATUS_NOT_SUPPORTED", 4000: "CUDNN_STATUS_INTERNAL_ERROR", 5000: "CUDNN_STATUS_EXECUTION_FAILED",
}

_vp = c_void_p
_PROTOTYPES: dict[str, list] = {
    "cudnnCreate": [POINTER(c_void_p)],
    "cudnnDestroy": [_vp],
    "cudnnSetStream": [_vp, _vp],
    "cudnnCreateDropoutDescriptor": [POINTER(c_void_p)],
    "cudnnDestroyDropoutDescriptor": [_vp],
    "cudnnSetDropoutDescriptor": [_vp, _vp, c_float, _vp, c_size_t, c_ulonglong],
    "cudnnCreateRNNDescriptor": [POINTER(c_void_p)],
    "cudnnDestroyRNNDescriptor": [_vp],
    "cudnnSetRNNDescriptor_v8": [_vp, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int,
                                 c_int32, c_int32, c_int32, c_int32, _vp, c_uint32],
    "cudnnGetRNNWeightSpaceSize": [_vp, _vp, POINTER(c_size_t)],
    "cudnnGetRNNWeightParams": [_vp, _vp, c_int32, c_size_t, _vp, c_int32, _vp, POINTER(c_void_p),
                                _vp, POINTER(c_void_p)],
    "cudnnCreateRNNDataDescriptor": [POINTER(c_void_p)],
    "cudnnDestroyRNNDataDescriptor": [_vp],
    "cudnnSetRNNDataDescriptor": [_vp, c_int, c_int, c_int, c_int, c_int, _vp, _vp],
    "cudnnCreateTensorDescriptor": [POINTER(c_void_p)],
    "cudnnDestroyTensorDescriptor": [_vp],
    "cudnnSetTensorNdDescriptor": [_vp, c_int, c_int, POINTER(c_int), POINTER(c_int)],
    "cudnnGetTensorNdDescriptor": [_vp, c_int, POINTER(c_int), POINTER(c_int), POINTER(c_int), POINTER(c_int)],
    "cudnnGetRNNTempSpaceSizes": [_vp, _vp, c_int, _vp, POINTER(c_size_t), POINTER(c_size_t)],
    "cudnnBuildRNNDynamic": [_vp, _vp, c_int],
    "cudnnRNNForward": [_vp, _vp, c_int, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp,
                        c_size_t, _vp, c_size_t, _vp, c_size_t, _vp],
}


# Called without the GIL (through a CDLL handle): these run for milliseconds on the host. With the
# STANDARD algorithm cudnnRNNForward launches a few kernels per time step and layer (~1-2 ms of host
# time for 200 steps), and BuildRNNDynamic compiles a plan. Holding the GIL meanwhile stalls the event
# loop, which parses and answers other requests while a batch runs. Every other call is microseconds
# of descriptor work and keeps the GIL (PyDLL: no release and re-acquire per call).
RELEASES_GIL = frozenset({"cudnnRNNForward", "cudnnBuildRNNDynamic"})


class CudnnError(RNNServeError):
    """A cuDNN call returned a non-zero status; ``call`` names it, ``code`` is the status."""

    status = "INTERNAL"

    def __init__(self, call: str, code: int, text: str, detail: str = "") -> None:
        name = _STATUS_NAMES.get(code, "cudnnStatus_t")
        message = f"{call} failed with {name} ({code}): {text}"
        if detail and detail not in text:
            message += f" [{detail}]"
        super().__init__(message)
        self.call = call
        self.code = code


class CudnnLibrary:
    """The loaded library: every function in ``_PROTOTYPES`` becomes a method that raises CudnnError."""

    def __init__(self, lib: ctypes.CDLL, path: str, nogil: ctypes.CDLL | None = None) -> None:
        """``lib``: the library (a PyDLL keeps the GIL); ``nogil``: a CDLL of it for :data:`RELEASES_GIL`."""
        self._lib = lib
        self.path = path
        lib.cudnnGetVersion.restype = c_size_t
        lib.cudnnGetVersion.argtypes = []
        lib.cudnnGetErrorString.restype = c_char_p
        lib.cudnnGetErrorString.argtypes = [c_int]
        self._last_error = getattr(lib, "cudnnGetLastErrorString", None)
        if self._last_error is not None:
            self._last_error.restype = None
            self._last_error.argtypes = [c_char_p, c_size_t]
        self.version = int(lib.cudnnGetVersion())
        missing = []
        self.functions: dict[str, Any] = {}  # the raw ctypes functions, by name
        for name, argtypes in _PROTOTYPES.items():
            try:
                fn = getattr(nogil if nogil is not None and name in RELEASES_GIL else lib, name)
            except AttributeError:
                missing.append(name)
                continue
            fn.restype = c_int
            fn.argtypes = argtypes
            self.functions[name] = fn
            setattr(self, name, self._checked(name, fn))
        if missing:
            raise EngineUnavailable(f"{path} (cuDNN {self.version}) lacks {', '.join(missing)}; cuDNN 9 is required")

    def _checked(self, name: str, fn):
        def call(*args):
            status = fn(*args)
            if status:
                raise self.error(name, status)

        call.__name__ = name
        return call

    def error(self, call: str, status: int) -> CudnnError:
        """Build the exception for ``status`` returned by ``call``, with cuDNN's own words."""
        text = (self._lib.cudnnGetErrorString(int(status)) or b"").decode(errors="replace")
        detail = ""
        if self._last_error is not None:
            buf = ctypes.create_string_buffer(1024)
            self._last_error(buf, len(buf))
            detail = buf.value.decode(errors="replace").strip()
        return CudnnError(call, int(status), text, detail)


def _wheel_dirs() -> list[str]:
    try:
        import nvidia.cudnn as wheel  # type: ignore[import-not-found]
    except Exception:
        return []
    dirs = [os.path.join(p, "lib") for p in getattr(wheel, "__path__", [])]
    if not dirs and getattr(wheel, "__file__", None):
        dirs = [os.path.join(os.path.dirname(wheel.__file__), "lib")]
    return dirs


def default_candidates() -> list[tuple[str, str]]:
    """(where, path or soname) pairs tried in order by :func:`get_library`."""
    out: list[tuple[str, str]] = []
    env = os.environ.get(ENV_LIBRARY)
    if env:
        out.append((f"${ENV_LIBRARY}", env))
    wheel_dirs = _wheel_dirs()
    for d in wheel_dirs:
        out.append(("the nvidia-cudnn-cu13 wheel", os.path.join(d, "libcudnn.so.9")))
    if not wheel_dirs:
        out.append(("the nvidia-cudnn-cu13 wheel", "(not installed: import nvidia.cudnn failed)"))
    out.append(("the system loader", "libcudnn.so.9"))
    return out


_SIBLINGS = ("libcudnn_graph.so.9", "libcudnn_ops.so.9", "libcudnn_adv.so.9")


def load_library(candidates: list[tuple[str, str]] | None = None) -> CudnnLibrary:
    """Load the first working cuDNN 9 of ``candidates``; EngineUnavailable lists every failure."""
    candidates = default_candidates() if candidates is None else candidates
    tried: list[str] = []
    for where, path in candidates:
        if path.startswith("("):
            tried.append(f"{where}: {path}")
            continue
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{where}: {path} does not exist")
            continue
        try:
            if os.sep in path:
                folder = os.path.dirname(path)
                for sib in _SIBLINGS:
                    sib_path = os.path.join(folder, sib)
                    if os.path.exists(sib_path):
                        # The dispatcher dlopens these by soname; loading them globally first makes
                        # that independent of LD_LIBRARY_PATH. A failure here is left to the dispatcher.
                        with contextlib.suppress(OSError):
                            ctypes.CDLL(sib_path, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.PyDLL(path, mode=ctypes.RTLD_GLOBAL)
            nogil = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # the same loaded library (dlopen counts)
        except OSError as exc:
            tried.append(f"{where}: {path}: {exc}")
            continue
        try:
            loaded = CudnnLibrary(lib, path, nogil)
        except (AttributeError, EngineUnavailable) as exc:
            tried.append(f"{where}: {path}: {exc}")
            continue
        if loaded.version < MIN_VERSION:
            tried.append(f"{where}: {path} is cuDNN {loaded.version}, need 9.x (>= {MIN_VERSION})")
            continue
        return loaded
    raise EngineUnavailable(
        "cuDNN 9 (libcudnn.so.9) could not be loaded; tried " + "; ".join(tried)
        + f". Install it with pip install 'rnnserve[gpu]' (nvidia-cudnn-cu13) or set {ENV_LIBRARY} to the file"
    )


_lock = threading.Lock()
_cached: CudnnLibrary | None = None
_failure: EngineUnavailable | None = None


def get_library() -> CudnnLibrary:
    """The process-wide library, loaded once (a failure is remembered and raised again)."""
    global _cached, _failure
    with _lock:
        if _cached is not None:
            return _cached
        if _failure is not None:
            raise EngineUnavailable(_failure.message)
        try:
            _cached = load_library()
        except EngineUnavailable as exc:
            _failure = exc
            raise
        return _cached

"""cuDNN descriptors as small owning objects, and the precision settings they are built from.

Every descriptor is created once and re-set only when what it describes changes
(the data descriptors remember the last (batch, steps, lengths) they were set to),
so the hot path makes no create/destroy calls.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ...errors import InvalidInput
from ...spec import BlockSpec
from . import library as L


@dataclass(frozen=True)
class Precision:
    """How data is stored and computed: cuDNN data type, math precision and math type.

    ``store`` is the NumPy/CuPy dtype of device buffers; bfloat16 is stored as
    uint16 bit patterns because NumPy and CuPy have no bfloat16 dtype.
    """

    name: str
    data_type: int
    math_prec: int
    math_type: int
    store: np.dtype

    @property
    def itemsize(self) -> int:
        return self.store.itemsize

    @property
    def math_name(self) -> str:
        return L.MATH_NAMES[self.math_type]


def make_precision(name: str, allow_tf32: bool) -> Precision:
    """float32: FMA math (bit-for-bit the fp32 equations) or, with ``allow_tf32``, cuDNN's
    default math, which lets tensor cores run TF32 (what PyTorch does with
    ``torch.backends.cudnn.allow_tf32``). float16/bfloat16 data: fp32 math precision on
    tensor cores (persistent algorithms need fp32 math precision for fp16 data)."""
    if name == "float32":
        return Precision(name, L.DATA_FLOAT, L.DATA_FLOAT, L.MATH_DEFAULT if allow_tf32 else L.MATH_FMA,
                         np.dtype(np.float32))
    if name == "float16":
        return Precision(name, L.DATA_HALF, L.DATA_FLOAT, L.MATH_TENSOR_OP, np.dtype(np.float16))
    if name == "bfloat16":
        return Precision(name, L.DATA_BFLOAT16, L.DATA_FLOAT, L.MATH_TENSOR_OP, np.dtype(np.uint16))
    raise InvalidInput(f"precision '{name}' is not supported by the cuDNN engine; use float32, float16 or bfloat16")


def _create(lib: L.CudnnLibrary, kind: str) -> int:
    handle = ctypes.c_void_p()
    getattr(lib, f"cudnnCreate{kind}")(ctypes.byref(handle))
    return int(handle.value or 0)


class Handle:
    """A cuDNN handle bound to one CUDA stream."""

    def __init__(self, lib: L.CudnnLibrary, stream_ptr: int) -> None:
        self.lib = lib
        self.ptr = _create(lib, "")
        lib.cudnnSetStream(self.ptr, stream_ptr)
        # Dropout is never applied in inference, but cudnnSetRNNDescriptor_v8 wants a descriptor;
        # with p = 0 it needs no state buffer.
        self.dropout = _create(lib, "DropoutDescriptor")
        lib.cudnnSetDropoutDescriptor(self.dropout, self.ptr, 0.0, None, 0, 0)

    def close(self) -> None:
        if self.dropout:
            self.lib.cudnnDestroyDropoutDescriptor(self.dropout)
            self.dropout = 0
        if self.ptr:
            self.lib.cudnnDestroy(self.ptr)
            self.ptr = 0


class RNNDescriptor:
    """One block's cuDNN RNN descriptor for one algorithm (and, for PERSIST_DYNAMIC, one batch)."""

    def __init__(self, handle: Handle, spec: BlockSpec, algo: int, prec: Precision, padded: bool = True) -> None:
        self.lib = handle.lib
        self.handle = handle
        self.algo = algo
        self.padded = padded
        self.ptr = _create(self.lib, "RNNDescriptor")
        try:
            self.lib.cudnnSetRNNDescriptor_v8(
                self.ptr, algo, L.CELL_MODES[spec.cell], L.BIAS_DOUBLE,
                L.DIR_BIDIRECTIONAL if spec.bidirectional else L.DIR_UNIDIRECTIONAL, L.INPUT_LINEAR,
                prec.data_type, prec.math_prec, prec.math_type,
                spec.input_size, spec.hidden_size, spec.output_size, spec.num_layers,
                handle.dropout, L.PADDED_IO_ENABLED if padded else L.PADDED_IO_DISABLED,
            )
        except L.CudnnError:
            self.close()
            raise

    def weight_space_size(self) -> int:
        size = ctypes.c_size_t()
        self.lib.cudnnGetRNNWeightSpaceSize(self.handle.ptr, self.ptr, ctypes.byref(size))
        return int(size.value)

    def build_dynamic(self, batch: int) -> None:
        """Compile the PERSIST_DYNAMIC kernels for exactly ``batch`` sequences."""
        self.lib.cudnnBuildRNNDynamic(self.handle.ptr, self.ptr, int(batch))

    def close(self) -> None:
        if self.ptr:
            self.lib.cudnnDestroyRNNDescriptor(self.ptr)
            self.ptr = 0


class TensorDescriptor:
    """A fully packed N-d tensor descriptor (used for h/c states and weight queries)."""

    def __init__(self, lib: L.CudnnLibrary, data_type: int | None = None, dims: tuple[int, ...] = ()) -> None:
        self.lib = lib
        self.ptr = _create(lib, "TensorDescriptor")
        if dims:
            try:
                self.set(data_type, dims)
            except L.CudnnError:
                self.close()
                raise

    def set(self, data_type: int, dims: tuple[int, ...]) -> None:
        n = len(dims)
        strides = [1] * n
        for i in range(n - 2, -1, -1):
            strides[i] = strides[i + 1] * dims[i + 1]
        self.lib.cudnnSetTensorNdDescriptor(self.ptr, data_type, n, (ctypes.c_int * n)(*dims),
                                            (ctypes.c_int * n)(*strides))

    def dims(self) -> tuple[int, ...]:
        """The dimensions cuDNN reports for this descriptor (after cudnnGetRNNWeightParams filled it)."""
        dt, nb = ctypes.c_int(), ctypes.c_int()
        dims, strides = (ctypes.c_int * 8)(), (ctypes.c_int * 8)()
        self.lib.cudnnGetTensorNdDescriptor(self.ptr, 8, ctypes.byref(dt), ctypes.byref(nb), dims, strides)
        return tuple(int(dims[i]) for i in range(nb.value))

    def close(self) -> None:
        if self.ptr:
            self.lib.cudnnDestroyTensorDescriptor(self.ptr)
            self.ptr = 0


_ZERO_FILL = ctypes.c_double(0.0)  # zero bits read as any float type: the padding fill for outputs


class DataDescriptor:
    """A padded (unpacked) RNN data descriptor; re-set only when (batch, steps, lengths, layout) change."""

    def __init__(self, lib: L.CudnnLibrary, data_type: int, vector_size: int) -> None:
        self.lib = lib
        self.data_type = data_type
        self.vector_size = vector_size
        self.ptr = _create(lib, "RNNDataDescriptor")
        self.key: object = None

    def set(self, key: object, batch: int, steps: int, lengths: np.ndarray, seq_major: bool = False,
            packed: bool = False) -> None:
        """``lengths`` is a host int32 array of ``batch`` values; ``key`` identifies (lengths, layout) cheaply.

        ``packed`` (sequence-major, every length equal to ``steps``) is the same memory as the
        unpacked layout, described the way PyTorch describes it, with padded IO off.
        """
        if key == self.key:
            return
        self.key = None
        if packed:
            layout = L.LAYOUT_SEQ_MAJOR_PACKED
        else:
            layout = L.LAYOUT_SEQ_MAJOR_UNPACKED if seq_major else L.LAYOUT_BATCH_MAJOR_UNPACKED
        self.lib.cudnnSetRNNDataDescriptor(self.ptr, self.data_type, layout, steps, batch,
                                           self.vector_size, lengths.ctypes.data, ctypes.addressof(_ZERO_FILL))
        self.key = key

    def close(self) -> None:
        if self.ptr:
            self.lib.cudnnDestroyRNNDataDescriptor(self.ptr)
            self.ptr = 0


class StateDescriptors:
    """h and c tensor descriptors ([L*D, batch, Ho] and [L*D, batch, H]) per batch size, LRU-bounded."""

    def __init__(self, lib: L.CudnnLibrary, spec: BlockSpec, data_type: int, limit: int = 128) -> None:
        self.lib = lib
        self.spec = spec
        self.data_type = data_type
        self.limit = limit
        self._cache: OrderedDict[int, tuple[TensorDescriptor, TensorDescriptor]] = OrderedDict()

    def get(self, batch: int) -> tuple[TensorDescriptor, TensorDescriptor]:
        hit = self._cache.get(batch)
        if hit is not None:
            self._cache.move_to_end(batch)
            return hit
        rows = self.spec.pseudo_layers
        h = TensorDescriptor(self.lib, self.data_type, (rows, batch, self.spec.output_size))
        c = TensorDescriptor(self.lib, self.data_type, (rows, batch, self.spec.hidden_size))
        self._cache[batch] = (h, c)
        if len(self._cache) > self.limit:
            _, (oh, oc) = self._cache.popitem(last=False)
            oh.close()
            oc.close()
        return h, c

    def close(self) -> None:
        for h, c in self._cache.values():
            h.close()
            c.close()
        self._cache.clear()

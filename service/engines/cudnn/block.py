"""One block on the GPU: its descriptors (one per algorithm), weight space and forward call.

:class:`DeviceContext` is what the blocks of one engine share: the cuDNN handle,
the dedicated CUDA stream and one workspace buffer that only grows.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ...errors import RNNServeError
from ...spec import BlockSpec
from . import library as L
from .descriptors import DataDescriptor, Handle, Precision, RNNDescriptor, StateDescriptors
from .weights import upload_weights, weights_match


class AlgorithmRejected(RNNServeError):
    """An algorithm cuDNN accepted but that the engine will not use for this block (message says why)."""

    status = "INTERNAL"


class DeviceContext:
    """Handle, stream and workspace shared by every block of one engine on one GPU."""

    def __init__(self, lib: L.CudnnLibrary, device_id: int) -> None:
        import cupy as cp

        self.cp = cp
        self.lib = lib
        self.device = cp.cuda.Device(device_id)
        with self.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.handle = Handle(lib, self.stream.ptr)
        self._work = None
        self._work_bytes = 0

    def workspace(self, nbytes: int) -> int:
        """Pointer to at least ``nbytes`` of scratch (stream-ordered, so reuse across calls is safe)."""
        if nbytes > self._work_bytes:
            size = max(nbytes, 2 * self._work_bytes, 1 << 20)
            self._work = None
            self._work = self.cp.empty(size, dtype=self.cp.uint8)
            self._work_bytes = size
        return int(self._work.data.ptr) if self._work is not None else 0

    def close(self) -> None:
        self._work = None
        self._work_bytes = 0
        self.handle.close()


class BlockRunner:
    """Runs one block: ``forward`` is one cudnnRNNForward on device pointers."""

    def __init__(self, ctx: DeviceContext, index: int, spec: BlockSpec, flat: np.ndarray, prec: Precision,
                 force_per_matrix: bool = False) -> None:
        self.ctx = ctx
        self.index = index
        self.spec = spec
        self.prec = prec
        lib = ctx.lib
        self.descs: dict[tuple[int, bool], RNNDescriptor] = {}       # (algo, padded IO)
        self.dynamic: dict[tuple[int, bool], RNNDescriptor] = {}     # (batch, padded IO), PERSIST_DYNAMIC
        self.rejected: dict[int, str] = {}
        # PERSIST_DYNAMIC compiles kernels per batch size (cudnnBuildRNNDynamic: 0.1-0.7 s on an H100).
        # Building is allowed while the engine loads; a serving-time call must never wait for a build.
        self.builds_allowed = True
        self.descs[(L.ALGO_STANDARD, True)] = RNNDescriptor(ctx.handle, spec, L.ALGO_STANDARD, prec)
        self.weights = upload_weights(ctx.handle, self.descs[(L.ALGO_STANDARD, True)], spec, flat, prec, ctx.stream,
                                      force_per_matrix)
        self.x_desc = DataDescriptor(lib, prec.data_type, spec.input_size)
        self.y_desc = DataDescriptor(lib, prec.data_type, spec.directions * spec.output_size)
        self.states = StateDescriptors(lib, spec, prec.data_type)
        self._work_sizes: dict[tuple, int] = {}

    @property
    def out_features(self) -> int:
        return self.spec.directions * self.spec.output_size

    def descriptor(self, algo: int, batch: int, padded: bool = True) -> RNNDescriptor:
        """The descriptor for ``algo`` (PERSIST_DYNAMIC: built for exactly ``batch``), made on first use.

        ``padded=False`` is the descriptor for packed sequence-major IO (all lengths equal).
        """
        if algo == L.ALGO_PERSIST_DYNAMIC:
            desc = self.dynamic.get((batch, padded))
            if desc is None:
                if not self.builds_allowed:
                    # At serving time a build stalled every request of the process for its duration
                    # (H100: 6 builds of 0.13 s each under streaming load); the caller runs STANDARD.
                    raise AlgorithmRejected(f"PERSIST_DYNAMIC is not built for a batch of {batch}")
                desc = self._new(algo, padded)
                try:
                    desc.build_dynamic(batch)
                except Exception:
                    desc.close()
                    raise
                self.dynamic[(batch, padded)] = desc
            return desc
        desc = self.descs.get((algo, padded))
        if desc is None:
            desc = self.descs[(algo, padded)] = self._new(algo, padded)
        return desc

    def _new(self, algo: int, padded: bool = True) -> RNNDescriptor:
        if algo in self.rejected:
            raise AlgorithmRejected(self.rejected[algo])
        desc = RNNDescriptor(self.ctx.handle, self.spec, algo, self.prec, padded)
        if not weights_match(self.ctx.handle, desc, self.spec, self.weights, self.prec):
            desc.close()
            self.rejected[algo] = f"{L.ALGO_NAMES[algo]} lays out weights differently from standard"
            raise AlgorithmRejected(self.rejected[algo])
        return desc

    def forward(self, algo: int, batch: int, steps: int, lens_key: tuple, lens_host: np.ndarray, lens_dev: int,
                x: int, y: int, hx: int = 0, hy: int = 0, cx: int = 0, cy: int = 0, seq_major: bool = False,
                workspace: int | None = None) -> None:
        """Enqueue the block on the engine stream; arguments from ``lens_dev`` on are device pointers.

        ``lens_key`` identifies ``lens_host``; it ends in None when every length equals ``steps``.
        ``workspace``: a buffer of at least :meth:`work_size` bytes to use instead of the shared
        one (a CUDA graph keeps the pointers it was captured with, and the shared one may grow).
        """
        lib = self.ctx.lib
        desc, work = self._prepare(algo, batch, steps, lens_key, lens_host, seq_major)
        wptr = self.ctx.workspace(work) if workspace is None else workspace
        hdesc, cdesc = self.states.get(batch)
        lib.cudnnRNNForward(self.ctx.handle.ptr, desc.ptr, L.FWD_MODE_INFERENCE, lens_dev, self.x_desc.ptr, x,
                            self.y_desc.ptr, y, hdesc.ptr, hx or None, hy or None, cdesc.ptr, cx or None, cy or None,
                            self.weights.nbytes, self.weights.ptr, work, wptr or None, 0, None)

    def work_size(self, algo: int, batch: int, steps: int, lens_key: tuple, lens_host: np.ndarray,
                  seq_major: bool = False) -> int:
        """Bytes of workspace a :meth:`forward` call with these arguments needs."""
        return self._prepare(algo, batch, steps, lens_key, lens_host, seq_major)[1]

    def _prepare(self, algo, batch, steps, lens_key, lens_host, seq_major):
        """The descriptor for the call, with the data descriptors set; (descriptor, workspace bytes)."""
        # Equal lengths in sequence-major order: packed IO without padding, as PyTorch runs it.
        packed = seq_major and lens_key[-1] is None
        if packed and algo == L.ALGO_PERSIST_DYNAMIC and (batch, False) not in self.dynamic:
            packed = False  # equal lengths in padded IO are the same memory: use the build for padded IO
        desc = self.descriptor(algo, batch, padded=not packed)
        key = (seq_major, lens_key)
        self.x_desc.set(key, batch, steps, lens_host, seq_major, packed)
        self.y_desc.set(key, batch, steps, lens_host, seq_major, packed)
        # The workspace cuDNN asks for depends on the lengths, not only on (batch, steps): sizes are
        # cached for equal-length batches and asked for on every ragged call.
        wkey = (desc.ptr, key) if lens_key[-1] is None else None
        work = self._work_sizes.get(wkey) if wkey is not None else None
        if work is None:
            ws, rs = ctypes.c_size_t(), ctypes.c_size_t()
            self.ctx.lib.cudnnGetRNNTempSpaceSizes(self.ctx.handle.ptr, desc.ptr, L.FWD_MODE_INFERENCE,
                                                   self.x_desc.ptr, ctypes.byref(ws), ctypes.byref(rs))
            work = int(ws.value)
            if wkey is not None:
                if len(self._work_sizes) > 4096:
                    self._work_sizes.clear()
                self._work_sizes[wkey] = work
        return desc, work

    def close(self) -> None:
        for desc in list(self.descs.values()) + list(self.dynamic.values()):
            desc.close()
        self.descs.clear()
        self.dynamic.clear()
        self.x_desc.close()
        self.y_desc.close()
        self.states.close()
        self.weights = None

"""Upload a block's canonical flat buffer into cuDNN's weight space.

The canonical layout (service.packing.block_layout) was measured to be cuDNN's
own weight space byte for byte (design.md). The engine does not trust that: it
asks ``cudnnGetRNNWeightParams`` where every matrix and bias lives and what shape
cuDNN gives it. When every address and shape agrees with the canonical offsets the
upload is one host-to-device copy; otherwise (or when forced, for tests) each
matrix and bias is copied to the address cuDNN reported.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ...errors import EngineUnavailable
from ...packing import block_layout, block_param_count
from ...spec import BlockSpec
from .descriptors import Handle, Precision, RNNDescriptor, TensorDescriptor


def float32_to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the bit patterns as uint16."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Inverse of :func:`float32_to_bfloat16_bits` (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_store(flat: np.ndarray, prec: Precision) -> np.ndarray:
    """Host copy of ``flat`` in the engine's storage dtype."""
    flat32 = np.asarray(flat, dtype=np.float32)
    if prec.name == "bfloat16":
        return float32_to_bfloat16_bits(flat32)
    return np.ascontiguousarray(flat32.astype(prec.store))


@dataclass
class WeightSpace:
    """A block's weights on the device, in cuDNN's weight space."""

    buffer: object          # cupy uint8 array
    nbytes: int
    offsets: list[int]      # element offset of every canonical entry, as cuDNN reported it
    single_copy: bool       # True when the canonical layout matched and one copy was made
    mismatches: list[str]   # why the canonical layout did not match (empty when it did)

    @property
    def ptr(self) -> int:
        return int(self.buffer.data.ptr)


def weight_addresses(handle: Handle, desc: RNNDescriptor, spec: BlockSpec, base: int, nbytes: int,
                     itemsize: int) -> list[tuple[object, int, tuple[int, ...]]]:
    """For each canonical entry: (entry, element offset cuDNN reports, dims cuDNN reports)."""
    lib = handle.lib
    mdesc, bdesc = TensorDescriptor(lib), TensorDescriptor(lib)
    try:
        found: dict[tuple[str, int, int], tuple[int, tuple[int, ...]]] = {}
        ids = list(range(2 * spec.gates)) + ([8] if spec.proj_size else [])
        for p in range(spec.pseudo_layers):
            for lin in ids:
                m_addr, b_addr = ctypes.c_void_p(), ctypes.c_void_p()
                lib.cudnnGetRNNWeightParams(handle.ptr, desc.ptr, p, nbytes, base, lin, mdesc.ptr,
                                            ctypes.byref(m_addr), bdesc.ptr, ctypes.byref(b_addr))
                if m_addr.value:
                    found[("matrix", p, lin)] = ((m_addr.value - base) // itemsize, mdesc.dims())
                if b_addr.value:
                    found[("bias", p, lin)] = ((b_addr.value - base) // itemsize, bdesc.dims())
    finally:
        mdesc.close()
        bdesc.close()
    out = []
    for entry in block_layout(spec):
        key = (entry.kind, entry.pseudo_layer, entry.lin_id)
        if key not in found:
            raise EngineUnavailable(
                f"cuDNN reports no {entry.kind} for pseudo-layer {entry.pseudo_layer}, linLayerID {entry.lin_id} "
                f"of a {spec.cell} block; this cuDNN cannot hold the model's weights"
            )
        offset, dims = found[key]
        size = int(np.prod(dims)) if dims else 0
        if size != entry.size:
            raise EngineUnavailable(
                f"cuDNN gives {entry.describe(spec.cell)} of pseudo-layer {entry.pseudo_layer} dims {list(dims)}, "
                f"but the canonical layout has shape {list(entry.shape)}; the model cannot be mapped"
            )
        if offset < 0 or (offset + entry.size) * itemsize > nbytes:
            raise EngineUnavailable(f"cuDNN placed {entry.describe(spec.cell)} of pseudo-layer {entry.pseudo_layer} "
                                    f"outside its {nbytes}-byte weight space")
        out.append((entry, offset, dims))
    return out


def upload_weights(handle: Handle, desc: RNNDescriptor, spec: BlockSpec, flat: np.ndarray, prec: Precision,
                   stream, force_per_matrix: bool = False) -> WeightSpace:
    """Copy ``flat`` (canonical, any float dtype) into a new weight space for ``desc``."""
    import cupy as cp

    nbytes = desc.weight_space_size()
    itemsize = prec.itemsize
    need = block_param_count(spec) * itemsize
    buffer = cp.zeros(max(nbytes, need), dtype=cp.uint8)
    base = int(buffer.data.ptr)
    host = to_store(flat, prec)
    placed = weight_addresses(handle, desc, spec, base, nbytes, itemsize)
    mismatches = []
    if nbytes != need:
        mismatches.append(f"weight space is {nbytes} bytes, canonical layout {need}")
    for entry, offset, _dims in placed:
        if offset != entry.offset:
            mismatches.append(f"{entry.describe(spec.cell)} of pseudo-layer {entry.pseudo_layer} is at element "
                              f"{offset}, canonical {entry.offset}")
    single = not mismatches and not force_per_matrix
    if single:
        buffer[:need].set(host.view(np.uint8), stream=stream)
    else:
        dev = buffer[:nbytes - nbytes % itemsize].view(prec.store)
        for entry, offset, _dims in placed:
            dev[offset:offset + entry.size].set(host[entry.offset:entry.offset + entry.size], stream=stream)
    stream.synchronize()
    return WeightSpace(buffer, nbytes, [offset for _, offset, _ in placed], single, mismatches)


def weights_match(handle: Handle, desc: RNNDescriptor, spec: BlockSpec, space: WeightSpace, prec: Precision) -> bool:
    """True when ``desc`` (another algorithm's descriptor) expects every tensor where ``space`` holds it."""
    if desc.weight_space_size() != space.nbytes:
        return False
    placed = weight_addresses(handle, desc, spec, space.ptr, space.nbytes, prec.itemsize)
    return [offset for _, offset, _ in placed] == space.offsets

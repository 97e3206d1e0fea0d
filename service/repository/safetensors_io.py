"""Read and write safetensors files with NumPy, including bfloat16.

NumPy has no bfloat16, so the official ``safetensors.numpy`` cannot write one. The
format is small and documented (8-byte little-endian header length, JSON header,
raw little-endian data), so this module writes it directly; bfloat16 tensors are
written from float32 by rounding to nearest even and read back as float32.
Files written here open with the official ``safetensors`` library.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import InvalidInput

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def float32_to_bfloat16_bits(arr: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) and return the raw uint16 bits."""
    bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits to float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def save_tensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str],
                 bfloat16: frozenset[str] = frozenset()) -> None:
    """Write ``tensors`` to ``path``; names in ``bfloat16`` are stored as BF16."""
    header: dict[str, object] = {"__metadata__": metadata}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if name in bfloat16:
            raw, dtype = float32_to_bfloat16_bits(arr).astype("<u2").tobytes(), "BF16"
        else:
            arr = np.ascontiguousarray(arr)
            dtype = _NAMES[arr.dtype]
            raw = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in blobs:
            f.write(raw)


def load_tensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """Read a safetensors file: (tensors as float32/native arrays, metadata, stored dtype per tensor)."""
    path = Path(path)
    data = path.read_bytes()
    where = f"model file {path}"
    if len(data) < 8:
        raise InvalidInput(f"{where} is truncated ({len(data)} bytes); convert the model again")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER or 8 + n > len(data):
        raise InvalidInput(f"{where} has a corrupt header (length {n}); convert the model again")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as exc:
        raise InvalidInput(f"{where} has a corrupt header ({exc}); convert the model again") from exc
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + n:]
    tensors: dict[str, np.ndarray] = {}
    stored: dict[str, str] = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        if end > len(body) or start > end:
            raise InvalidInput(f"{where}: tensor '{name}' runs past the end of the file (truncated?)")
        raw = body[start:end]
        shape = tuple(info["shape"])
        if info["dtype"] == "BF16":
            arr = bfloat16_bits_to_float32(np.frombuffer(raw, dtype="<u2")).reshape(shape)
        elif info["dtype"] in _DTYPES:
            arr = np.frombuffer(raw, dtype=np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")).reshape(shape)
            arr = arr.astype(arr.dtype.newbyteorder("="))
        else:
            raise InvalidInput(f"{where}: tensor '{name}' has unsupported dtype {info['dtype']}")
        tensors[name] = arr
        stored[name] = info["dtype"]
    return tensors, metadata, stored

"""Read and write safetensors files with NumPy, including bfloat16.

NumPy has no bfloat16, so the official ``safetensors.numpy`` cannot write one. The
format is small and documented (8-byte little-endian header length, JSON header,
raw little-endian data), so this module writes it directly; bfloat16 tensors are
written from float32 by rounding to nearest even and read back as float32.
Files written here open with the official ``safetensors`` library.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import InvalidInput
from .files import open_regular, read_from

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_ITEMSIZE = {"BF16": 2, **{k: np.dtype(v).itemsize for k, v in _DTYPES.items()}}
_MAX_HEADER = 100 * 1024 * 1024
_FIX = "convert the model again (rnnserve convert)"


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
    # Written beside the target and renamed over it: a server polling the repository never reads a half-written
    # file, and a write that fails (disk full, a file size limit) leaves the previous file as it was.
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for raw in blobs:
                f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_tensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """Read a safetensors file: (tensors as float32/native arrays, metadata, stored dtype per tensor).

    The header is checked against the format before any tensor is read, so a hand-edited or corrupt file is
    refused with :class:`InvalidInput` naming the file, the tensor and what is wrong, never a TypeError.
    """
    path = Path(path)
    where = f"model file {path}"
    fix = f"check its permissions or {_FIX}"
    # the header first: it says how large the data is, so a corrupt or hostile file is refused before its data is
    # read (a 6 GB file with a broken header was read whole, and its copy outlived the failed load)
    with open_regular(path, where, fix) as f:
        size = os.fstat(f.fileno()).st_size
        header, n = _header(f, size, where, fix)
        body_size = size - 8 - n
        metadata = _metadata(header.pop("__metadata__", None), where)
        entries = [_entry(name, info, body_size, where) for name, info in header.items()]
        _refuse_bad_layout(entries, body_size, where)
        body = memoryview(read_from(f, body_size, where, fix))
    if len(body) != body_size:
        raise InvalidInput(f"{where} changed while it was read ({len(body):,} of {body_size:,} data bytes); {_FIX}")
    tensors: dict[str, np.ndarray] = {}
    stored: dict[str, str] = {}
    for e in entries:
        raw = body[e.start:e.end]
        try:
            if e.dtype == "BF16":
                arr = bfloat16_bits_to_float32(np.frombuffer(raw, dtype="<u2")).reshape(e.shape)
            else:
                arr = np.frombuffer(raw, dtype=np.dtype(_DTYPES[e.dtype]).newbyteorder("<")).reshape(e.shape)
                arr = arr.astype(arr.dtype.newbyteorder("="))
        except ValueError as exc:  # an empty tensor's shape may still be past NumPy's limits: [0] * 65, [2**70, 0]
            raise InvalidInput(f"{where}: tensor '{e.name}' has shape {_shown(list(e.shape))}, which NumPy cannot "
                               f"hold ({exc}); {_FIX}") from None
        tensors[e.name] = arr
        stored[e.name] = e.dtype
    return tensors, metadata, stored


class _Entry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _header(f: Any, size: int, where: str, fix: str) -> tuple[dict[str, Any], int]:
    """The header (a JSON object) of the open file ``f`` of ``size`` bytes, and its length in bytes; InvalidInput
    when the prefix or header is corrupt."""
    prefix = read_from(f, 8, where, fix)
    if len(prefix) < 8:
        raise InvalidInput(f"{where} is truncated ({len(prefix)} bytes); {_FIX}")
    (n,) = struct.unpack("<Q", prefix)
    if 8 + n > size:
        raise InvalidInput(f"{where} has a corrupt header: its length prefix says {n:,} bytes but the file has "
                           f"{size - 8:,} after the prefix (truncated?); {_FIX}")
    if n > _MAX_HEADER:
        raise InvalidInput(f"{where} has a corrupt header: {n:,} bytes, more than the {_MAX_HEADER:,} allowed; {_FIX}")
    data = read_from(f, n, where, fix)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{where} has a corrupt header: not UTF-8 text (byte {8 + exc.start} is "
                           f"0x{data[exc.start]:02x}); {_FIX}") from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidInput(f"{where} has a corrupt header (not JSON: {exc}); {_FIX}") from None
    if not isinstance(header, dict):
        raise InvalidInput(f"{where} has a corrupt header: a JSON {_kind(header)} where an object of tensors "
                           f"belongs; {_FIX}")
    return header, n


def _metadata(value: object, where: str) -> dict[str, str]:
    """``__metadata__``: absent or null, or an object of strings (the format allows nothing else)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where}: __metadata__ is a JSON {_kind(value)}, expected an object of strings; {_FIX}")
    for key, text in value.items():
        if not isinstance(text, str):
            raise InvalidInput(f"{where}: __metadata__ entry '{key}' is {_shown(text)}, expected a string; {_FIX}")
    return value


def _entry(name: str, info: object, body_size: int, where: str) -> _Entry:
    """One tensor's header entry, checked: a known dtype, a shape, offsets within the data that fit both."""
    tensor = f"{where}: tensor '{name}'"
    if not isinstance(info, dict):
        raise InvalidInput(f"{tensor} is described by {_shown(info)}, expected an object with dtype, shape and "
                           f"data_offsets; {_FIX}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise InvalidInput(f"{tensor} has no '{key}'; {_FIX}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise InvalidInput(f"{tensor} has dtype {_shown(dtype)}, expected a string such as \"F32\"; {_FIX}")
    if dtype not in _ITEMSIZE:
        raise InvalidInput(f"{tensor} has unsupported dtype {_shown(dtype)} (rnnserve reads "
                           f"{', '.join(sorted(_ITEMSIZE))}); {_FIX}")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        raise InvalidInput(f"{tensor} has shape {_shown(shape)}, expected a list of whole numbers >= 0; {_FIX}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise InvalidInput(f"{tensor} has data_offsets {_shown(offsets)}, expected [begin, end] with "
                           f"0 <= begin <= end; {_FIX}")
    start, end = offsets
    if end > body_size:
        raise InvalidInput(f"{tensor} has data_offsets {_shown(offsets)}, past the end of the file's "
                           f"{body_size:,} data bytes (truncated?); {_FIX}")
    need = math.prod(shape) * _ITEMSIZE[dtype]
    if end - start != need:
        raise InvalidInput(f"{tensor} has {end - start:,} bytes at data_offsets {_shown(offsets)}, but dtype {dtype} "
                           f"and shape {_shown(shape)} need {need:,}; {_FIX}")
    return _Entry(name, dtype, tuple(shape), start, end)


def _refuse_bad_layout(entries: list[_Entry], body_size: int, where: str) -> None:
    """Refuse tensors sharing bytes, gaps between them, and bytes after the last: the format packs tensors back
    to back from the start of the data to its end (the safetensors library refuses anything else too), so the
    header was edited or the file is corrupt."""
    spans = sorted(entries, key=lambda e: (e.start, e.end))
    previous: _Entry | None = None
    for e in spans:
        end = previous.end if previous is not None else 0
        if e.start < end:
            raise InvalidInput(f"{where}: tensors '{previous.name}' (bytes {previous.start}-{previous.end}) and "
                               f"'{e.name}' (bytes {e.start}-{e.end}) overlap; {_FIX}")
        if e.start > end:
            after = f"'{previous.name}' ends" if previous is not None else "the data starts"
            raise InvalidInput(f"{where}: tensor '{e.name}' starts at byte {e.start} of the data but {after} at byte "
                               f"{end}: {e.start - end:,} bytes belong to no tensor (the format packs tensors back to "
                               f"back); {_FIX}")
        if e.end > end or previous is None:
            previous = e
    end = previous.end if previous is not None else 0
    if end != body_size:
        raise InvalidInput(f"{where}: {body_size - end:,} bytes follow the last tensor's data (the format ends with "
                           f"it; truncated or appended to?); {_FIX}")


def _whole(value: object) -> bool:
    # bool is an int to Python: `true` must not pass for 1
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: object) -> str:
    """The JSON type name of a parsed value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string"}.get(type(value), "number")


def _shown(value: object) -> str:
    """``value`` as JSON (as the user sees it in the file), cut short when long."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        return f"a JSON {_kind(value)}"
    return text if len(text) <= 60 else text[:57] + "..."

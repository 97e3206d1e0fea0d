"""Loaders: read PyTorch, Keras/TensorFlow and ONNX files into the canonical packed layout.

Each format loader imports its framework lazily; the serving core never needs one.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


from .. import __version__
from ..errors import ConversionError, InvalidInput
from ..repository import PackedModel
from .layers import RecurrentLayer, assemble
from .source import LoadedSource, what_file_is

FORMATS = ("torch", "keras", "onnx")
_EXTENSIONS = {
    ".pt": "torch", ".pth": "torch", ".bin": "torch", ".safetensors": "torch", ".ts": "torch",
    ".keras": "keras", ".h5": "keras", ".hdf5": "keras",
    ".onnx": "onnx",
}


def detect_format(path: Path) -> str:
    """Guess the format from the extension, then from the file's first bytes."""
    ext = path.suffix.lower()
    if ext in _EXTENSIONS:
        return _EXTENSIONS[ext]
    sniffed = what_file_is(path)
    if sniffed is not None:
        return sniffed[0]
    raise ConversionError(
        f"cannot tell the format of '{path.name}' from its extension '{ext}'; pass --format torch|keras|onnx"
    )


def load_source(path: Path, format: str, select: str | None, cell: str | None, **options: Any) -> LoadedSource:
    """Dispatch to the format's loader."""
    if format == "torch":
        from .torch_loader import load_torch

        return load_torch(path, select=select, cell=cell, **options)
    if format == "keras":
        from .keras_loader import load_keras

        return load_keras(path, select=select, cell=cell, **options)
    if format == "onnx":
        from .onnx_loader import load_onnx

        return load_onnx(path, select=select, cell=cell, **options)
    raise InvalidInput(f"unknown format '{format}'; use one of auto, {', '.join(FORMATS)}")


def convert(source: Any, format: str | None = None, select: str | None = None, cell: str | None = None,
            verify: bool = True, **options: Any) -> PackedModel:
    """Convert a source file into a :class:`PackedModel`.

    When the source framework is installed and ``verify`` is true, the source model and
    the converted one run on a probe input; a mismatch raises VerificationError. The
    result's ``provenance['verification']`` records the measured difference.
    """
    path = Path(source)
    try:  # Python 3.11's exists() raises in a folder the user cannot search
        if not path.exists():
            raise ConversionError(f"source file '{path}' does not exist")
        if path.is_dir():
            raise ConversionError(f"'{path}' is a folder; pass the model file itself (.pt, .keras, .h5, .onnx, ...)")
        if not path.is_file():
            raise ConversionError(f"'{path}' is not a regular file (a device, pipe or socket); pass the model file "
                                  f"itself")
        open(path, "rb").close()  # readable: else each framework's loader says "corrupt", or raises its own way
    except OSError as exc:
        raise ConversionError(f"'{path}' cannot be read ({exc.strerror or exc}); give your user read permission "
                              f"on it and on its folders, or convert a copy you can read") from None
    if select is not None and not any(s.strip() for s in select.split(",")):
        raise ConversionError("--select is empty; name the layers to convert (comma separated), or leave it out")
    fmt = detect_format(path) if format in (None, "auto") else format
    loaded = load_source(path, fmt, select, cell, **options)
    spec, buffers, extras = assemble(loaded.layers)
    provenance = {
        "source": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "format": fmt,
        "selection": loaded.selection,
        "converter": f"rnnserve {__version__}",
        "notes": loaded.notes,
        **loaded.details,
    }
    model = PackedModel(spec, buffers, extras, provenance)
    if verify:
        from .verify import verify_against_source

        provenance["verification"] = verify_against_source(model, loaded)
    return model


__all__ = ["convert", "detect_format", "load_source", "LoadedSource", "RecurrentLayer", "assemble", "FORMATS"]

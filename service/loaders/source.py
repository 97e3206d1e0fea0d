"""LoadedSource: what a format loader returns, before packing."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .layers import RecurrentLayer

# run(x [B, T, I] float32, lengths [B] int64) -> output [B, T, D*Ho] of the source framework,
# zeros past each length. Used to verify a conversion on a probe input.
SourceRunner = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass
class LoadedSource:
    """A source model read by a loader: its layers in canonical form and how to run it."""

    format: str                          # "torch" | "keras" | "onnx"
    layers: list[RecurrentLayer]
    selection: list[str]                 # names of the layers/modules/nodes taken
    notes: list[str] = field(default_factory=list)   # assumptions to print (e.g. Keras activation defaults)
    runner: SourceRunner | None = None   # None when the framework is not installed
    ragged_ok: bool = True               # whether ``runner`` honours per-sequence lengths
    details: dict[str, Any] = field(default_factory=dict)
    unchecked_reason: str = ""           # why ``runner`` is None, in words that say what to install
    # (rtol, atol) of the check where the source computes in less than float32 (Keras mixed precision)
    check_tolerance: tuple[float, float] | None = None
    # check(ours) -> record: the whole source file run in its runtime (ONNX; see .onnx_file_check), after ``runner``'s
    file_check: Callable[[Callable[[np.ndarray], tuple]], dict[str, Any]] | None = None
    # what the check ran, where that is less than the source model (a state dict's weights in rebuilt modules)
    check_scope: str = ""


def what_file_is(path: Path) -> tuple[str, str] | None:
    """(format, description) of a file from its content: a .keras archive, a PyTorch zip, HDF5, safetensors or
    ONNX; None when it is none of them. For a file whose extension does not say, and for error messages (it
    may parse the whole file)."""
    import json
    import struct
    import zipfile

    try:
        with path.open("rb") as f:
            head = f.read(9)
        if head.startswith(b"\x89HDF"):
            return "keras", "an HDF5 file (a Keras .h5 save)"
        if head.startswith(b"PK"):
            with zipfile.ZipFile(path) as zf:
                names = set(zf.namelist())
            if {"config.json", "model.weights.h5"} <= names:
                return "keras", "a Keras .keras archive"
            return "torch", "a zip archive (a PyTorch save)"
        if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < path.stat().st_size:
            with path.open("rb") as f:
                f.seek(8)
                json.loads(f.read(struct.unpack("<Q", head[:8])[0]))
            return "torch", "a safetensors file"
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        if model.HasField("graph") and model.graph.node:
            return "onnx", "an ONNX model"
    except Exception:  # noqa: BLE001 - whatever else the file is, it is not one of these
        return None
    return None


def unserved_note(stack: str, holder: str, others: str, part: str | None = None) -> str:
    """The note that the served model is only ``stack`` of the source ``holder`` (model, file, graph), which also
    has ``others``; ``part`` (layer, module) adds how to use it."""
    advice = f": send what the first recurrent {part} reads as 'input', and apply the other {part}s yourself" \
        if part else ""
    return f"only {stack} is converted; the {holder} also has {others}, which rnnserve does not serve{advice}"


def option_flags(options: dict[str, Any]) -> str:
    """Loader options as ``rnnserve convert`` spells them (the API's keyword is the flag without its dashes)."""
    flags = ", ".join(f"--{name.replace('_', '-')}" for name in sorted(options))
    return flags + (" (an option for Keras weights-only files)" if "recurrent_activation" in options else "")

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


def sniff_format(path: Path) -> str | None:
    """The format a file's first bytes show: "keras" (HDF5), "torch" (a zip: torch.save or TorchScript; .keras
    zips have their own extension), else None. Only 8 bytes are read, whatever the file is."""
    with path.open("rb") as f:
        head = f.read(8)
    if head.startswith(b"\x89HDF"):
        return "keras"
    if head.startswith(b"PK"):
        return "torch"
    return None

"""The engine contract shared by every engine, and the argument checks they all apply.

forward(x [B, T, I], lengths [B] | None, h0 [B, L*D, Ho] | None, c0 [B, L*D, H] | None)
  -> output [B, T, D*Ho] (zeros past each length), h_n [B, L*D, Ho], c_n [B, L*D, H] (LSTM only)

State rows are the (layer, direction) pairs of every block in order; c rows count
only LSTM blocks. A model whose blocks have different Ho (or H for LSTM blocks) has
no single state tensor: such a model refuses h0/c0 and returns h_n/c_n as None.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidInput
from ..spec import RNNSpec


@dataclass
class EngineOutput:
    """What an engine returns; arrays are NumPy or, for the GPU engine if asked, CuPy."""

    output: Any
    h_n: Any
    c_n: Any = None


class Engine(ABC):
    """An engine runs one packed model; ``name`` appears in model metadata as the platform."""

    name: str = "engine"
    spec: RNNSpec

    @abstractmethod
    def forward(self, x: Any, lengths: Any = None, h0: Any = None, c0: Any = None) -> EngineOutput:
        """Run the model on a batch; see the module docstring for shapes."""

    def describe(self) -> dict[str, Any]:
        """Facts for `rnnserve inspect` and model metadata."""
        return {"engine": self.name}

    def close(self) -> None:
        """Release device resources (no-op for CPU engines)."""


def check_forward_args(spec: RNNSpec, x: Any, lengths: Any, h0: Any, c0: Any, xp: Any = np) -> tuple[int, int, np.ndarray]:
    """Validate shapes and values; return (B, T, lengths as a host int64 array).

    ``xp`` is the array module of ``x`` (NumPy or CuPy); lengths are always checked on the host.
    """
    if getattr(x, "ndim", None) != 3:
        raise InvalidInput(f"input must have shape [batch, time, features], got shape {tuple(getattr(x, 'shape', ()))}")
    b, t, feat = (int(s) for s in x.shape)
    if b < 1 or t < 1:
        raise InvalidInput(f"input must hold at least one sequence of at least one step, got shape {(b, t, feat)}")
    if feat != spec.input_size:
        raise InvalidInput(f"input has {feat} features per step, the model expects {spec.input_size}")
    if x.dtype.kind != "f":
        raise InvalidInput(f"input must be a floating-point tensor, got {x.dtype}")
    if lengths is None:
        lens = np.full(b, t, dtype=np.int64)
    else:
        lens_arr = lengths.get() if hasattr(lengths, "get") else np.asarray(lengths)
        if lens_arr.shape != (b,):
            raise InvalidInput(f"lengths must have shape [{b}] (one per sequence), got {tuple(lens_arr.shape)}")
        if lens_arr.dtype.kind not in "iu":
            raise InvalidInput(f"lengths must be integers, got {lens_arr.dtype}")
        lens = lens_arr.astype(np.int64)
        if lens.min() < 1 or lens.max() > t:
            bad = int(np.flatnonzero((lens < 1) | (lens > t))[0])
            raise InvalidInput(
                f"lengths[{bad}] = {int(lens[bad])} is out of range: every length must be between 1 and T = {t}"
            )
    _check_state(spec, "h0", h0, b, spec.state_layers, spec.state_size)
    if c0 is not None and not spec.is_lstm:
        raise InvalidInput("c0 is only for LSTM models; this model has no cell state")
    _check_state(spec, "c0", c0, b, spec.cell_state_layers, spec.cell_state_size)
    return b, t, lens


def _check_state(spec: RNNSpec, name: str, arr: Any, b: int, rows: int, width: int | None) -> None:
    if arr is None:
        return
    if width is None:
        raise InvalidInput(f"{name} is not supported for this model: its blocks have different state sizes")
    shape = tuple(int(s) for s in arr.shape)
    if shape != (b, rows, width):
        raise InvalidInput(f"{name} must have shape [{b}, {rows}, {width}] ([batch, layers*directions, size]), got {list(shape)}")

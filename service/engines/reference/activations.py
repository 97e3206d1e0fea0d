"""Gate activation functions, applied in place, with ONNX's alpha/beta meanings.

Names are lower snake case (``hard_sigmoid``). Keras 2's ``hard_sigmoid`` is
``clip(0.2*x + 0.5, 0, 1)``, ONNX HardSigmoid with its default alpha=0.2, beta=0.5;
Keras 3's is ``relu6(x + 3) / 6``, the same function with alpha=1/6, beta=0.5.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ...errors import InvalidInput

# ONNX defaults for alpha/beta (onnx/defs/rnn/defs.cc, Operators.md).
DEFAULTS: dict[str, tuple[float, float]] = {
    "sigmoid": (0.0, 0.0), "tanh": (0.0, 0.0), "relu": (0.0, 0.0), "softsign": (0.0, 0.0), "softplus": (0.0, 0.0),
    "hard_sigmoid": (0.2, 0.5), "affine": (1.0, 0.0), "leaky_relu": (0.01, 0.0), "thresholded_relu": (1.0, 0.0),
    "scaled_tanh": (1.0, 1.0), "elu": (1.0, 0.0),
}

InPlace = Callable[[np.ndarray], None]


def _sigmoid(a: np.ndarray) -> None:
    # One tanh is cheaper than exp + add + reciprocal, and never overflows.
    a *= 0.5
    np.tanh(a, out=a)
    a *= 0.5
    a += 0.5


def _tanh(a: np.ndarray) -> None:
    np.tanh(a, out=a)


def _relu(a: np.ndarray) -> None:
    np.maximum(a, 0, out=a)


def make_activation(spec: dict | str | None, default: str) -> InPlace:
    """Return an in-place function for ``spec`` ({"name", "alpha", "beta"} or a name); None means ``default``."""
    if spec is None:
        spec = default
    if isinstance(spec, str):
        spec = {"name": spec}
    name = str(spec.get("name", "")).lower()
    if name not in DEFAULTS:
        raise InvalidInput(f"activation '{name}' is not supported; supported: {', '.join(sorted(DEFAULTS))}")
    da, db = DEFAULTS[name]
    alpha = float(spec.get("alpha", da) if spec.get("alpha") is not None else da)
    beta = float(spec.get("beta", db) if spec.get("beta") is not None else db)

    if name == "sigmoid":
        return _sigmoid
    if name == "tanh":
        return _tanh
    if name == "relu":
        return _relu
    if name == "hard_sigmoid":
        def hard_sigmoid(a: np.ndarray) -> None:
            a *= alpha
            a += beta
            np.clip(a, 0.0, 1.0, out=a)
        return hard_sigmoid
    if name == "affine":
        def affine(a: np.ndarray) -> None:
            a *= alpha
            a += beta
        return affine
    if name == "leaky_relu":
        return lambda a: np.copyto(a, np.where(a >= 0, a, a * alpha))
    if name == "thresholded_relu":
        return lambda a: np.copyto(a, np.where(a > alpha, a, 0.0))
    if name == "scaled_tanh":
        def scaled_tanh(a: np.ndarray) -> None:
            a *= beta
            np.tanh(a, out=a)
            a *= alpha
        return scaled_tanh
    if name == "elu":
        return lambda a: np.copyto(a, np.where(a >= 0, a, alpha * np.expm1(np.minimum(a, 0))))
    if name == "softsign":
        return lambda a: np.copyto(a, a / (1 + np.abs(a)))
    # softplus, computed without overflow
    return lambda a: np.copyto(a, np.logaddexp(0, a))

"""rnnserve: serve LSTM, GRU and RNN models with cuDNN (or NumPy), over the Open Inference Protocol."""
from __future__ import annotations

from typing import Any

from .repository import PackedModel, load_model
from .spec import BlockSpec, RNNSpec

__version__ = "0.1.0"


def convert(source: Any, format: str | None = None, select: str | None = None, cell: str | None = None,
            **options: Any) -> PackedModel:
    """Convert a PyTorch, Keras or ONNX file into a :class:`PackedModel` (see :mod:`service.loaders`)."""
    from .loaders import convert as _convert

    return _convert(source, format=format, select=select, cell=cell, **options)


def create_engine(model: PackedModel, device: str = "cpu", **options: Any):
    """Create an engine for ``model`` on "cpu", "cuda" or "auto" (see :mod:`service.engines`)."""
    from .engines import create_engine as _create

    return _create(model, device, **options)


__all__ = ["convert", "load_model", "create_engine", "PackedModel", "RNNSpec", "BlockSpec", "__version__"]

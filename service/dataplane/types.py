"""Protocol types of the Open Inference Protocol (V2), independent of any transport.

REST and gRPC convert their wire formats to and from these, then call the one
:class:`service.dataplane.DataPlane`. Tensor data is always a NumPy array here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidInput
from ..wire import wire

# V2 datatype name <-> NumPy dtype (BYTES and BF16 are not used by rnnserve's models).
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
_NAMES = {v: k for k, v in DATATYPES.items()}


def numpy_dtype(datatype: str) -> np.dtype:
    """NumPy dtype of a V2 datatype name, or InvalidInput naming the supported ones."""
    try:
        return DATATYPES[datatype]
    except KeyError:
        raise InvalidInput(
            f"datatype '{datatype}' is not supported; use one of {', '.join(DATATYPES)}"
        ) from None


def datatype_of(arr: np.ndarray) -> str:
    """V2 datatype name of a NumPy array."""
    return _NAMES[np.dtype(arr.dtype)]


@dataclass
class InferTensor:
    """A named tensor with its V2 datatype, shape and data (a NumPy array of that shape)."""

    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)

    def __reduce__(self) -> tuple:
        # Tensors cross the socket between front-ends and the engine process (see service.wire).
        return (InferTensor, (self.name, self.datatype, self.shape, wire(self.data), self.parameters))


@dataclass
class RequestedOutput:
    """An output the client asked for, with its per-output parameters (e.g. binary_data)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """A decoded inference request."""

    model_name: str
    model_version: str = ""
    id: str = ""
    inputs: list[InferTensor] = field(default_factory=list)
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferResponse:
    """An inference response before wire encoding."""

    model_name: str
    model_version: str
    id: str = ""
    outputs: list[InferTensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)

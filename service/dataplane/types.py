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
        # every rnnserve model takes the same tensors, so name what they take, not every type the protocol has
        raise InvalidInput(
            f"datatype '{datatype}' is not supported; rnnserve's models take FP32, FP16 or FP64 for input, h_0 and "
            f"c_0, and INT32 or INT64 for lengths"
        ) from None


# No request comes near this many values; past 2**63 NumPy cannot even describe an empty array of the
# shape (a zero dimension beside two of 2**40 made np.zeros and reshape raise, a 500 before this check).
MAX_SHAPE_PRODUCT = 2 ** 48
# rnnserve's tensors have 1 to 3 dimensions; NumPy cannot make an array of more than 64 (a 500 before this check).
MAX_DIMENSIONS = 8


# A model takes at most 4 inputs (input, lengths, h_0, c_0) and gives at most 4 outputs; a request naming more
# holds duplicates or unknown names, which validation refuses. Refused here, before any entry is decoded: a gRPC
# message of millions of empty output entries (16 KB gzip'd) held the event loop for a minute decoding them.
MAX_TENSORS = 16


def check_tensor_count(kind: str, count: int) -> None:
    """InvalidInput if a request lists more than :data:`MAX_TENSORS` ``kind`` (inputs or outputs)."""
    if count > MAX_TENSORS:
        raise InvalidInput(f"request lists {count:,} {kind}; a model takes at most 4 inputs (input, lengths, h_0, "
                           f"c_0) and gives at most 4 outputs (output, output_last, h_n, c_n): name each once")


def check_shape_size(name: str, shape: list[int]) -> None:
    """InvalidInput if input ``name``'s ``shape`` has more than :data:`MAX_DIMENSIONS` dimensions, or if its
    non-zero dimensions multiply past :data:`MAX_SHAPE_PRODUCT`."""
    if len(shape) > MAX_DIMENSIONS:
        raise InvalidInput(f"input '{name}' has {len(shape)} dimensions; rnnserve's tensors have 1 to 3 "
                           f"(input [batch, steps, features], lengths [batch], h_0/c_0 [batch, layers, hidden])")
    product = 1
    for d in shape:
        product *= d or 1
    if product > MAX_SHAPE_PRODUCT:
        raise InvalidInput(f"input '{name}' has shape {shape}, whose dimensions multiply to more than 2**48; "
                           f"send the tensor's real shape")


def refuse_extensions(parameters: dict[str, Any], where: str) -> None:
    """InvalidInput for a tensor parameter of a protocol extension rnnserve does not implement and that a
    server ignoring it would answer wrongly: shared memory (the data is not in the request, or the client
    reads its answer from a region nobody wrote) and classification (raw values where classes were asked)."""
    if "shared_memory_region" in parameters:
        raise InvalidInput(f"{where} uses the shared-memory extension (shared_memory_region), which rnnserve does "
                           f"not support; send the data in the request (tritonclient: leave out set_shared_memory)")
    if "classification" in parameters:
        raise InvalidInput(f"{where} asks for classification (class_count), which rnnserve does not do; ask for "
                           f"the output itself and take the top classes on the client")


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


@dataclass(frozen=True)
class AnswerLimit:
    """How large the transport can send a request's answer, so that validation refuses it before it runs.

    ``value_bytes``: what one number of an output costs on the wire (``default`` for outputs it
    does not name; 0: not held to the limit). ``trimmed``: ``output`` goes back cut to each
    sequence's length (/v1 predict) rather than padded to T. ``remedy``: what the client can
    ask for instead; ``what``: the limit's name in the message.
    """

    limit: int
    default: int
    remedy: str
    value_bytes: dict[str, int] = field(default_factory=dict)
    trimmed: bool = False
    what: str = "the server's limit on answers"
    # bytes of the answer's message besides its tensors and the request's echoed texts (names, shapes, framing)
    overhead: int = 0


@dataclass
class InferRequest:
    """A decoded inference request; ``answer_limit``: the transport's bound on its answer, if any; ``caller``: the
    transport's token for the call that sent it, for stream chunks (0: none; see
    :class:`~service.dataplane.validation.StreamRequest`)."""

    model_name: str
    model_version: str = ""
    id: str = ""
    inputs: list[InferTensor] = field(default_factory=list)
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    answer_limit: AnswerLimit | None = None
    caller: int = 0


@dataclass
class InferResponse:
    """An inference response before wire encoding."""

    model_name: str
    model_version: str
    id: str = ""
    outputs: list[InferTensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)

"""gRPC wire messages <-> protocol types (:mod:`service.dataplane.types`).

Requests may carry tensor data either as ``raw_input_contents`` (little-endian
bytes per input, in input order; what ``tritonclient.grpc`` sends) or as typed
``contents`` (``fp32_contents``, ``int64_contents``, ...), never both in one
request. Responses always use ``raw_output_contents``, as Triton does: it is what
``tritonclient`` reads, and it avoids a per-element copy into repeated fields.

Every rejection is an :class:`~service.errors.InvalidInput` whose message names the
tensor and says what to change.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ...dataplane.types import (
    InferRequest,
    InferResponse,
    InferTensor,
    RequestedOutput,
    check_shape_size,
    check_tensor_count,
    numpy_dtype,
    refuse_extensions,
)
from ...errors import InvalidInput
from .generated import inference_pb2 as pb

# V2 datatype -> the InferTensorContents field that carries it. FP16 (and BF16)
# have no typed field in the protocol: they travel only as raw bytes.
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}

# The element type of each InferTensorContents field.
_FIELD_DTYPE: dict[str, np.dtype] = {
    "bool_contents": np.dtype(np.bool_), "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64), "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64), "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}

_INT64_MAX = 2**63 - 1


def decode_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """An InferParameter (or ModelRepositoryParameter) map as a plain dict.

    Unset parameters (no oneof member chosen) are left out. Triton's ``sequence_id``
    arrives as int64, uint64 or string and is kept as int or str.
    """
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(value, which)
    return out


def encode_parameters(params: Mapping[str, Any], target) -> None:
    """Write a plain dict into an InferParameter map (bool, int, float, str values)."""
    for key, value in params.items():
        entry = target[key]
        if isinstance(value, bool) or isinstance(value, np.bool_):
            entry.bool_param = bool(value)
        elif isinstance(value, (int, np.integer)):
            value = int(value)
            if value > _INT64_MAX:
                entry.uint64_param = value
            else:
                entry.int64_param = value
        elif isinstance(value, (float, np.floating)):
            entry.double_param = float(value)
        else:
            entry.string_param = str(value)


def _shape(name: str, dims) -> list[int]:
    shape = [int(d) for d in dims]
    if any(d < 0 for d in shape):
        raise InvalidInput(f"input '{name}' has shape {shape}; every dimension must be >= 0")
    check_shape_size(name, shape)
    return shape


def _from_raw(name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray:
    dtype = numpy_dtype(datatype)
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise InvalidInput(
            f"input '{name}' has {len(raw)} bytes of raw data, but shape {shape} of "
            f"{datatype} needs {expected} bytes ({math.prod(shape)} x {dtype.itemsize})"
        )
    # Zero-copy view of the message's bytes (read-only); little-endian on the wire.
    arr = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape)
    return arr.astype(dtype, copy=False)


def _from_contents(name: str, datatype: str, shape: list[int], tensor) -> np.ndarray:
    dtype = numpy_dtype(datatype)
    count = math.prod(shape)
    present = [field.name for field, _ in tensor.contents.ListFields()] if tensor.HasField("contents") else []
    if not present:
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        raise InvalidInput(
            f"input '{name}' has no data: send it in raw_input_contents or in contents"
        )
    expected_field = CONTENTS_FIELD.get(datatype)
    if expected_field is None:
        raise InvalidInput(
            f"input '{name}' is {datatype}, which has no typed contents field; "
            "send it in raw_input_contents"
        )
    if present != [expected_field]:
        raise InvalidInput(
            f"input '{name}' is {datatype}, so its data goes in contents.{expected_field}; "
            f"got {', '.join('contents.' + p for p in present)}"
        )
    values = getattr(tensor.contents, expected_field)
    if len(values) != count:
        raise InvalidInput(
            f"input '{name}' has {len(values)} values in contents.{expected_field}, "
            f"but shape {shape} needs {count}"
        )
    wide = np.array(values, dtype=_FIELD_DTYPE[expected_field])
    if dtype.kind in "iu" and wide.size and dtype.itemsize < wide.dtype.itemsize:
        # NumPy would wrap 300 to 44 as UINT8 silently.
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise InvalidInput(
                f"input '{name}' has a value in contents.{expected_field} out of range for "
                f"{datatype} ({info.min}..{info.max})"
            )
    return wide.astype(dtype, copy=False).reshape(shape)


def decode_request(msg: pb.ModelInferRequest) -> InferRequest:
    """A ModelInferRequest as an :class:`InferRequest`, validating the tensor data."""
    check_tensor_count("inputs", len(msg.inputs))
    check_tensor_count("outputs", len(msg.outputs))
    raw = msg.raw_input_contents
    if raw:
        typed = [t.name for t in msg.inputs if t.HasField("contents")]
        if typed:
            raise InvalidInput(
                "request mixes raw_input_contents with typed contents (input "
                f"{', '.join(repr(n) for n in typed)}); send all inputs one way"
            )
        if len(raw) != len(msg.inputs):
            raise InvalidInput(
                f"request has {len(msg.inputs)} inputs but {len(raw)} raw_input_contents; "
                "send one raw_input_contents entry per input, in input order"
            )

    inputs: list[InferTensor] = []
    for i, tensor in enumerate(msg.inputs):
        params = decode_parameters(tensor.parameters)
        refuse_extensions(params, f"input '{tensor.name}'")
        shape = _shape(tensor.name, tensor.shape)
        if raw:
            data = _from_raw(tensor.name, tensor.datatype, shape, raw[i])
        else:
            data = _from_contents(tensor.name, tensor.datatype, shape, tensor)
        inputs.append(
            InferTensor(
                name=tensor.name,
                datatype=tensor.datatype,
                shape=shape,
                data=data,
                parameters=params,
            )
        )

    outputs = [
        RequestedOutput(name=o.name, parameters=decode_parameters(o.parameters))
        for o in msg.outputs
    ] or None

    return InferRequest(
        model_name=msg.model_name,
        model_version=msg.model_version,
        id=msg.id,
        inputs=inputs,
        outputs=outputs,
        parameters=decode_parameters(msg.parameters),
    )


def encode_response(response: InferResponse) -> pb.ModelInferResponse:
    """An :class:`InferResponse` as a ModelInferResponse with raw output contents."""
    msg = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=str(response.model_version),
        id=response.id,
    )
    encode_parameters(response.parameters, msg.parameters)
    for tensor in response.outputs:
        dtype = numpy_dtype(tensor.datatype)
        data = np.asarray(tensor.data)
        # (an output's parameters are the request's options for it, binary_data and the like, which the REST
        # encoder reads; repeated here they were unbounded text in the answer, past the message limit)
        msg.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=list(data.shape))
        msg.raw_output_contents.append(
            np.ascontiguousarray(data, dtype=dtype.newbyteorder("<")).tobytes()
        )
    return msg

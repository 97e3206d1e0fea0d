"""V2 REST wire format <-> protocol types: JSON tensors and the binary tensor extension.

Binary extension (what ``tritonclient.http`` sends by default): the body is a JSON
header of ``Inference-Header-Content-Length`` bytes followed by the raw
little-endian tensors of every input whose parameters hold ``binary_data_size``, in
input order. An output is returned raw when its parameters say ``binary_data:
true``, or when the request's parameters say ``binary_data_output: true`` and the
output does not say otherwise; the response then carries the same header and is
``application/octet-stream``.
"""
from __future__ import annotations

import functools
import json
import math
import sys
from typing import Any

import numpy as np

from ...dataplane.types import (AnswerLimit, InferRequest, InferResponse, InferTensor, RequestedOutput, check_shape_size,
                                check_tensor_count, numpy_dtype, refuse_extensions)
from ...dataplane.validation import bool_parameter, out_of_range
from ...errors import InvalidInput
from ...json_keys import unique_keys
from .responses import JSON_VALUE_BYTES

HEADER = "Inference-Header-Content-Length"
_NO_REPEATS = unique_keys("request body gives")


def parse_json(body: bytes | str) -> Any:
    """``body`` as a JSON document, or an :class:`InvalidInput` that says why it is not one.

    Nesting deeper than Python's recursion limit is refused like any other bad JSON (the
    decoder raises RecursionError there, which would otherwise become a 500)."""
    try:
        doc = json.loads(body, object_pairs_hook=_NO_REPEATS)
    except (ValueError, UnicodeDecodeError) as exc:
        if "integer string conversion" in str(exc):
            # Python's own message names sys.set_int_max_str_digits, a remedy for the server, not the client
            raise InvalidInput(f"request body holds an integer literal of more than {sys.get_int_max_str_digits():,} "
                               f"digits; send numbers of ordinary size (tensor values within their datatype's "
                               f"range)") from None
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("request body is not valid JSON for this server: it nests arrays or objects "
                           "too deeply; send tensor data as a flat list (or nested only as deep as its shape)") from None
    # JSON may escape half of a UTF-16 surrogate pair on its own ("\ud800"), which decodes to a string no
    # UTF-8 can hold: quoted in an answer or an error it made that answer fail. Only a body with such an
    # escape is walked (a byte search first: one in a string is rare, and a walk visits every value).
    escapes = (b"\\ud", b"\\uD") if isinstance(body, bytes) else ("\\ud", "\\uD")
    if any(escape in body for escape in escapes):
        _refuse_lone_surrogates(doc)
    return doc


def _refuse_lone_surrogates(doc: Any) -> None:
    stack = [doc]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = value[exc.start:exc.end].encode("utf-8", "backslashreplace").decode("ascii")
                raise InvalidInput(f"request body holds a string with a lone UTF-16 surrogate ({bad}), which is not "
                                   f"Unicode text; send names, ids and parameters as valid UTF-8") from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(v for v in value if isinstance(v, (str, dict, list)))


def header_length(values: list[str]) -> int | None:
    """The value of the binary extension's header (None when absent), or InvalidInput when it is no integer or
    it came more than once with different values (a proxy keeping the other one would read another request)."""
    if not values:
        return None
    if len({v.strip() for v in values}) > 1:
        raise InvalidInput(f"header {HEADER} came {len(values)} times with different values ({', '.join(values)}); "
                           f"send it once")
    text = values[0]
    digits = text.strip()
    # ASCII digits only: int() also takes '+1', '1_000', other scripts' digits, and fails past 4,300 digits
    if not (digits.isascii() and digits.removeprefix("-").isdigit() and len(digits) <= 19):
        raise InvalidInput(f"header {HEADER} must be an integer, got '{text}'")
    return int(digits)


def decode_request(body: bytes, n: int | None, model: str, version: str) -> InferRequest:
    """Parse a V2 infer request body: JSON, or (``n``: the :func:`header_length`) a JSON header of ``n`` bytes
    and binary tensors."""
    if n is not None:
        if n < 0:
            raise InvalidInput(f"header {HEADER} is {n}; it must be the JSON header's length in bytes (>= 0)")
        if n > len(body):
            raise InvalidInput(f"header {HEADER} is {n} but the body has only {len(body)} bytes")
        head, binary = body[:n], memoryview(body)[n:]
    else:
        head, binary = body, memoryview(b"")
    if len(head) < 64 and not head.strip():  # (a short test: strip copies, and bodies run to megabytes)
        if n is None:
            raise InvalidInput("request body is empty; send a JSON object with an 'inputs' list")
        raise InvalidInput(f"header {HEADER} is {n}, so the request has no JSON header; set it to the length in "
                           f"bytes of the JSON that starts the body")
    try:
        doc = parse_json(head)
    except InvalidInput as exc:
        # JSON followed by more bytes, or bytes that are no text: what binary tensors without the header look like
        if n is None and ("Extra data" in exc.message or "codec can't decode" in exc.message):
            raise InvalidInput(f"{exc.message} (a body with binary tensors after its JSON needs the {HEADER} "
                               f"header)") from None
        raise
    if not isinstance(doc, dict):
        raise InvalidInput("request body must be a JSON object with an 'inputs' list")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("request needs a non-empty 'inputs' list, e.g. "
                           '{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2, 3], "data": [...]}]}')
    check_tensor_count("inputs", len(raw_inputs))
    offset = 0
    inputs = []
    # NumPy reads [true, 3] as [1, 3]: data is scanned for booleans only when the JSON holds a literal at all
    booleans = b"true" in head or b"false" in head
    for item in raw_inputs:
        tensor, used = _decode_input(item, binary, offset, booleans)
        offset += used
        inputs.append(tensor)
    if offset != len(binary):
        raise InvalidInput(f"the body holds {len(binary) - offset} bytes of binary data that no input claims "
                           f"(check each input's binary_data_size)")
    outputs = None
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise InvalidInput("'outputs' must be a list of {\"name\": ...} objects")
        check_tensor_count("outputs", len(doc["outputs"]))
        outputs = []
        for o in doc["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InvalidInput("each entry of 'outputs' needs a 'name' string")
            params = parameters_of(o, f"output '{o['name']}'")
            bool_parameter(params, "binary_data", f"output '{o['name']}'")  # a string would pick the other encoding
            outputs.append(RequestedOutput(o["name"], params))
    params = parameters_of(doc, "request")
    bool_parameter(params, "binary_data_output", "request")
    request_id = doc.get("id")
    if request_id is None:  # absent, or null as some JSON encoders write an unset field
        request_id = ""
    elif not isinstance(request_id, str):
        # echoed back in the answer: a number or object would come back as Python's text of it
        raise InvalidInput(f"request 'id' must be a string, got {json.dumps(request_id)[:40]}")
    return InferRequest(model, version, request_id, inputs, outputs, params)


def parameters_of(obj: dict, where: str) -> dict[str, Any]:
    """The ``parameters`` object of a JSON request part (``where`` names it in the error), {} when absent."""
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidInput(f"{where} 'parameters' must be a JSON object")
    return params


def _decode_input(item: Any, binary: memoryview, offset: int, booleans: bool = True) -> tuple[InferTensor, int]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise InvalidInput("each input needs a 'name' string, a 'datatype', a 'shape' and 'data'")
    name = item["name"]
    datatype = item.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input '{name}' needs a 'datatype' string such as \"FP32\"")
    dtype = numpy_dtype(datatype)
    shape = item.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise InvalidInput(f"input '{name}' needs a 'shape' list of non-negative integers, got {shape!r}")
    check_shape_size(name, shape)
    count = math.prod(shape)
    params = parameters_of(item, f"input '{name}'")
    refuse_extensions(params, f"input '{name}'")
    size = params.get("binary_data_size")
    if size is not None:
        if "data" in item:
            # one of the two would be dropped without a word, and the caller cannot know which one ran
            raise InvalidInput(f"input '{name}' has both 'data' and a binary_data_size parameter; send its values "
                               f"one way: JSON 'data', or binary_data_size with the bytes after the JSON header")
        need = count * dtype.itemsize
        if not isinstance(size, int) or size != need:
            raise InvalidInput(f"input '{name}' has binary_data_size {size!r} but shape {shape} of {datatype} "
                               f"needs {need} bytes")
        if offset + size > len(binary):
            raise InvalidInput(f"input '{name}' needs {size} bytes of binary data but only "
                               f"{len(binary) - offset} remain in the body")
        arr = np.frombuffer(binary[offset:offset + size], dtype=dtype.newbyteorder("<")).reshape(shape)
        return InferTensor(name, datatype, shape, arr, params), size
    if "data" not in item:
        raise InvalidInput(f"input '{name}' has neither 'data' nor a binary_data_size parameter")
    arr = _json_values(name, datatype, dtype, item["data"], booleans, shape)
    if arr.size != count:
        raise InvalidInput(f"input '{name}' has {arr.size} values but shape {shape} needs {count}")
    return InferTensor(name, datatype, shape, arr.reshape(shape), params), 0


def _json_values(name: str, datatype: str, dtype: np.dtype, data: Any, booleans: bool = True,
                 shape: list[int] | None = None) -> np.ndarray:
    """The JSON ``data`` of an input as an array of ``dtype`` (InvalidInput saying what to change).

    Integer types take whole numbers only (3 or 3.0), in range: NumPy would cut 2.7 to 2 (a length
    silently wrong) and raise OverflowError, not ValueError, past the type's range. ``booleans``: the
    data may hold true/false among numbers (NumPy reads them as 1 and 0), so it is scanned for them.
    """
    try:
        raw = np.asarray(data)
        if raw.size == 0:
            return raw.astype(dtype)
        if dtype.kind == "b":
            if raw.dtype.kind != "b":
                raise InvalidInput(f"input '{name}' is BOOL: its data must be JSON true or false")
            return raw
        if booleans and raw.dtype.kind in "iuf" and _holds_bool(data):
            raise InvalidInput(f"input '{name}' is {datatype}: its data must be JSON numbers, got true or false "
                               f"among them (no booleans, strings or nulls)")
        if dtype.kind not in "iu":
            if raw.dtype == object:
                raw = _big_integers(name, datatype, raw)
            # NumPy would read true as 1.0 and "2.5" as 2.5; JSON numbers only, as Triton takes them.
            if raw.dtype.kind not in "iuf":
                raise InvalidInput(f"input '{name}' is {datatype}: its data must be JSON numbers "
                                   f"within its range (no booleans, strings or nulls)")
            try:
                # the cast flags a finite number past FP16's or FP32's range (no extra pass over the data)
                with np.errstate(over="raise"):
                    return raw.astype(dtype, copy=False)
            except FloatingPointError:
                raise _past_range(name, datatype, dtype, raw, shape) from None
        info = np.iinfo(dtype)
        whole = raw.dtype.kind in "iu" or (
            raw.dtype.kind == "f" and bool(np.all(np.isfinite(raw) & (raw == np.round(raw)))))
        if not whole or raw.min() < info.min or raw.max() > info.max:
            raise InvalidInput(f"input '{name}' is {datatype}: its data must be whole numbers from {info.min} to "
                               f"{info.max} (no fractions, booleans or strings)")
        return raw.astype(dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"input '{name}' data cannot be read as {datatype} (nested lists must be "
                           f"rectangular numbers within its range): {exc}") from exc


def _past_range(name: str, datatype: str, dtype: np.dtype, raw: np.ndarray, shape: list[int] | None) -> InvalidInput:
    """The error naming the first finite value of ``raw`` that ``dtype`` cannot hold (not "NaN or infinite")."""
    with np.errstate(over="ignore"):
        past = (~np.isfinite(raw.astype(dtype)) & np.isfinite(raw)).ravel()
    first = int(np.flatnonzero(past)[0])
    # named by its index in the tensor, as validation names others (flat JSON data has none)
    index = [int(i) for i in np.unravel_index(first, shape)] \
        if shape is not None and raw.size == math.prod(shape) else [first]
    return out_of_range(f"input '{name}' has {raw.ravel()[first].item()!r} at index {index}", datatype)


def _big_integers(name: str, datatype: str, raw: np.ndarray) -> np.ndarray:
    """An object array NumPy made of integer literals past int64, as float64 (a float input takes them: 1e20
    written out in digits is a number like any other); anything else in it is left for the caller to refuse."""
    flat = raw.ravel()
    if not all(type(v) is int for v in flat):
        return raw
    try:
        return np.array([float(v) for v in flat], np.float64).reshape(raw.shape)
    except OverflowError:
        raise InvalidInput(f"input '{name}' is {datatype}: an integer in its data is too large for any float; "
                           f"send values within its range") from None


def _holds_bool(data: Any) -> bool:
    """Whether ``data`` (a number or nested lists of them) holds a JSON boolean."""
    if isinstance(data, list):
        return any(v is True or v is False or (isinstance(v, list) and _holds_bool(v)) for v in data)
    return isinstance(data, bool)


def _binary(parameters: dict[str, Any], default_binary: bool) -> bool:
    """Whether an output with these parameters is sent as binary data (else as JSON)."""
    return bool(parameters.get("binary_data", default_binary))


@functools.lru_cache(maxsize=64)
def _uniform_limit(limit: int, default_binary: bool) -> AnswerLimit:
    # every output sent one way: one AnswerLimit per (limit, way), not one per request
    return AnswerLimit(limit, 0 if default_binary else JSON_VALUE_BYTES, _REMEDY, what=_WHAT)


_REMEDY = ("ask for binary outputs (parameter binary_data_output, as tritonclient does by default) or only "
           "output_last instead of output")
_WHAT = "the server's limit on JSON answers"


def answer_limit(request: InferRequest, limit: int) -> AnswerLimit:
    """The bound on ``request``'s answer: outputs sent as JSON take ~20 bytes a number (:data:`JSON_VALUE_BYTES`)
    and may come to at most ``limit`` bytes; binary outputs are not held to it."""
    default_binary = bool(request.parameters.get("binary_data_output", False))
    named = [o for o in request.outputs or [] if "binary_data" in o.parameters]
    if not named:
        return _uniform_limit(limit, default_binary)
    cost = {o.name: 0 if _binary(o.parameters, default_binary) else JSON_VALUE_BYTES for o in named}
    return AnswerLimit(limit, 0 if default_binary else JSON_VALUE_BYTES, _REMEDY, cost, what=_WHAT)


def json_values(response: InferResponse, request_parameters: dict[str, Any]) -> int:
    """How many numbers :func:`encode_response` writes as JSON text (binary outputs are copied, not encoded)."""
    default_binary = bool(request_parameters.get("binary_data_output", False))
    return sum(t.data.size for t in response.outputs if not _binary(t.parameters, default_binary))


def encode_response(response: InferResponse, request_parameters: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """Body and headers of a V2 infer response; binary outputs follow the JSON header."""
    default_binary = bool(request_parameters.get("binary_data_output", False))
    outputs = []
    blobs: list[bytes] = []
    for t in response.outputs:
        binary = _binary(t.parameters, default_binary)
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if binary:
            raw = np.ascontiguousarray(t.data, dtype=t.data.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = np.asarray(t.data).ravel().tolist()
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs
    head = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {"content-type": "application/octet-stream", HEADER: str(len(head))}

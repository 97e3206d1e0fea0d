"""`POST /v1/models/{model}:predict`: ragged JSON instances for curl users.

Each instance is one sequence, a list of feature vectors of its own length; no
padding on the client. The server pads them into one batch with per-sequence
lengths (one request, batched with everyone else's) and trims each ``output``
back to its own length.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, ValidationError

from ...dataplane.types import AnswerLimit, InferRequest, InferResponse, InferTensor, RequestedOutput
from ...dataplane.validation import out_of_range
from ...errors import InvalidInput
from .codec import parse_json
from .responses import JSON_VALUE_BYTES

PredictOutput = Literal["output", "output_last", "h_n", "c_n"]


class PredictRequest(BaseModel):
    """Sequences to run, each a list of feature vectors (lengths may differ)."""

    # extra keys refused: a "parameters": {"timeout": ...} meant for V2 was dropped without a word
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"instances": [[[0.0], [0.2], [0.39]], [[0.9]]]},  # the bundled forecaster takes one feature a step
        {"instances": [[[0.0], [0.2]]], "outputs": ["output_last", "h_n"]},
    ]})

    # Strict: JSON numbers only (lax mode would read true as 1.0 and "2.5" as 2.5).
    instances: list[list[list[StrictFloat]]] = Field(
        ..., description="One entry per sequence: a list of time steps, each a list of the model's input features.")
    outputs: list[PredictOutput] | None = Field(
        None, description="Outputs to return per instance; default output_last and output.")
    signature_name: str | None = Field(
        None, description="Accepted and not used (TensorFlow Serving clients send it): a model has one signature.")


class PredictResponse(BaseModel):
    """One prediction per instance, in order."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"predictions": [{"output_last": [0.12, -0.3], "output": [[0.05, -0.1], [0.12, -0.3]]},
                         {"output_last": [0.2, 0.01], "output": [[0.2, 0.01]]}]},
    ]})

    predictions: list[dict[str, Any]] = Field(
        ..., description="Per instance: output_last [D*Ho], output [its length, D*Ho], and h_n/c_n if asked.")


def parse_predict(raw: bytes) -> PredictRequest:
    """The body of a predict request, or InvalidInput naming each problem."""
    try:
        doc = parse_json(raw)  # not model_validate_json: it keeps the last of a repeated key, as Python's json did
    except InvalidInput as exc:  # its message names the request body already
        raise InvalidInput(exc.message if exc.message.startswith("request body") else
                           f"invalid request body: {exc.message}") from None
    try:
        return PredictRequest.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(
            f"unknown key '{e['loc'][0]}': a predict body takes 'instances' and optionally 'outputs' and 'signature_name' (request "
            f"parameters such as 'timeout' go to /v2/models/{{model}}/infer)" if e["type"] == "extra_forbidden"
            else f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise InvalidInput(f"invalid request body: {problems}") from None


def to_infer_request(model: str, body: PredictRequest, limit: int | None = None) -> InferRequest:
    """Pad the instances into one V2 request with a lengths input; ``limit``: bytes its JSON answer may take."""
    if not body.instances:
        raise InvalidInput("'instances' is empty; send at least one sequence")
    lengths = []
    width = None
    for i, seq in enumerate(body.instances):
        if not seq:
            raise InvalidInput(f"instances[{i}] has no time steps; every sequence needs at least one")
        for t, step in enumerate(seq):
            if width is None:
                width = len(step)
                if not width:
                    raise InvalidInput(f"instances[{i}][{t}] has no features; every time step needs the model's "
                                       f"input features")
            if len(step) != width:
                raise InvalidInput(f"instances[{i}][{t}] has {len(step)} features but instances[0][0] has {width}; "
                                   f"every time step needs the same number of features")
        lengths.append(len(seq))
    t_max = max(lengths)
    x = np.zeros((len(lengths), t_max, width or 0), dtype=np.float32)
    for i, seq in enumerate(body.instances):
        try:
            # the cast flags a finite number past FP32's range (NaN and inf are validation's to refuse)
            with np.errstate(over="raise"):
                x[i, :lengths[i]] = seq
        except FloatingPointError:
            exact = np.asarray(seq, dtype=np.float64)
            t, f = (int(k) for k in np.argwhere(np.isfinite(exact) & (np.abs(exact) > np.finfo(np.float32).max))[0])
            raise out_of_range(f"instances[{i}][{t}][{f}] is {float(exact[t, f])!r}",
                               note="the models compute in FP32, ") from None
    lens = np.asarray(lengths, dtype=np.int64)
    outputs = [RequestedOutput(n) for n in (body.outputs or ["output_last", "output"])]
    bound = None if limit is None else AnswerLimit(
        limit, JSON_VALUE_BYTES, 'ask for "outputs": ["output_last"] (the default also sends every step\'s output)',
        trimmed=True, what="the server's limit on JSON answers")
    return InferRequest(model, "", "", [
        InferTensor("input", "FP32", list(x.shape), x),
        InferTensor("lengths", "INT64", [len(lengths)], lens),
    ], outputs, answer_limit=bound)


def to_predictions(response: InferResponse, lengths: list[int]) -> dict[str, Any]:
    """Split the batched response per instance, trimming ``output`` to each instance's length."""
    preds: list[dict[str, Any]] = [{} for _ in lengths]
    for t in response.outputs:
        for i, n in enumerate(lengths):
            row = t.data[i]
            preds[i][t.name] = (row[:n] if t.name == "output" else row).tolist()
    return {"predictions": preds}


def decode_predict(raw: bytes, model: str, limit: int | None = None) -> tuple[InferRequest, list[int]]:
    """A predict body as one padded V2 request and its instances' lengths (the JSON helper runs it for large
    bodies: parsing and padding both hold the GIL throughout, ~0.9 s for 1.28 million numbers)."""
    body = parse_predict(raw)
    return to_infer_request(model, body, limit), [len(s) for s in body.instances]


def encode_predictions(response: InferResponse, lengths: list[int]) -> bytes:
    """The predict answer's JSON body (the JSON helper runs it for large answers)."""
    return json.dumps(to_predictions(response, lengths), separators=(",", ":")).encode()

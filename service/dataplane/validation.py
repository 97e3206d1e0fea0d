"""Request validation: an :class:`InferRequest` becomes a :class:`SequenceWork` or an InvalidInput.

Every message names the tensor, what was sent and what to send instead, so a user
can fix the request without reading the server's code.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidInput, TooLarge
from ..scheduler import SequenceWork
from .signature import FLOAT_TYPES, INT_TYPES, ModelSignature
from .types import DATATYPES, InferRequest, InferTensor, refuse_extensions

def request_deadline(parameters: dict[str, Any]) -> float | None:
    """``time.monotonic()`` deadline from the request's ``timeout`` parameter (µs), or None."""
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, str)):
        raise InvalidInput(f"parameter 'timeout' must be a number of microseconds, got {timeout!r}")
    try:
        micros = float(timeout)
    except (ValueError, OverflowError):  # OverflowError: an integer past float's range
        raise InvalidInput(f"parameter 'timeout' must be a number of microseconds, got {timeout!r}") from None
    if not np.isfinite(micros) or micros < 0:
        raise InvalidInput(f"parameter 'timeout' must be a finite number >= 0 of microseconds, got {timeout!r}")
    if micros == 0:
        return None
    return time.monotonic() + micros / 1e6


@dataclass(frozen=True)
class StreamRequest:
    """The stream a request belongs to: its key and whether it starts or ends it; ``caller``: the transport's
    token for the call that sent it (0: none), so that a chunk's undelivered answer ends only the stream instance
    that call moved (see :meth:`service.scheduler.streams.StreamStore.end`)."""

    key: str
    start: bool
    end: bool
    caller: int = 0


MAX_SEQUENCE_ID_CHARS = 1024


def stream_request(parameters: dict[str, Any], caller: int = 0) -> StreamRequest | None:
    """The request's stream from Triton's sequence_id/start/end parameters (id 0 or "" means none); ``caller``:
    see :class:`StreamRequest`."""
    seq = parameters.get("sequence_id")
    start, end = (bool_parameter(parameters, n) for n in ("sequence_start", "sequence_end"))
    if seq in (None, 0, ""):
        if start or end:
            raise InvalidInput("sequence_start/sequence_end need a non-zero 'sequence_id' parameter")
        return None
    if isinstance(seq, bool) or not isinstance(seq, (int, str)) or (isinstance(seq, int) and not 0 < seq < 2**64):
        raise InvalidInput(f"parameter 'sequence_id' must be a uint64 or a string, got {seq!r}")
    if isinstance(seq, str) and len(seq) > MAX_SEQUENCE_ID_CHARS:
        # the server keeps ended streams' ids to answer their late chunks: megabyte ids held gigabytes
        raise InvalidInput(f"parameter 'sequence_id' is a string of {len(seq)} characters; at most "
                           f"{MAX_SEQUENCE_ID_CHARS} (a key that names the stream, not data)")
    key = f"{seq}" if isinstance(seq, int) else f"'{seq}'"
    return StreamRequest(key, start, end, caller)


def bool_parameter(parameters: dict[str, Any], name: str, where: str = "") -> bool:
    """Parameter ``name`` (False when absent), or InvalidInput unless it is a boolean: ``bool("false")`` is True.

    ``where``: whose parameter it is in the message (e.g. "output 'output'"), for ones not of the request.
    """
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"{where + ' ' if where else ''}parameter '{name}' must be true or false, got {value!r}")
    return value


def to_work(request: InferRequest, sig: ModelSignature, max_sequence_length: int,
            stream: StreamRequest | None = None) -> SequenceWork:
    """Validate ``request`` against the model's signature; return the batched form of its sequences."""
    model = request.model_name
    tensors: dict[str, InferTensor] = {}
    allowed = sig.input_names
    for t in request.inputs:
        if t.name not in allowed:
            hint = " (this model has no cell state)" if t.name == "c_0" else ""
            raise InvalidInput(
                f"unknown input '{t.name}' for model '{model}'{hint}; its inputs are {', '.join(allowed)}"
            )
        if t.name in tensors:
            raise InvalidInput(f"input '{t.name}' is given twice; send each input once")
        if tuple(np.shape(t.data)) != tuple(t.shape):
            raise InvalidInput(f"input '{t.name}' declares shape {list(t.shape)} but holds {list(np.shape(t.data))}")
        tensors[t.name] = t
    if "input" not in tensors:
        raise InvalidInput(f"input 'input' is missing; model '{model}' needs 'input' of shape [batch, time, "
                           f"{sig.input_size}] (FP32)")
    x = _float_tensor(tensors["input"], model)
    if x.ndim != 3:
        raise InvalidInput(f"input 'input' must have 3 dimensions [batch, time, features], got shape {list(x.shape)}")
    b, t, feat = x.shape
    if b < 1:
        raise InvalidInput("input 'input' has an empty batch (batch dimension 0); send at least one sequence")
    if t < 1:
        raise InvalidInput("input 'input' has 0 time steps; send at least one step per sequence")
    if feat != sig.input_size:
        raise InvalidInput(f"input 'input' has {feat} features, model '{model}' expects {sig.input_size}")
    if t > max_sequence_length:
        raise InvalidInput(f"input 'input' has {t} time steps, model '{model}' accepts at most {max_sequence_length} "
                           f"(max_sequence_length); split the sequence")
    if stream is not None:
        if not sig.causal:
            raise InvalidInput(f"model '{model}' reads sequences backwards (bidirectional or reverse), so a chunk "
                               f"would need the chunks after it; send whole sequences without sequence_id")
        if b != 1:
            raise InvalidInput(f"a stream request carries one sequence (batch 1), got batch {b}; "
                               f"send other sequences as their own streams")
        if not stream.start:
            for name in ("h_0", "c_0"):
                if name in tensors:
                    raise InvalidInput(f"input '{name}' can only start a stream (with sequence_start): later chunks "
                                       f"continue from the state the server keeps")
    lengths = _lengths(tensors.get("lengths"), b, t)
    h0 = _state(tensors.get("h_0"), b, sig.state_rows, sig.state_size, model)
    c0 = _state(tensors.get("c_0"), b, sig.cell_rows, sig.cell_size, model)
    return SequenceWork(x, lengths, h0, c0, requested_outputs(request, sig))


def check_answer(request: InferRequest, work: SequenceWork, sig: ModelSignature) -> None:
    """TooLarge when the answer to ``request`` would be over its transport's :class:`AnswerLimit`.

    Checked before the request runs, so that it costs no engine time and counts as refused:
    an answer can hold far more numbers than its request (``output`` is [B, T, D*Ho] for an
    input of [B, T, I]).
    """
    bound = request.answer_limit
    if bound is None:
        return
    b = work.sequences
    steps = int(work.lengths.sum()) if bound.trimmed else b * int(work.x.shape[1])
    values = {"output": steps * sig.output_size, "output_last": b * sig.output_size,
              "h_n": b * sig.state_rows * (sig.state_size or 0), "c_n": b * sig.cell_rows * (sig.cell_size or 0)}
    size = sum(values[name] * bound.value_bytes.get(name, bound.default) for name in work.outputs)
    # the answer repeats these; a long id alone once took an answer over gRPC's limit after it had run
    size += bound.overhead + sum(len(text.encode()) for text in (request.id, request.model_name, request.model_version))
    if size > bound.limit:
        raise TooLarge(
            f"the answer of model '{request.model_name}' would take about {size:,} bytes "
            f"({', '.join(_count(n, values[n]) for n in sorted(work.outputs))}), over {bound.what} "
            f"of {bound.limit:,} bytes (--max-request-bytes); {bound.remedy}, or send fewer or shorter sequences")


def _count(name: str, values: int) -> str:
    return f"{name}: {values:,} number" + ("" if values == 1 else "s")


def requested_outputs(request: InferRequest, sig: ModelSignature) -> frozenset[str]:
    """Names of the outputs to compute: the request's list, or all when it names none."""
    names = sig.output_names
    if not request.outputs:
        return frozenset(names)
    seen: set[str] = set()
    for out in request.outputs:
        if out.name in seen:
            raise InvalidInput(f"output '{out.name}' is requested twice; ask for each output once")
        seen.add(out.name)
        if out.name not in names:
            raise InvalidInput(
                f"unknown output '{out.name}' for model '{request.model_name}'; its outputs are {', '.join(names)}"
            )
        refuse_extensions(out.parameters, f"output '{out.name}'")
    return frozenset(o.name for o in request.outputs)


def out_of_range(subject: str, datatype: str = "FP32", note: str = "") -> InvalidInput:
    """The error for a finite value past ``datatype``'s range (it became inf when cast), ``subject`` naming it
    ("input 'input' has 1e+39 at index [0, 0, 0]"): the one wording of every decoder and of validation."""
    top = float(np.finfo(DATATYPES[datatype]).max)
    return InvalidInput(f"{subject}, outside {datatype}'s range ({note}up to about {top:.4g}); send values within it")


def _float_tensor(t: InferTensor, model: str) -> np.ndarray:
    if t.datatype not in FLOAT_TYPES:
        raise InvalidInput(f"input '{t.name}' has datatype {t.datatype}; send {', '.join(FLOAT_TYPES)}")
    arr = np.asarray(t.data)
    with np.errstate(over="ignore"):  # an FP64 value past FP32's range becomes inf, refused just below
        out = np.asarray(arr, dtype=np.float32, order="C")  # (ascontiguousarray makes a scalar 1-d: shape [] read [1])
    if not np.isfinite(out).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(out))[0])
        if np.isfinite(arr[bad]):
            raise out_of_range(f"input '{t.name}' has {float(arr[bad])!r} at index {list(bad)}",
                               note="the models compute in FP32, ")
        raise InvalidInput(f"input '{t.name}' contains NaN or infinite values (first at index {list(bad)}); "
                           f"send finite numbers")
    return out


def _lengths(t: InferTensor | None, b: int, steps: int) -> np.ndarray:
    if t is None:
        return np.full(b, steps, dtype=np.int64)
    if t.datatype not in INT_TYPES:
        raise InvalidInput(f"input 'lengths' has datatype {t.datatype}; send INT32 or INT64")
    lens = np.asarray(t.data).astype(np.int64).reshape(-1) if np.ndim(t.data) == 1 else None
    if lens is None or lens.shape != (b,):
        raise InvalidInput(f"input 'lengths' must have shape [{b}] (one length per sequence), got {list(t.shape)}")
    bad = np.flatnonzero((lens < 1) | (lens > steps))
    if bad.size:
        i = int(bad[0])
        raise InvalidInput(f"lengths[{i}] = {int(lens[i])} is out of range: every length must be between 1 and "
                           f"T = {steps} (the time dimension of 'input')")
    return lens


def _state(t: InferTensor | None, b: int, rows: int, width: int | None, model: str) -> np.ndarray | None:
    if t is None:
        return None
    arr = _float_tensor(t, model)
    if width is None or tuple(arr.shape) != (b, rows, width):
        raise InvalidInput(f"input '{t.name}' must have shape [{b}, {rows}, {width}] "
                           f"([batch, layers*directions, size]) for model '{model}', got {list(arr.shape)}")
    return arr

"""A request against a model view: validated on the way in, answered on the way out.

:class:`ModelView` is what validating and answering a request needs to know about the
model version that will run it, without the registry: its signature, its limits, and
a ``generation`` that identifies the loaded version. The engine process's
:class:`~service.dataplane.DataPlane` uses it for its own requests; a front-end
process (``rnnserve serve --frontends N``) fetches it once per model, validates and
answers requests itself with :func:`prepare` and :func:`respond`, and sends the engine
process only the :class:`Prepared` work. The engine process checks the generation, so
work validated against a version that was since unloaded or replaced is refused
(:class:`~service.errors.StaleModelView`) rather than run on a different model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..scheduler import MemoryBudget, SequenceWork
from .signature import ModelSignature
from .types import InferRequest, InferResponse, InferTensor, datatype_of
from .validation import StreamRequest, check_answer, request_deadline, stream_request, to_work

@dataclass(frozen=True)
class ModelView:
    """One loaded model version as requests see it."""

    name: str
    label: str
    generation: int
    signature: ModelSignature
    max_sequence_length: int
    max_batch_size: int
    budget: MemoryBudget
    frontend_in_flight: int = 2  # messages a front-end's lane keeps in the engine process (see .coalesce)
    max_queue_size: int | None = None  # requests a front-end's lane keeps waiting at most (see .coalesce)


@dataclass
class Prepared:
    """A validated request: its sequences, its deadline (``time.monotonic()``, or None) and its stream.

    ``requests`` > 1: the work of that many client requests that a front-end process merged
    (:mod:`.coalesce`); the engine process counts each of them in its metrics.
    """

    work: SequenceWork
    deadline: float | None
    stream: StreamRequest | None
    requests: int = 1

    def __reduce__(self) -> tuple:  # sent to the engine process with every request: no per-field dict
        return (Prepared, (self.work, self.deadline, self.stream, self.requests))


def prepare(request: InferRequest, view: ModelView) -> Prepared:
    """Validate ``request`` against ``view`` (InvalidInput or TooLarge, saying what to change)."""
    deadline = request_deadline(request.parameters)
    stream = stream_request(request.parameters, request.caller)
    work = to_work(request, view.signature, view.max_sequence_length, stream)
    view.budget.check(work.sequences, work.steps, view.name)
    check_answer(request, work, view.signature)
    return Prepared(work, deadline, stream)


def respond(request: InferRequest, view: ModelView, results: dict[str, np.ndarray]) -> InferResponse:
    """The response to ``request``: its outputs in the order it asked (all in signature order when none)."""
    params: dict[str, Any] = {o.name: o.parameters for o in (request.outputs or [])}
    order = [o.name for o in request.outputs] if request.outputs else view.signature.output_names
    outputs = []
    for name in order:
        if name in results:
            arr = results[name]
            outputs.append(InferTensor(name, datatype_of(arr), list(arr.shape), arr, dict(params.get(name, {}))))
    return InferResponse(view.name, view.label, request.id, outputs)

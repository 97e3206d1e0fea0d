"""DataPlane: the one implementation of the inference protocol behind every transport.

REST and gRPC decode their wire format into :mod:`.types`, call a method here, and
encode what it returns; errors are :mod:`service.errors` exceptions that carry their
status. Validation, model lookup, readiness and request metrics live only here.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from .. import __version__
from ..engines.base import split_block_states
from ..errors import RNNServeError, Unavailable
from ..metrics import ServerMetrics
from ..registry import ModelRegistry, ModelState, ServedVersion
from ..scheduler import SequenceWork
from .signature import ModelSignature
from .types import InferRequest, InferResponse, InferTensor, datatype_of
from .validation import StreamRequest, request_deadline, stream_request, to_work

log = logging.getLogger("rnnserve.dataplane")

EXTENSIONS = ["binary_tensor_data", "model_repository", "sequence"]


class DataPlane:
    """Health, metadata, inference and repository control over a :class:`ModelRegistry`."""

    def __init__(self, registry: ModelRegistry, metrics: ServerMetrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._stopping = False
        # Bound counter/histogram series by labels: a labels() lookup takes a lock and hashes the
        # labels on every request. Counters and histograms are never removed, so these stay valid;
        # the keys are served (model, version) pairs and outcomes, plus model "" for unknown names.
        self._series: dict[tuple, Any] = {}
        self._signatures: dict[int, tuple[Any, ModelSignature]] = {}

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the repository's models (the server is live meanwhile, ready afterwards)."""
        await self.registry.start()

    def begin_drain(self) -> None:
        """Report not-ready from now on (load balancers stop routing) while in-flight requests finish."""
        self._stopping = True

    async def stop(self, drain: bool = True) -> None:
        """Stop serving: run (``drain``) or refuse what waits in the schedulers, then release engines."""
        self._stopping = True
        await self.registry.stop(drain)

    # ---- health and metadata -------------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return not self._stopping and self.registry.ready()

    def server_metadata(self) -> dict:
        return {"name": "rnnserve", "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str = "") -> dict:
        served = self.registry.version(name, version)
        if served.model is None:
            self.registry.serving(name, version)  # raises Unavailable with the reason
        entry = self.registry.entry(name)
        versions = sorted(v for v, sv in entry.versions.items() if sv.state == ModelState.READY)
        sig = self._signature(served.model.spec)
        return {
            "name": name,
            "versions": [str(v) for v in versions],
            "platform": served.platform,
            "inputs": [t.to_dict() for t in sig.inputs],
            "outputs": [t.to_dict() for t in sig.outputs],
        }

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            served = self.registry.version(name, version)
        except Unavailable:  # a known model folder with no version to serve
            return False
        return served.state == ModelState.READY

    # ---- inference --------------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate, queue for batching, and answer one request."""
        start = time.perf_counter()
        known = request.model_name in self.registry.names()
        model_label, version_label = (request.model_name if known else ""), ""
        try:
            served = self.registry.serving(request.model_name, request.model_version)
            model_label, version_label = served.name, served.label
            sig = self._signature(served.model.spec)
            deadline = request_deadline(request.parameters)
            stream = stream_request(request.parameters)
            work = to_work(request, sig, served.config.max_sequence_length, stream)
            if stream is None:
                results = await served.scheduler.submit(work, deadline)
            else:
                results = await self._stream_chunk(served, stream, work, deadline)
        except RNNServeError as exc:
            self._count(model_label, version_label, exc.status.lower())
            raise
        except Exception as exc:
            log.exception("request to model %s failed", request.model_name)
            self._count(model_label, version_label, "internal")
            raise RNNServeError(f"model '{request.model_name}' failed: {type(exc).__name__}: {exc}") from exc
        params = {o.name: o.parameters for o in (request.outputs or [])}
        order = [o.name for o in request.outputs] if request.outputs else sig.output_names
        outputs = []
        for name in order:
            if name in results:
                arr = results[name]
                outputs.append(InferTensor(name, datatype_of(arr), list(arr.shape), arr, dict(params.get(name, {}))))
        self._count(model_label, version_label, "success")
        self._bound("duration", model_label, version_label).observe(time.perf_counter() - start)
        return InferResponse(served.name, served.label, request.id, outputs)

    async def _stream_chunk(self, served: ServedVersion, stream: StreamRequest, work: SequenceWork,
                            deadline: float | None) -> dict:
        """Run one chunk of a stream from the state the previous chunk left (or its own h_0/c_0); keep the new state.

        The state stays in the engine's arrays (GPU memory for the cuDNN engine): the
        scheduler gathers the states of every stream chunk in a batch, runs the batch
        with per-block states and scatters the new ones back (see :mod:`service.scheduler.batching`).
        """
        store = served.streams
        state = store.open(stream.key, stream.start)
        async with state.lock:
            store.check_live(state)
            work.stream = True
            if stream.start:
                given = work.h0 is not None or work.c0 is not None
                work.states = split_block_states(served.model.spec, work.h0, work.c0) if given else None
                work.h0 = work.c0 = None
            else:
                work.states = state.states
            try:
                results = await served.scheduler.submit(work, deadline)
            except BaseException:
                if stream.start:
                    store.close(state, "failed on its first chunk", "error")
                raise
            if not state.ended:
                state.states = work.states_out
                state.last_used = time.monotonic()
            self.metrics.stream_chunk_timesteps.labels(model=served.name, version=served.label).observe(work.steps)
            if stream.end:
                store.close(state)
        return results

    def _signature(self, spec: Any) -> ModelSignature:
        """The signature of a loaded model's spec, built once per spec (it is read on every request)."""
        hit = self._signatures.get(id(spec))
        if hit is None or hit[0] is not spec:  # the stored spec is kept, so its id cannot be reused meanwhile
            if len(self._signatures) > 1024:  # loads and reloads over a long life
                self._signatures.clear()
            hit = self._signatures[id(spec)] = (spec, ModelSignature.of(spec))
        return hit[1]

    def _count(self, model: str, version: str, outcome: str) -> None:
        # Requests for unknown models are counted under model "" so clients cannot create series at will.
        self._bound("requests", model, version, outcome).inc()

    def _bound(self, kind: str, model: str, version: str, outcome: str = "") -> Any:
        key = (kind, model, version, outcome)
        series = self._series.get(key)
        if series is None:
            if kind == "requests":
                series = self.metrics.requests.labels(model=model, version=version, outcome=outcome)
            else:
                series = self.metrics.request_duration.labels(model=model, version=version)
            self._series[key] = series
        return series

    # ---- repository extension --------------------------------------------------------------------------------

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        return self.registry.index(ready_only)

    async def load_model(self, name: str) -> None:
        await self.registry.load(name)

    async def unload_model(self, name: str) -> None:
        await self.registry.unload(name)

"""DataPlane: the one implementation of the inference protocol behind every transport.

REST and gRPC decode their wire format into :mod:`.types`, call a method here, and
encode what it returns; errors are :mod:`service.errors` exceptions that carry their
status. Validation, model lookup, readiness and request metrics live only here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any

from .. import __version__
from ..errors import InvalidInput, RNNServeError, StaleModelView, Unavailable
from ..metrics import ServerMetrics, observe_many
from ..registry import ModelRegistry, ModelState, ServedVersion, check_serving
from ..scheduler import SequenceWork
from ..scheduler.streams import StreamState
from .model_config import triton_model_config
from .signature import ModelSignature
from .statistics import version_statistics
from .types import InferRequest, InferResponse
from .validation import StreamRequest, stream_request
from .view import ModelView, Prepared, prepare, respond

log = logging.getLogger("rnnserve.dataplane")

EXTENSIONS = ["binary_tensor_data", "model_repository", "sequence", "model_configuration", "statistics"]


class DataPlane:
    """Health, metadata, inference and repository control over a :class:`ModelRegistry`."""

    def __init__(self, registry: ModelRegistry, metrics: ServerMetrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._stopping = False
        # Bound counter/histogram series by labels: a labels() lookup takes a lock and hashes the
        # labels on every request. The keys are served (model, version) pairs and outcomes, plus model ""
        # for unknown names; a version whose series are removed (it left the index) is let go of here.
        self._series: dict[tuple, Any] = {}
        self.metrics.on_drop.append(self._forget_series)
        self._signatures: dict[int, tuple[Any, ModelSignature]] = {}
        self._views: dict[int, ModelView] = {}
        self._changes: set[asyncio.Task] = set()  # loads and unloads under way (see _to_its_end)

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

    # Coroutines, as every transport awaits them: in a front-end process they are round trips to the
    # engine process (service.dataplane.remote), which must not hold up the front-end's event loop.

    async def live(self) -> bool:
        return True

    async def ready(self) -> bool:
        return not self._stopping and self.registry.ready()

    async def server_metadata(self) -> dict:
        return {"name": "rnnserve", "version": __version__, "extensions": list(EXTENSIONS)}

    async def model_metadata(self, name: str, version: str = "") -> dict:
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

    async def model_config(self, name: str, version: str = "") -> dict:
        """Triton's configuration of the version serving ``name``/``version`` (see :mod:`.model_config`)."""
        served = self.registry.serving(name, version)
        return triton_model_config(served, self._signature(served.model.spec))

    async def model_statistics(self, name: str = "", version: str = "") -> list[dict]:
        """Triton's statistics of every ready version (no ``name``), of a model's ready versions (no
        ``version``), or of one version (see :mod:`.statistics`)."""
        if version and not name:
            raise InvalidInput(f"statistics of version '{version}' need a model name; leave out the version for "
                               f"every model's statistics")
        if version:
            versions = [self.registry.serving(name, version)]
        else:
            entries = [self.registry.entry(n) for n in ([name] if name else self.registry.names())]
            versions = [sv for entry in entries for _, sv in sorted(entry.versions.items())
                        if sv.state == ModelState.READY]
        return [version_statistics(self.metrics, sv.name, sv.label) for sv in versions]

    async def model_ready(self, name: str, version: str = "") -> bool:
        try:
            served = self.registry.version(name, version)
        except Unavailable:  # a known model folder with no version to serve
            return False
        return served.state == ModelState.READY

    # ---- inference --------------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate, queue for batching, and answer one request."""
        start = time.perf_counter()
        served = None
        try:
            # the version first: a refusal for a version that is not ready is counted under it
            served = self.registry.version(request.model_name, request.model_version)
            check_serving(served)
            view = self._view(served)
            prepared = prepare(request, view)
        except RNNServeError as exc:
            self._count_refused(request.model_name, served, exc)
            raise
        except Exception as exc:
            log.exception("request to model %s failed", request.model_name)
            err = RNNServeError(f"model '{request.model_name}' failed: {type(exc).__name__}: {exc}")
            self._count_refused(request.model_name, served, err)
            raise err from exc
        try:
            results = await self._submit(served, prepared, start)
        except RNNServeError:
            raise
        except Exception as exc:  # counted as "internal" by _finished
            raise RNNServeError(f"model '{request.model_name}' failed: {type(exc).__name__}: {exc}") from exc
        return respond(request, view, results)

    def model_view(self, name: str, version: str = "") -> ModelView:
        """The view of the version that serves ``name``/``version`` now (NotFound / Unavailable as for infer)."""
        return self._view(self.registry.serving(name, version))

    def submit_prepared(self, name: str, version: str, generation: int, prepared: Prepared) -> asyncio.Future:
        """Queue work a front-end process validated against :meth:`model_view`; the future gets the outputs.

        StaleModelView (not counted: the front-end sends the request again whole) when the
        version serving ``name``/``version`` is no longer the one of ``generation``.
        """
        start = time.perf_counter()
        served = None
        try:
            served = self.registry.version(name, version)
            check_serving(served)
            if served.generation != generation:
                raise StaleModelView(f"model '{name}' version {served.label} was reloaded while the request was sent")
        except StaleModelView:
            raise
        except RNNServeError as exc:
            self._count_refused(name, served, exc, prepared.requests)
            raise
        return self._submit(served, prepared, start)

    def _submit(self, served: ServedVersion, prepared: Prepared, start: float) -> asyncio.Future:
        """Queue validated work on ``served``; the future's outcome is counted when it settles."""
        try:
            if prepared.stream is None:
                fut = served.scheduler.enqueue(prepared.work, prepared.deadline, prepared.requests)
            else:
                fut = self._stream_chunk(served, prepared.stream, prepared.work, prepared.deadline)
        except RNNServeError as exc:
            self._count(served.name, served.label, exc.status.lower(), prepared.requests)
            raise
        fut.add_done_callback(partial(self._finished, served.name, served.label, start, prepared.requests))
        return fut

    def _finished(self, model: str, version: str, start: float, requests: int, fut: asyncio.Future) -> None:
        if fut.cancelled():  # the client went away (a gRPC cancel or deadline, a stream chunk's HTTP client)
            self._count(model, version, "cancelled", requests)
            return
        exc = fut.exception()
        elapsed = time.perf_counter() - start
        if exc is None:
            self._count(model, version, "success", requests)
            observe_many(self._bound("duration", model, version), elapsed, requests)
            self._bound("last", model, version).set(time.time())
            return
        if isinstance(exc, RNNServeError):
            self._count(model, version, exc.status.lower(), requests)
        else:
            log.error("request to model %s failed", model, exc_info=exc)
            self._count(model, version, "internal", requests)
        self._bound("failed", model, version).inc(elapsed * requests)

    def count_outcome(self, model: str, version: str, outcome: str, requests: int) -> None:
        """Count ``requests`` of a served ``model``/``version`` that a front-end process settled itself: refused
        because its own queue was full (``unavailable``), or cancelled before it sent them (``cancelled``)."""
        self._count(model, version, outcome, requests)

    def set_frontend_waiting(self, model: str, version: str, requests: int, chunks: int = 0) -> None:
        """``requests`` of ``model``/``version`` wait in the front-end processes, as they last reported, ``chunks``
        of them stream chunks (while any wait, none of the version's streams expires)."""
        if not self._serves(model, version):
            return  # a report (or a lost front-end's reset) after the version stopped: don't bring its series back
        self.metrics.frontend_queue_depth.labels(model=model, version=version).set(requests)
        streams = self.registry.version(model, version).streams
        if streams is not None:
            streams.frontends_waiting = chunks

    def _serves(self, model: str, version: str) -> bool:
        """Whether ``model``/``version`` is loaded (has a scheduler), as its per-version gauges are."""
        try:
            served = self.registry.version(model, version)
        except RNNServeError:
            return False
        return served.label == version and served.scheduler is not None

    def _count_refused(self, name: str, served: ServedVersion | None, exc: RNNServeError, requests: int = 1) -> None:
        """Count ``requests`` refused before they were queued (unknown names under model "")."""
        if served is not None:
            model, version = served.name, served.label
        else:
            model, version = (name if name in self.registry.names() else ""), ""
        self._count(model, version, exc.status.lower(), requests)

    def _view(self, served: ServedVersion) -> ModelView:
        view = self._views.get(served.generation)
        if view is None:
            if len(self._views) > 1024:  # loads and reloads over a long life
                self._views.clear()
            view = self._views[served.generation] = ModelView(
                served.name, served.label, served.generation, self._signature(served.model.spec),
                served.config.max_sequence_length, served.config.max_batch_size, served.budget,
                served.config.frontend_in_flight, served.config.max_queue_size)
        return view

    def _stream_chunk(self, served: ServedVersion, stream: StreamRequest, work: SequenceWork,
                      deadline: float | None) -> asyncio.Future:
        """Run one chunk of a stream from the state the previous chunk left (or its own h_0/c_0); keep the new state.

        The state stays in the stream's slot of the engine's state pool (GPU memory for the
        cuDNN engine): a batch gathers the states of its stream chunks from their slots, runs,
        and scatters the new ones back (see :mod:`service.scheduler.batching`). A first chunk
        starts from its own h_0/c_0 (validation lets only first chunks carry them) or zeros.

        The stream's :class:`~service.scheduler.streams.Turn` keeps its chunks in order: a chunk
        that finds it free is queued now (the returned future is the scheduler's, settled by a
        done-callback); one behind an earlier chunk of its stream waits in a task. A chunk
        cancelled while it waits for its turn changes nothing; one cancelled once queued or running
        ends its stream (its state may or may not include the chunk).
        """
        state = served.streams.open(stream.key, stream.start)
        if state.turn.take_now():
            return self._queue_chunk(served, state, stream, work, deadline)
        store, limit = served.streams, served.scheduler.max_queue_size
        if store.waiting_chunks >= limit:
            # chunks behind their stream's turn wait outside the scheduler's queue; without this bound 3,000
            # concurrent chunks of one stream were all held (each up to --max-request-bytes)
            raise Unavailable(f"model '{served.name}' is overloaded: {store.waiting_chunks} stream chunks wait for "
                              f"their stream's earlier chunks (max_queue_size {limit}); send a stream's next chunk "
                              f"once the previous one is answered, or retry later")
        waiting = _Waiting(store)
        task = asyncio.ensure_future(self._chunk_after_turn(served, state, stream, work, deadline, waiting))
        task.add_done_callback(waiting.leave)  # also when cancelled before it ever ran
        return task

    async def _chunk_after_turn(self, served: ServedVersion, state: StreamState, stream: StreamRequest,
                                work: SequenceWork, deadline: float | None, waiting: _Waiting) -> dict:
        try:
            await state.turn.take()
        finally:
            waiting.leave()
        return await self._queue_chunk(served, state, stream, work, deadline)

    def _queue_chunk(self, served: ServedVersion, state: StreamState, stream: StreamRequest, work: SequenceWork,
                     deadline: float | None) -> asyncio.Future:
        """Queue a chunk whose stream's turn it holds; :meth:`_chunk_done` passes the turn on."""
        store = served.streams
        try:
            store.check_live(state)
            work.pool, work.slot, work.resume = store.pool, state.slot, not stream.start
            fut = served.scheduler.enqueue(work, deadline)
        except BaseException:
            if stream.start:
                store.close(state, "failed on its first chunk", "error")
            state.turn.give()
            raise
        state.running = True
        # Registered first, so the stream is settled before anyone is answered (a client's next
        # chunk can only follow the answer).
        fut.add_done_callback(partial(self._chunk_done, served, state, stream, work.steps))
        return fut

    def _chunk_done(self, served: ServedVersion, state: StreamState, stream: StreamRequest, steps: int,
                    fut: asyncio.Future) -> None:
        store = served.streams
        state.running = False
        store.settle(state)  # a stream ended meanwhile (unload, expiry) gets its slot back now
        if fut.cancelled():
            store.close(state, "was ended because one of its chunks was cancelled before it was answered (the "
                               "client went away), so its state is unknown", "error")
        elif fut.exception() is not None:
            if stream.start:
                store.close(state, "failed on its first chunk", "error")
        else:
            state.last_caller = stream.caller
            if not state.ended:
                state.last_used = time.monotonic()
            self._bound("chunk_steps", served.name, served.label).observe(steps)
            if stream.end:
                store.close(state)
        state.turn.give()

    async def end_stream(self, model: str, version: str, parameters: dict[str, Any], why: str, caller: int) -> None:
        """End the stream a request's ``parameters`` name, on the version that answered it, with ``why``, if the
        last chunk it ran came from ``caller`` (the token the transport sent that chunk with).

        A transport calls it when it could not deliver a stream chunk's answer (its call ended first): the
        stream's state has moved past a chunk its client never saw, so a resent chunk would run on the wrong
        state. Nothing happens for a stateless request, a stream that is not live, or a stream the client has
        restarted (or moved on) from another call since: that one's state is what its client knows.
        """
        try:
            stream = stream_request(parameters)
            served = self.registry.version(model, version)
        except RNNServeError:
            return
        if stream is not None and served.streams is not None:
            served.streams.end(stream.key, why, caller)

    def _signature(self, spec: Any) -> ModelSignature:
        """The signature of a loaded model's spec, built once per spec (it is read on every request)."""
        hit = self._signatures.get(id(spec))
        if hit is None or hit[0] is not spec:  # the stored spec is kept, so its id cannot be reused meanwhile
            if len(self._signatures) > 1024:  # loads and reloads over a long life
                self._signatures.clear()
            hit = self._signatures[id(spec)] = (spec, ModelSignature.of(spec))
        return hit[1]

    def _forget_series(self, model: str, version: str) -> None:
        """The series of ``model``/``version`` were removed (the version left the index): bind new ones if it comes
        back, rather than count into the removed ones."""
        for key in [k for k in self._series if k[1] == model and k[2] == version]:
            del self._series[key]

    def _count(self, model: str, version: str, outcome: str, requests: int = 1) -> None:
        # Requests for unknown models are counted under model "" so clients cannot create series at will.
        self._bound("requests", model, version, outcome).inc(requests)

    def _bound(self, kind: str, model: str, version: str, outcome: str = "") -> Any:
        key = (kind, model, version, outcome)
        series = self._series.get(key)
        if series is None:
            if kind == "requests":
                series = self.metrics.requests.labels(model=model, version=version, outcome=outcome)
            elif kind == "chunk_steps":
                series = self.metrics.stream_chunk_timesteps.labels(model=model, version=version)
            elif kind == "last":
                series = self.metrics.last_inference.labels(model=model, version=version)
            elif kind == "failed":
                series = self.metrics.failed_request_duration.labels(model=model, version=version)
            else:
                series = self.metrics.request_duration.labels(model=model, version=version)
            self._series[key] = series
        return series

    # ---- repository extension --------------------------------------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> list[dict]:
        await self.registry.forget_removed()  # the index lists the repository as it is, not as it was
        return self.registry.index(ready_only)

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition of this server's metrics (content type ``CONTENT_TYPE_LATEST``), rendered on a
        thread: with many models a render takes milliseconds, which the event loop's requests would wait out."""
        return await asyncio.to_thread(self.metrics.render)

    async def load_model(self, name: str) -> None:
        await self._to_its_end(self.registry.load(name))

    async def unload_model(self, name: str) -> None:
        await self._to_its_end(self.registry.unload(name))

    async def _to_its_end(self, change: Any) -> None:
        """Await a repository ``change``, which runs to its end even when the caller is cancelled.

        A gRPC call whose deadline passes is cancelled, and the cancellation used to land inside the load or
        unload: a version stayed UNLOADING for good, the next load and unload answered 500, and requests the
        scheduler held were never answered. The caller still gets its cancellation; the change completes.
        """
        task = asyncio.ensure_future(change)
        self._changes.add(task)
        task.add_done_callback(self._change_done)
        await asyncio.shield(task)

    def _change_done(self, task: asyncio.Task) -> None:
        self._changes.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the caller has it, or left; the registry logged the failure


class _Waiting:
    """One stream chunk counted in its store's ``waiting_chunks`` until its turn comes (or it ends without one)."""

    __slots__ = ("_store",)

    def __init__(self, store: Any) -> None:
        self._store = store
        store.waiting_chunks += 1

    def leave(self, _: Any = None) -> None:
        """Uncount it, once."""
        if self._store is not None:
            self._store.waiting_chunks -= 1
            self._store = None

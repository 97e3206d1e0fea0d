"""The DataPlane across processes: several front-end processes, one engine process.

One Python process tops out near 2,000-4,000 requests/s in HTTP and gRPC parsing and
encoding (measured on an H200 host, where the cuDNN engine had room for far more), so
``rnnserve serve --frontends N`` runs N front-end processes that share the HTTP and
gRPC ports (SO_REUSEPORT) and forward validated requests to the engine process, which
runs the one real :class:`~service.dataplane.DataPlane` (engines, batching, streams,
metrics). Requests from every front-end batch together, and a stream's state lives in
the engine process whichever front-end its chunks arrive at.

Front-ends validate and answer requests themselves (and send the requests that wait in
them together: :mod:`.coalesce`): each fetches a model's
:class:`~.view.ModelView` once, turns a request into :class:`~.view.Prepared` work
and sends only that (``submit``); the engine process queues it and answers from the
future's done-callback, with no task per request, and the front-end builds the
response. Measured on an H200 host under binary-HTTP load at concurrency 64, the
engine process's event loop held the GIL half of the time, a third of it in
validation, request decoding and response building, and the batch worker waited for
the rest. A request that fails validation in a front-end is sent whole (``infer``),
so the engine process counts it and answers with the same error.

Wire format on a Unix socket (frames: :mod:`.frames`): 8-byte little-endian length + pickle (protocol 5) of
``(id, method, args)`` (``submit_many``: several works, answered by one list of ``(ok, value)``); replies are ``(id, ok, value)`` where a failed call carries the
exception (rnnserve errors keep their status). A front-end whose client went away sends
``(None, "cancel", (id, index))`` for a request's call (``index``: one work of a ``submit_many``),
with no reply: the engine process cancels that work as one process would, and the call is
still answered. ``(None, "count", (model, version, outcome, n))`` (no reply) counts requests the
front-end settled itself (its queue full, or cancelled before they were sent), so that
``rnnserve_requests_total`` counts what one process would (every request that decodes into tensors for a
model; a body that does not decode is answered 400 before any model sees it and not counted, as in Triton). Pickle is safe here: both ends are
processes of this server, on a socket in a private temporary folder. A front-end's
large request arrays travel in its shared-memory arena instead (:mod:`.arena`): the frame
carries their place, and the place is freed when the reply comes.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from functools import partial
from typing import Any

from ..errors import NotFound, RNNServeError, StaleModelView, Unavailable
from ..wire import placing, wire
from . import arena as arenas
from .coalesce import SLOW_NOTE_S, ChunkLane, Lane
from .frames import FrameConnection
from .types import InferRequest, InferResponse
from .view import ModelView, Prepared, prepare, respond

log = logging.getLogger("rnnserve.dataplane.remote")
# How often a front-end reports the requests waiting in its lanes (when the counts changed): how stale
# rnnserve_frontend_queue_depth may be, and what streams' idle expiry allows for (see EngineHost); a report
# costs the engine process ~µs.
WAITING_REPORT_S = 0.25
ASYNC_METHODS = frozenset({"infer", "load_model", "unload_model", "live", "ready", "server_metadata", "model_metadata",
                           "model_ready", "repository_index", "render_metrics", "model_config", "model_statistics",
                           "end_stream"})
SYNC_METHODS = frozenset({"model_view"})
# Calls whose work a front-end cancels when its client goes away: ``(None, "cancel", (id, index))`` (no reply).
CANCELLABLE_METHODS = frozenset({"submit", "submit_many", "infer"})


def _outcome(fut: asyncio.Future) -> tuple[bool, Any]:
    """(ok, value) of a settled future of the engine process's DataPlane, ready to send."""
    if fut.cancelled():
        return False, Unavailable("the request was cancelled in the engine process")
    if fut.exception() is not None:
        return False, _portable(fut.exception())
    return True, {name: wire(a) for name, a in fut.result().items()}


def _note(requests: int, read: float) -> None:
    """Log (debug) a front-end message answered ``SLOW_NOTE_S`` or more after it was read: with the front-end's
    own note (:mod:`.coalesce`) it tells a slow round trip spent here (a message's reply waits for its
    slowest request's batch) from one spent between the processes."""
    if log.isEnabledFor(logging.DEBUG):
        took = time.perf_counter() - read
        if took >= SLOW_NOTE_S:
            log.debug("a front-end message of %d requests took %.1f ms in the engine process from its read to its "
                      "answer", requests, 1e3 * took)


def _portable(exc: BaseException) -> RNNServeError:
    if isinstance(exc, RNNServeError):
        return exc
    return RNNServeError(f"internal error in the engine process: {type(exc).__name__}: {exc}")


class DataPlaneServer:
    """Serves ``dataplane``'s methods to front-end processes on the Unix socket ``path``."""

    def __init__(self, dataplane: Any, path: str) -> None:
        self.dataplane = dataplane
        self.path = path
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._calls: dict[tuple[int, int], Any] = {}  # (connection, call id) -> its work, until answered
        self._waiting: dict[int, dict[tuple[str, str, str], int]] = {}  # connection -> its front-end's waiting

    async def start(self) -> None:
        """Listen on the socket."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._connection, path=self.path)

    async def stop(self, timeout: float | None = None) -> None:
        """Stop listening; calls in flight finish first, for up to ``timeout`` seconds, and are then cancelled (a
        load still building held a stopping server past its drain timeout for as long as the build took)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def _connection(self) -> FrameConnection:
        conn: FrameConnection
        attached: list[str] = []

        def on_frame(msg: Any) -> None:
            msg_id, method, args = msg
            if method == "submit":
                self._submit(conn, msg_id, args)
                return
            if method == "submit_many":
                self._submit_many(conn, msg_id, args)
                return
            if method == "cancel":
                self._cancel(conn, *args)
                return
            if method == "count":
                self.dataplane.count_outcome(*args)
                return
            if method == "waiting":
                self._frontend_waiting(conn, *args)
                return
            if method == "attach_arena":
                try:
                    arenas.attach(*args)
                    attached.append(args[0])
                    conn.send((msg_id, True, None))
                except (OSError, ValueError) as exc:
                    conn.send((msg_id, False, RNNServeError(f"cannot map the front-end's shared memory: {exc}")))
                return
            if method in ASYNC_METHODS:
                # Concurrent: requests from one front-end must be able to batch together, and a slow
                # call (a load) must not hold up the others on the connection.
                task = asyncio.get_running_loop().create_task(self._call_async(conn, msg_id, method, args))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                if method in CANCELLABLE_METHODS:
                    self._track(conn, msg_id, task)
                return
            try:
                if method not in SYNC_METHODS:
                    raise RNNServeError(f"unknown dataplane method '{method}'")
                reply = (msg_id, True, getattr(self.dataplane, method)(*args))
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                reply = (msg_id, False, _portable(exc))
            conn.send(reply)

        def on_lost() -> None:
            for path in attached:
                arenas.detach(path)
            self._frontend_waiting(conn, {})

        conn = FrameConnection(on_frame, on_lost)
        return conn

    def _frontend_waiting(self, conn: FrameConnection, counts: dict[tuple[str, str, str], int]) -> None:
        """A front-end's requests waiting in its lanes, by (model, version, "requests" or "chunks"), as it reports
        them when they change; the gauge is the sum over the front-ends connected, and the stream chunks' share
        holds off the model's stream expiry."""
        before = self._waiting.pop(id(conn), {})
        if counts:
            self._waiting[id(conn)] = counts
        for model, version in {key[:2] for key in before.keys() | counts.keys()}:
            requests, chunks = (sum(c.get((model, version, kind), 0) for c in self._waiting.values())
                                for kind in ("requests", "chunks"))
            self.dataplane.set_frontend_waiting(model, version, requests + chunks, chunks)

    def _track(self, conn: FrameConnection, msg_id: int, work: Any) -> None:
        """Keep call ``msg_id``'s future (or list of futures, one per item) until it is answered, so that the
        front-end can cancel it."""
        key = (id(conn), msg_id)
        self._calls[key] = work
        if not isinstance(work, list):  # a list: _submit_many untracks it when its last item is answered
            work.add_done_callback(partial(self._untrack, key, work))

    def _untrack(self, key: tuple[int, int], work: Any, _: Any = None) -> None:
        if self._calls.get(key) is work:
            del self._calls[key]

    def _cancel(self, conn: FrameConnection, msg_id: int, index: int | None) -> None:
        """Cancel the work of call ``msg_id`` (its item ``index`` of a submit_many); gone already: nothing."""
        work = self._calls.get((id(conn), msg_id))
        if work is None:
            return
        if isinstance(work, list):
            if index is not None and 0 <= index < len(work) and work[index] is not None:
                work[index].cancel()
            return
        work.cancel()

    def _submit(self, conn: FrameConnection, msg_id: int, args: tuple) -> None:
        try:
            fut = self.dataplane.submit_prepared(*args)
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            conn.send((msg_id, False, _portable(exc)))
            return
        self._track(conn, msg_id, fut)
        self._tasks.add(fut)
        requests = getattr(args[-1], "requests", 1)  # a front-end's merged requests travel as one Prepared
        fut.add_done_callback(partial(self._answer, conn, msg_id, requests, time.perf_counter()))

    def _answer(self, conn: FrameConnection, msg_id: int, requests: int, read: float, fut: asyncio.Future) -> None:
        self._tasks.discard(fut)
        conn.send((msg_id, *_outcome(fut)))
        _note(requests, read)

    def _submit_many(self, conn: FrameConnection, msg_id: int, args: tuple) -> None:
        """Several works of one model (a front-end's ChunkLane): each runs and fails on its own; one reply
        carries every (ok, value), in order, once the last is done."""
        name, version, generation, items = args
        outcomes: list[tuple[bool, Any] | None] = [None] * len(items)
        futures: list[asyncio.Future | None] = [None] * len(items)
        left = len(items)
        read = time.perf_counter()
        key = (id(conn), msg_id)
        self._track(conn, msg_id, futures)

        def settle(i: int, fut: asyncio.Future | None = None, exc: Exception | None = None) -> None:
            nonlocal left
            if fut is not None:
                self._tasks.discard(fut)
            outcomes[i] = _outcome(fut) if fut is not None else (False, _portable(exc))
            left -= 1
            if not left:
                self._untrack(key, futures)
                conn.send((msg_id, True, outcomes))
                _note(len(items), read)

        for i, prepared in enumerate(items):
            try:
                fut = self.dataplane.submit_prepared(name, version, generation, prepared)
            except Exception as exc:  # noqa: BLE001 - that work's caller gets it
                settle(i, exc=exc)
                continue
            futures[i] = fut
            self._tasks.add(fut)
            fut.add_done_callback(partial(settle, i))

    async def _call_async(self, conn: FrameConnection, msg_id: int, method: str, args: tuple) -> None:
        try:
            reply = (msg_id, True, await getattr(self.dataplane, method)(*args))
        except asyncio.CancelledError:  # the front-end cancelled it: it still gets a reply, which frees its arrays
            reply = (msg_id, False, Unavailable("the request was cancelled in the engine process"))
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            reply = (msg_id, False, _portable(exc))
        conn.send(reply)


class RemoteDataPlane:
    """The DataPlane interface in a front-end process, forwarding to the engine process.

    Every call is asynchronous and multiplexed on one connection. Health and metadata calls
    were once blocking round trips on a second connection, which held up the front-end's
    event loop for as long as the engine process took to answer (every second for the gRPC
    health poller, and for every probe and metrics scrape); now nothing here blocks.
    """

    def __init__(self, path: str, on_lost: Any = None, arena_bytes: int = 0) -> None:
        self.path = path
        self._on_lost = on_lost  # called once when the engine process goes away
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._arena_bytes = arena_bytes  # shared memory for request arrays (see .arena); 0: none
        self._arena: arenas.Arena | None = None
        self._held: dict[int, list[tuple[int, int]]] = {}  # arena places of calls not yet answered
        self._conn: FrameConnection | None = None
        self._closing = False
        self._draining = False
        self._views: dict[tuple[str, str], ModelView] = {}
        self._view_fetches: dict[tuple[str, str], asyncio.Future] = {}
        self._lanes: dict[tuple[str, str, int], Lane] = {}
        self._chunk_lanes: dict[tuple[str, str, int], ChunkLane] = {}
        self._many: dict[asyncio.Future, int] = {}  # submit_many calls not yet settled: their ids, to cancel items
        self._lane_labels: dict[tuple[str, str, int], tuple[str, str]] = {}  # lane key -> (model, version served)
        self._reported: dict[tuple[str, str, str], int] = {}  # waiting requests as last told to the engine process

    async def connect(self) -> None:
        """Open the connection to the engine process."""
        loop = asyncio.get_running_loop()
        _, self._conn = await loop.create_unix_connection(
            lambda: FrameConnection(self._on_reply, self._connection_lost), self.path)
        arena = arenas.Arena.create(self._arena_bytes)
        if arena is not None:
            try:
                await self._call("attach_arena", arena.path, arena.size)
                self._arena = arena
            except RNNServeError as exc:
                log.warning("%s; request arrays travel on the socket instead", exc)
                arena.close()

    async def close(self) -> None:
        """Close the connection; calls still waiting fail with Unavailable."""
        self._closing = True
        if self._conn is not None:
            self._conn.close()
        self._fail_pending()
        if self._arena is not None:
            self._arena.close()

    def begin_drain(self) -> None:
        """Report not ready from now on (this front-end is stopping)."""
        self._draining = True

    def _on_reply(self, msg: Any) -> None:
        msg_id, ok, value = msg
        places = self._held.pop(msg_id, None)
        if places is not None:  # answered: the engine process reads the call's arrays no more
            self._arena.release(places)
        fut = self._pending.pop(msg_id, None)
        if fut is not None and not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def _connection_lost(self) -> None:
        self._fail_pending()
        if self._closing:
            return
        if self._draining:  # the server is stopping, its engine processes with it: expected, not worth a warning
            log.debug("the engine process closed the connection while this front-end drained")
        else:
            log.warning("the engine process closed the connection")
        if self._on_lost is not None:
            self._on_lost()

    def _fail_pending(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(Unavailable("the engine process is not reachable; the server is stopping"))
        self._pending.clear()

    def _send(self, method: str, *args: Any) -> asyncio.Future:
        """Send one call; the future gets its reply. Cancelling the future of a request's call (its client
        went away) cancels the request's work in the engine process too, as in one process."""
        fut = asyncio.get_running_loop().create_future()
        if self._conn is None or self._conn.closed:
            fut.set_exception(Unavailable("the engine process is not reachable; the server is stopping"))
            return fut
        msg_id = next(self._ids)
        self._pending[msg_id] = fut
        if method in CANCELLABLE_METHODS:
            fut.add_done_callback(partial(self._settled, msg_id))
            if method == "submit_many":
                self._many[fut] = msg_id
        if self._arena is None:
            self._conn.send((msg_id, method, args))
            return fut
        with placing(arenas.Placing(self._arena)) as placement:
            try:
                self._conn.send((msg_id, method, args))  # pickles now, large arrays into the arena
            except BaseException:
                self._arena.release(placement.places)  # nothing was sent: nothing will answer
                del self._pending[msg_id]
                raise
        if placement.places:
            self._held[msg_id] = placement.places
        return fut

    def _settled(self, msg_id: int, fut: asyncio.Future) -> None:
        self._many.pop(fut, None)
        if fut.cancelled():
            self._cancel(msg_id, None)

    def _cancel(self, msg_id: int, index: int | None) -> None:
        """Ask the engine process to cancel call ``msg_id``'s work (item ``index`` of a submit_many); no reply."""
        if self._conn is not None and not self._conn.closed:
            self._conn.send((None, "cancel", (msg_id, index)))

    def _cancel_item(self, fut: asyncio.Future, index: int) -> None:
        """Cancel work ``index`` of the submit_many call whose future is ``fut``, in the engine process."""
        msg_id = self._many.get(fut)
        if msg_id is not None:
            self._cancel(msg_id, index)

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._send(method, *args)

    # -- the DataPlane interface -------------------------------------------------------------------

    async def live(self) -> bool:
        return await self._call("live")

    async def ready(self) -> bool:
        return not self._draining and await self._call("ready")

    async def server_metadata(self) -> dict:
        return await self._call("server_metadata")

    async def model_metadata(self, name: str, version: str = "") -> dict:
        return await self._call("model_metadata", name, version)

    async def model_ready(self, name: str, version: str = "") -> bool:
        return await self._call("model_ready", name, version)

    async def model_config(self, name: str, version: str = "") -> dict:
        return await self._call("model_config", name, version)

    async def model_statistics(self, name: str = "", version: str = "") -> list[dict]:
        return await self._call("model_statistics", name, version)

    async def end_stream(self, model: str, version: str, parameters: dict[str, Any], why: str, caller: int) -> None:
        return await self._call("end_stream", model, version, parameters, why, caller)

    async def repository_index(self, ready_only: bool = False) -> list[dict]:
        return await self._call("repository_index", ready_only)

    async def render_metrics(self) -> bytes:
        """The engine process's Prometheus exposition."""
        return await self._call("render_metrics")

    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate here against the model's view, run in the engine process, answer here."""
        key = (request.model_name, request.model_version)
        view = self._views.get(key)
        if view is None:
            try:
                view = await self._view(key)
            except RNNServeError:  # unknown or not ready: the engine process answers (and counts) it
                return await self._call("infer", request)
        try:
            prepared = prepare(request, view)
        except RNNServeError:
            return await self._call("infer", request)
        try:
            if prepared.stream is None and prepared.deadline is None and view.max_batch_size > 1:
                results = await self._queued(self._lane(key, view), view, prepared)
            elif prepared.stream is not None:
                results = await self._queued(self._chunk_lane(key, view), view, prepared)
            else:
                results = await self._call("submit", *key, view.generation, prepared)
        except StaleModelView:  # reloaded since the view was fetched: the engine process validates it again
            self._forget(key, view)
            return await self._call("infer", request)
        except NotFound:
            self._forget(key, view)
            raise
        return respond(request, view, results)

    def _queued(self, lane: Lane | ChunkLane, view: ModelView, prepared: Prepared) -> asyncio.Future:
        """``lane.submit(prepared)``; a refusal there (this front-end's queue is full) is counted in the engine
        process, which never sees the request."""
        try:
            return lane.submit(prepared)
        except RNNServeError as exc:
            self._tell_count(view, exc.status.lower(), prepared.requests)
            raise

    def _tell_count(self, view: ModelView, outcome: str, requests: int) -> None:
        """Have the engine process count ``requests`` this front-end settled itself (no reply)."""
        if self._conn is not None and not self._conn.closed:
            self._conn.send((None, "count", (view.name, view.label, outcome, requests)))

    async def _view(self, key: tuple[str, str]) -> ModelView:
        """Fetch a model's view from the engine process: once, however many requests wait for it."""
        fetch = self._view_fetches.get(key)
        if fetch is None:
            fetch = self._view_fetches[key] = self._send("model_view", *key)
            fetch.add_done_callback(lambda f: self._fetched(key, f))
        return await asyncio.shield(fetch)  # a cancelled request does not cancel the others' fetch

    def _fetched(self, key: tuple[str, str], fetch: asyncio.Future) -> None:
        if self._view_fetches.get(key) is fetch:
            del self._view_fetches[key]
        if not fetch.cancelled() and fetch.exception() is None:
            self._views[key] = fetch.result()

    def _lane(self, key: tuple[str, str], view: ModelView) -> Lane:
        lane = self._lanes.get(key + (view.generation,))
        if lane is None:
            self._lane_labels[key + (view.generation,)] = (view.name, view.label)
            lane = self._lanes[key + (view.generation,)] = Lane(
                view, partial(self._send, "submit", *key, view.generation),
                dropped=partial(self._tell_count, view, "cancelled"))
        return lane

    def _chunk_lane(self, key: tuple[str, str], view: ModelView) -> ChunkLane:
        lane = self._chunk_lanes.get(key + (view.generation,))
        if lane is None:
            self._lane_labels[key + (view.generation,)] = (view.name, view.label)
            lane = self._chunk_lanes[key + (view.generation,)] = ChunkLane(
                partial(self._send, "submit", *key, view.generation),
                partial(self._send, "submit_many", *key, view.generation), self._cancel_item, view.max_queue_size,
                dropped=partial(self._tell_count, view, "cancelled"))
        return lane

    def _forget(self, key: tuple[str, str], view: ModelView) -> None:
        """Fetch the model's view again on its next request (reloaded or unloaded)."""
        if self._views.get(key) is view:
            del self._views[key]
        self._lanes.pop(key + (view.generation,), None)
        self._chunk_lanes.pop(key + (view.generation,), None)
        self._lane_labels.pop(key + (view.generation,), None)

    def report_waiting(self) -> None:
        """Tell the engine process how many requests wait in this front-end's lanes, by model and version, when
        that changed since the last report (no reply): its ``rnnserve_frontend_queue_depth``."""
        counts: dict[tuple[str, str, str], int] = {}
        for kind, lanes in (("requests", self._lanes), ("chunks", self._chunk_lanes)):
            for key, lane in lanes.items():
                label = self._lane_labels.get(key)
                if label is not None and lane.waiting:
                    counts[(*label, kind)] = counts.get((*label, kind), 0) + lane.waiting
        if counts == self._reported or self._conn is None or self._conn.closed:
            return
        # every model that waited before and waits no more is sent as 0, so that its gauge goes back
        self._conn.send((None, "waiting", ({**dict.fromkeys(self._reported, 0), **counts},)))
        self._reported = counts

    async def load_model(self, name: str) -> None:
        await self._call("load_model", name)

    async def unload_model(self, name: str) -> None:
        await self._call("unload_model", name)

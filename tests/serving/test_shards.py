"""Several engine processes behind one front-end (service.dataplane.shards), over real sockets.

Two real DataPlanes, each served by a DataPlaneServer on its own Unix socket, stand for
two engine processes; a ShardedDataPlane over two RemoteDataPlanes routes to them as a
front-end process does. Each DataPlane keeps its own metrics, so the tests can see
which engine process ran what.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from service import create_engine
from service.dataplane import DataPlane, InferRequest, InferTensor
from service.dataplane.remote import DataPlaneServer, RemoteDataPlane
from service.dataplane.shards import ShardedDataPlane, merge_indexes, stream_shard
from service.errors import NotFound, Unavailable
from service.metrics import ServerMetrics
from service.metrics.merge import merge_expositions
from service.registry import ModelRegistry
from service.repository import load_model
from serving_support import LSTM, make_model, metric_value, write_config

class EngineProcesses:
    """Two DataPlanes served on Unix sockets from their own thread and event loop, apart from the
    front-end's loop as engine processes are (a test can keep that loop busy, as a busy engine process)."""

    def __init__(self, repo: Path, folder: str) -> None:
        self.repo, self.folder = repo, folder
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.planes: list[DataPlane] = []
        self.servers: list[DataPlaneServer] = []

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self) -> None:
        for k in range(2):
            metrics = ServerMetrics()
            plane = DataPlane(ModelRegistry(self.repo, "cpu", {}, metrics), metrics)
            await plane.start()
            server = DataPlaneServer(plane, str(Path(self.folder) / f"e{k}.sock"))
            await server.start()
            self.planes.append(plane)
            self.servers.append(server)

    async def _stop(self) -> None:
        for server in self.servers:
            await server.stop()
        for plane in self.planes:
            await plane.stop()

    def start(self) -> None:
        self.call(self._start())

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest_asyncio.fixture
async def engine_processes(tmp_path):
    """(repository, EngineProcesses, a ShardedDataPlane over both)."""
    make_model(*LSTM, seed=5).save(tmp_path, "lstm", 1)
    write_config(tmp_path, "lstm", max_streams=64)
    folder = tempfile.mkdtemp(prefix="rnnserve-test-")  # Unix socket paths must stay short
    engines = EngineProcesses(tmp_path, folder)
    try:
        engines.start()
        sharded = ShardedDataPlane([RemoteDataPlane(server.path) for server in engines.servers])
        await sharded.connect()
        yield tmp_path, engines, sharded
        await sharded.close()
    finally:
        engines.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def two_engines(engine_processes):
    """(repository, the two engine processes' DataPlanes, a ShardedDataPlane over both)."""
    repo, engines, sharded = engine_processes
    return repo, engines.planes, sharded


def _request(x: np.ndarray, **parameters) -> InferRequest:
    return InferRequest("lstm", inputs=[InferTensor("input", "FP32", list(x.shape), x)], parameters=parameters)


def _output(response, name: str = "output") -> np.ndarray:
    return next(t.data for t in response.outputs if t.name == name)


@pytest.mark.asyncio
async def test_concurrent_requests_spread_over_both_engine_processes_and_equal_the_engine(two_engines):
    repo, planes, sharded = two_engines
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, int(rng.integers(3, 30)), 4)).astype(np.float32) for _ in range(40)]
    answers = await asyncio.gather(*(sharded.infer(_request(x)) for x in xs))
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    for x, answer in zip(xs, answers):
        np.testing.assert_allclose(_output(answer), engine.forward(x).output, rtol=1e-5, atol=1e-5)
    served = [metric_value(p, "rnnserve_requests_total", outcome="success") for p in planes]
    assert sum(served) == 40
    assert min(served) >= 10, f"requests in flight together should go to the less busy process: {served}"


@pytest.mark.asyncio
async def test_streams_stay_on_the_engine_process_of_their_sequence_id(two_engines):
    repo, planes, sharded = two_engines
    rng = np.random.default_rng(1)
    ids = list(range(1, 17))
    homes = [stream_shard({"sequence_id": i}, 2) for i in ids]
    assert set(homes) == {0, 1}  # sixteen ids use both processes
    xs = {i: rng.standard_normal((1, 12, 4)).astype(np.float32) for i in ids}
    cuts = [(0, 3), (3, 4), (4, 9), (9, 12)]
    outs: dict[int, list[np.ndarray]] = {i: [] for i in ids}
    for a, b in cuts:  # chunk k of every stream at once, interleaved
        chunks = [sharded.infer(_request(np.ascontiguousarray(xs[i][:, a:b]), sequence_id=i, sequence_start=a == 0,
                                         sequence_end=b == 12)) for i in ids]
        for i, answer in zip(ids, await asyncio.gather(*chunks)):
            outs[i].append(_output(answer))
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    for i in ids:
        np.testing.assert_allclose(np.concatenate(outs[i], axis=1), engine.forward(xs[i]).output, rtol=1e-5, atol=1e-5)
    for k, plane in enumerate(planes):
        assert metric_value(plane, "rnnserve_stream_starts_total") == homes.count(k)
        assert metric_value(plane, "rnnserve_stream_ends_total", reason="end") == homes.count(k)
    # a chunk for a stream that ended is refused by the process that held it, as with one process
    with pytest.raises(NotFound, match="stream 1 .* ended with sequence_end"):
        await sharded.infer(_request(xs[1][:, :2], sequence_id=1))


@pytest.mark.asyncio
async def test_end_stream_reaches_the_engine_process_that_holds_the_stream(two_engines):
    # what a front-end's gRPC transport sends for a stream chunk it answered but could not deliver
    _, planes, sharded = two_engines
    x = np.zeros((1, 2, 4), np.float32)
    ids = [1, 2, 3, 4]
    assert {stream_shard({"sequence_id": i}, 2) for i in ids} == {0, 1}
    for i in ids:
        await sharded.infer(_request(x, sequence_id=i, sequence_start=True))
        await sharded.end_stream("lstm", "1", {"sequence_id": i}, "was ended for the test", 0)
        with pytest.raises(NotFound, match=f"stream {i} .* it was ended for the test"):
            await sharded.infer(_request(x, sequence_id=i))
    assert sum(metric_value(p, "rnnserve_stream_ends_total", reason="error") for p in planes) == len(ids)


@pytest.mark.asyncio
async def test_load_and_unload_reach_every_engine_process(two_engines):
    repo, planes, sharded = two_engines
    x = np.ones((1, 5, 4), np.float32)
    await sharded.unload_model("lstm")
    assert not any([await p.model_ready("lstm") for p in planes])
    assert not await sharded.model_ready("lstm")
    for _ in range(3):  # whichever process a request goes to, the model is gone
        with pytest.raises((NotFound, Unavailable)):
            await sharded.infer(_request(x))
    make_model(*LSTM, seed=9).save(repo, "lstm", 2)
    await sharded.load_model("lstm")
    assert all([await p.model_ready("lstm", "2") for p in planes]) and await sharded.model_ready("lstm")
    want = create_engine(load_model(repo / "lstm", 2), "cpu").forward(x).output
    for answer in await asyncio.gather(*(sharded.infer(_request(x)) for _ in range(6))):
        np.testing.assert_allclose(_output(answer), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotFound, match="nope"):
        await sharded.load_model("nope")
    index = await sharded.repository_index()
    assert index == await planes[0].repository_index() == await planes[1].repository_index()  # as one process shows it
    assert ("lstm", "2", "READY") in [(r["name"], r["version"], r["state"]) for r in index]


class _OrderedShard:
    """An engine process as one front-end reaches it: its repository operations arrive after ``delay``."""

    def __init__(self, arrivals: list[str], delay: float) -> None:
        self.arrivals, self.delay = arrivals, delay

    async def load_model(self, name: str) -> None:
        await asyncio.sleep(self.delay)
        self.arrivals.append("load")

    async def unload_model(self, name: str) -> None:
        await asyncio.sleep(self.delay)
        self.arrivals.append("unload")


@pytest.mark.asyncio
@pytest.mark.parametrize("caller_leaves", [False, True])
async def test_a_load_and_an_unload_from_two_front_ends_reach_every_engine_process_in_one_order(tmp_path,
                                                                                               caller_leaves):
    """Front-end A reaches engine process 0 first, B reaches 1 first: without the lock process 0 saw load, unload
    and process 1 unload, load (the model served by one process and unloaded in the other). A caller that leaves
    (cancelled) must not let the other front-end in while its operation still runs."""
    first, second = [], []
    a = ShardedDataPlane([_OrderedShard(first, 0.0), _OrderedShard(second, 0.05)], lock_folder=str(tmp_path))
    b = ShardedDataPlane([_OrderedShard(first, 0.05), _OrderedShard(second, 0.0)], lock_folder=str(tmp_path))
    load = asyncio.ensure_future(a.load_model("lstm"))
    await asyncio.sleep(0.01)
    if caller_leaves:
        load.cancel()
    await b.unload_model("lstm")
    await asyncio.gather(load, return_exceptions=True)
    assert first == second == ["load", "unload"]
    # another model's operations do not wait for this one's
    third = []
    c = ShardedDataPlane([_OrderedShard(third, 0.2)], lock_folder=str(tmp_path))
    slow = asyncio.ensure_future(c.load_model("lstm"))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(a.unload_model("gru"), 0.15)
    await slow


@pytest.mark.asyncio
async def test_one_front_ends_repository_requests_keep_their_order_and_files_stay_few(tmp_path):
    """Waiters polled the lock file each on its own: a load whose client had left (still run, as it should be) could
    run after the same client's later unload, each waiter held a descriptor, and every model name left a file."""
    arrivals: list[str] = []
    slow = ShardedDataPlane([_OrderedShard(arrivals, 0.05), _OrderedShard([], 0.05)], lock_folder=str(tmp_path))
    first = asyncio.ensure_future(slow.load_model("lstm"))
    await asyncio.sleep(0.01)
    abandoned = asyncio.ensure_future(slow.load_model("lstm"))  # its client times out while it waits
    await asyncio.sleep(0.01)
    abandoned.cancel()
    await slow.unload_model("lstm")
    await asyncio.gather(first, abandoned, return_exceptions=True)
    assert arrivals == ["load", "load", "unload"]
    # fifty waiters behind a holder: one descriptor on the lock file (the holder's), not one each
    held = asyncio.ensure_future(slow.load_model("lstm"))
    await asyncio.sleep(0.01)
    waiters = [asyncio.ensure_future(slow.unload_model("lstm")) for _ in range(50)]
    await asyncio.sleep(0.02)
    open_locks = [fd for fd in os.listdir("/proc/self/fd")
                  if os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(tmp_path))]
    assert len(open_locks) == 1, open_locks
    await asyncio.gather(held, *waiters)
    many = ShardedDataPlane([_OrderedShard([], 0.0)], lock_folder=str(tmp_path))
    await asyncio.gather(*(many.load_model(f"model-{k}") for k in range(300)))
    assert 0 < len(list(tmp_path.iterdir())) <= 64
    # the folder removed under a running server (a tmp cleaner): made again, loads go on
    shutil.rmtree(tmp_path)
    await many.unload_model("lstm")
    assert tmp_path.is_dir()


@pytest.mark.asyncio
async def test_a_stopping_engine_process_waits_for_calls_in_flight_only_up_to_the_drain_timeout(tmp_path):
    """A load still building held a stopping multi-process server past --drain-timeout-s for as long as the build
    took (40 s in the probe that found it); past the timeout the call is cancelled."""
    server = DataPlaneServer(None, str(tmp_path / "s.sock"))
    await server.start()
    building = asyncio.ensure_future(asyncio.sleep(60))
    server._tasks.add(building)  # a call in flight, as _connection registers them
    await asyncio.wait_for(server.stop(0.1), 5)
    assert building.cancelled()


async def _max_tick_gap(stop: asyncio.Event) -> float:
    """The longest time this event loop went without running a 5 ms ticker, until ``stop``."""
    gap, last = 0.0, time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.005)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    return gap


@pytest.mark.asyncio
async def test_a_slow_engine_process_does_not_hold_up_the_front_ends_event_loop(engine_processes):
    """Health, metadata, metrics and a model's first request wait for the engine process without blocking:
    a front-end's other requests (here a ticker) keep running while the engine processes are busy."""
    repo, engines, sharded = engine_processes
    fresh = RemoteDataPlane(sharded.shards[0].path)  # no model view fetched yet
    await fresh.connect()
    fetches = []
    send = fresh._send
    fresh._send = lambda method, *args: (fetches.append(method), send(method, *args))[1]
    x = np.ones((1, 5, 4), np.float32)
    want = create_engine(load_model(repo / "lstm", 1), "cpu").forward(x).output
    try:
        stop = asyncio.Event()
        ticker = asyncio.create_task(_max_tick_gap(stop))
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        busy = threading.Event()
        engines.loop.call_soon_threadsafe(lambda: (busy.set(), time.sleep(0.4)))  # both engine processes' loop
        busy.wait(5)
        ready, meta, text, *answers = await asyncio.gather(
            sharded.ready(), sharded.model_metadata("lstm"), sharded.render_metrics(),
            *(fresh.infer(_request(x)) for _ in range(4)))
        waited = time.perf_counter() - start
        stop.set()
        gap = await ticker
    finally:
        await fresh.close()
    assert ready and meta["name"] == "lstm" and b"rnnserve_requests_total" in text
    for answer in answers:
        np.testing.assert_allclose(_output(answer), want, rtol=1e-5, atol=1e-5)
    assert waited >= 0.3  # the engine processes were busy for that long
    assert gap < 0.2, f"the front-end's event loop was held for {gap * 1e3:.0f} ms"
    assert fetches.count("model_view") == 1  # four first requests, one fetch of the model's view


@pytest.mark.asyncio
async def test_metrics_of_every_engine_process_add_up(two_engines):
    _, planes, sharded = two_engines
    x = np.ones((1, 5, 4), np.float32)
    await asyncio.gather(*(sharded.infer(_request(x)) for _ in range(9)))
    merged = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families((await sharded.render_metrics()).decode()) for s in f.samples}
    success = (("model", "lstm"), ("outcome", "success"), ("version", "1"))
    assert merged[("rnnserve_requests_total", success)] == 9
    mv = (("model", "lstm"), ("version", "1"))
    assert merged[("rnnserve_request_duration_seconds_count", mv)] == 9
    assert merged[("rnnserve_model_ready", mv)] == 1


def test_merged_exposition_adds_counters_and_histograms_and_keeps_the_least_ready():
    a, b = ServerMetrics(), ServerMetrics()
    a.requests.labels("m", "1", "success").inc(3)
    b.requests.labels("m", "1", "success").inc(4)
    b.requests.labels("m", "1", "unavailable").inc()
    a.request_duration.labels("m", "1").observe(0.003)
    b.request_duration.labels("m", "1").observe(0.2)
    a.queue_depth.labels("m", "1").set(2)
    b.queue_depth.labels("m", "1").set(5)
    a.model_ready.labels("m", "1").set(1)
    b.model_ready.labels("m", "1").set(0)
    families = {f.name: f for f in text_string_to_metric_families(merge_expositions([a.render(), b.render()]).decode())}
    samples = {(s.name, s.labels.get("outcome"), s.labels.get("le")): s.value for f in families.values()
               for s in f.samples}
    assert samples[("rnnserve_requests_total", "success", None)] == 7
    assert samples[("rnnserve_requests_total", "unavailable", None)] == 1
    assert samples[("rnnserve_request_duration_seconds_bucket", None, "0.005")] == 1
    assert samples[("rnnserve_request_duration_seconds_bucket", None, "+Inf")] == 2
    assert samples[("rnnserve_request_duration_seconds_sum", None, None)] == pytest.approx(0.203)
    assert samples[("rnnserve_queue_depth", None, None)] == 7
    assert samples[("rnnserve_model_ready", None, None)] == 0  # not ready in one process: not ready
    assert families["rnnserve_request_duration_seconds"].type == "histogram"
    assert families["rnnserve_requests"].type == "counter"


def test_the_gpus_own_counters_are_taken_once_from_every_engine_process():
    """Every engine process reads the one GPU's NVML counters: merged, they are one reading, not a sum."""
    class Gpu:
        def __init__(self, util):
            self.utilization = lambda: util

        memory_used = staticmethod(lambda: 3e9)
        memory_total = staticmethod(lambda: 80e9)
        power_watts = staticmethod(lambda: 120.0)

    a, b = ServerMetrics(), ServerMetrics()
    a.watch_gpu("cuda:0", Gpu(0.25))
    b.watch_gpu("cuda:0", Gpu(0.5))
    samples = {s.name: s.value for f in text_string_to_metric_families(merge_expositions([a.render(), b.render()]).decode())
               for s in f.samples if s.name.startswith("rnnserve_gpu_")}
    assert samples == {"rnnserve_gpu_utilization_ratio": 0.5, "rnnserve_gpu_memory_used_bytes": 3e9,
                       "rnnserve_gpu_memory_total_bytes": 80e9, "rnnserve_gpu_power_watts": 120.0}


def test_merged_index_shows_a_version_not_ready_in_one_process_with_its_reason():
    ready = {"name": "m", "version": "1", "state": "READY", "reason": ""}
    broken = {"name": "m", "version": "1", "state": "UNAVAILABLE", "reason": "out of memory"}
    other = {"name": "a", "version": "3", "state": "READY", "reason": ""}
    assert merge_indexes([[ready, other], [broken, other]]) == [
        other, {**broken, "reason": "engine process 1: out of memory (READY in engine process 0)"}]
    assert merge_indexes([[ready], [ready]]) == [ready]
    # not READY in process 0 and READY in 1: the row said plain "unloaded", as if every process agreed
    unloaded = {**broken, "reason": "unloaded"}
    assert merge_indexes([[unloaded], [ready], [unloaded]]) == [
        {**unloaded, "reason": "engine process 0: unloaded (READY in engine process 1)"}]
    assert merge_indexes([[unloaded], [broken]]) == [unloaded]  # not ready anywhere: the first process's row
    # READY in process 0 and not listed by process 1 (its scan missed the folder): the row read READY
    assert merge_indexes([[ready, other], [other]]) == [
        other, {**ready, "state": "UNAVAILABLE", "reason": "engine process 1 does not have this version (READY in "
                                                           "engine process 0)"}]


def test_stream_chunks_with_bad_parameters_are_not_streams():
    assert stream_shard({}, 3) is None
    assert stream_shard({"sequence_start": True}, 3) is None  # invalid: any process answers the error
    assert stream_shard({"sequence_id": "abc"}, 3) == stream_shard({"sequence_id": "abc", "sequence_end": True}, 3)


@pytest.mark.asyncio
async def test_statistics_of_every_engine_process_add_up_and_the_config_counts_one_instance_each(two_engines):
    _, planes, sharded = two_engines
    x = np.ones((2, 5, 4), np.float32)
    await asyncio.gather(*(sharded.infer(_request(x)) for _ in range(9)))
    (stats,) = await sharded.model_statistics("lstm")
    per_process = [(await p.model_statistics("lstm"))[0] for p in planes]
    assert stats["inference_stats"]["success"]["count"] == 9
    assert [s["inference_stats"]["success"]["count"] for s in per_process] != [9, 0]  # both processes served
    assert stats["inference_count"] == 18  # two sequences a request
    assert stats["execution_count"] == sum(s["execution_count"] for s in per_process)
    assert stats["inference_stats"]["queue"]["ns"] == sum(s["inference_stats"]["queue"]["ns"] for s in per_process)
    assert stats["last_inference"] == max(s["last_inference"] for s in per_process)
    config = await sharded.model_config("lstm")
    assert config["instance_group"] == [{"name": "lstm", "kind": "KIND_CPU", "count": 2}]


def test_merged_exposition_keeps_the_latest_last_inference():
    a, b = ServerMetrics(), ServerMetrics()
    a.last_inference.labels("m", "1").set(1_700_000_000.5)
    b.last_inference.labels("m", "1").set(1_700_000_002.25)
    samples = {s.name: s.value for f in text_string_to_metric_families(merge_expositions([a.render(), b.render()])
                                                                        .decode()) for s in f.samples}
    assert samples["rnnserve_last_inference_timestamp_seconds"] == 1_700_000_002.25

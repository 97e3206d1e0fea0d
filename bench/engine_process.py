"""How many requests per second the engine process of `rnnserve serve --frontends N` can take.

Under load on the GPU the engine process's one Python thread is the limit (bench/serve.py
shows it busy 91-98 %), not the GPU. This bench measures that thread's cost per request
on any machine: it runs the real engine-process side (DataPlane, registry, Scheduler,
DataPlaneServer on a Unix socket) in this process over a stand-in engine that computes
nothing (``launch`` returns at once; ``wait`` sleeps --gpu-ms without the GIL, as a GPU
wait does; --launch-ms of GIL-held busy work stands for the cuDNN launch's host time),
and drives it from a separate process that sends already-validated ``submit`` frames,
as front-end processes do, with --concurrency requests outstanding.

    python bench/engine_process.py                       # batching on and off, table
    python bench/engine_process.py --profile prof.out    # cProfile of the engine process's thread
    python bench/engine_process.py --streams 256         # stateful stream chunks (10 steps) instead

The table shows requests/s with the server's batching (``bench``) and with
``max_batch_size`` 1 (``bench_nobatch``), and the engine process's CPU time per request.
With ``--streams N`` it sends N stateful streams' 10-step chunks instead, each stream its
next chunk when the last is answered (model ``bench_stream``, the stand-in's state pool on
the host).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from service.eventloop import run  # noqa: E402 - the server's event loop (uvloop where installed)


class _Event:
    """A launched batch's 'device' end, ``seconds`` after its launch (the scheduler may poll ``done``)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    @property
    def done(self) -> bool:
        return time.perf_counter() >= self.end

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.end - time.perf_counter()))


class StandInEngine:
    """Engine flags of the cuDNN engine, no computation: outputs are zeros of the right shapes."""

    name = "stand-in"
    skips_states = True
    computes_last = True
    launches = True
    concurrent_batches = 2

    def __init__(self, spec, gpu_ms: float, launch_ms: float) -> None:
        self.spec = spec
        self.gpu_s = gpu_ms / 1e3
        self.launch_s = launch_ms / 1e3

    def input_buffer(self, shape: tuple[int, int, int]) -> np.ndarray:
        """Reused host memory for a merged batch, as the cuDNN engine lends pinned blocks (nothing reads it
        here): a fresh zeroed array per batch would cost page faults the real engine does not pay."""
        size = int(np.prod(shape))
        if getattr(self, "_buffer", None) is None or self._buffer.size < size:
            self._buffer = np.empty(max(size, 1 << 20), np.float32)
        return self._buffer[:size].reshape(shape)

    def state_pool(self, max_slots: int):
        from service.engines.state_pool import StatePool

        return StatePool(self.spec, np, np.float32, max_slots)

    def launch(self, x, lengths=None, h0=None, c0=None, states_needed=True, last_only=False, pooled=None):
        from service.engines.base import EngineOutput, Launched

        end = time.perf_counter() + self.launch_s
        while time.perf_counter() < end:
            pass
        b, t = x.shape[0], x.shape[1]
        blk = self.spec.blocks[-1]
        feat = blk.output_size * blk.directions
        states = sum(k.num_layers * k.directions for k in self.spec.blocks)

        def finish() -> EngineOutput:
            h = None if not states_needed else np.zeros((b, states, blk.output_size), np.float32)
            if last_only:
                return EngineOutput(None, h, h, last=np.zeros((b, feat), np.float32))
            return EngineOutput(np.zeros((b, t, feat), np.float32), h, h)

        return Launched(_Event(self.gpu_s), finish)

    def forward(self, *args, **kwargs):
        launched = self.launch(*args, **kwargs)
        launched.wait()
        return launched.finish()

    def close(self) -> None:
        pass


def _client(path: str, model: str, generation: int, concurrency: int, seconds: float, seed: int, per_submit: int,
            result, streams: int = 0, paced_ms: float = 0.0, stateless: bool = False,
            shm_mb: int = 0) -> None:
    """Send submit frames with ``concurrency`` outstanding for ``seconds``; report requests done.

    ``per_submit`` > 1: each frame carries that many requests merged, as a front-end's coalescer sends them.
    ``streams`` > 0: that many streams of 10-step chunks instead, each sending its next chunk when answered,
    or (``paced_ms``) every ``paced_ms`` ms (at once if the answer came later), offsets spread over one interval;
    ``stateless``: the chunks carry h_0/c_0 and ask for h_n/c_n instead of a sequence_id.
    Puts (requests/s, latencies in s)."""
    from service.dataplane.remote import RemoteDataPlane
    from service.dataplane.validation import StreamRequest
    from service.dataplane.view import Prepared
    from service.scheduler import SequenceWork

    rng = np.random.default_rng(seed)
    payloads = []
    for _ in range(256):
        ts = rng.integers(20, 201, per_submit)
        x = np.zeros((per_submit, int(ts.max()), 40), np.float32)
        work = SequenceWork(x, ts.astype(np.int64), outputs=frozenset({"output_last"}))
        payloads.append(Prepared(work, None, None, per_submit) if per_submit > 1 else Prepared(work, None, None))
    chunk = np.zeros((1, 10, 40), np.float32)
    base = int(time.time() * 1000) % 1_000_000 * 10_000
    started: set[int] = set()

    zeros = np.zeros((1, 2, 256), np.float32)  # the stream model's h and c: 2 layers, 256 wide

    def stream_chunk(k: int) -> Prepared:
        if stateless:
            work = SequenceWork(chunk, np.array([10]), zeros, zeros, frozenset({"output", "h_n", "c_n"}))
            return Prepared(work, None, None)
        work = SequenceWork(chunk, np.array([10]), outputs=frozenset({"output"}))
        first = k not in started
        started.add(k)
        return Prepared(work, None, StreamRequest(str(base + k), first, False))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = 0
        ids = itertools.count()
        pick = itertools.cycle(payloads)
        stop_at = loop.time() + seconds
        finished = loop.create_future()
        sent_at: dict[int, float] = {}
        latencies: list[float] = []
        interval = paced_ms / 1e3
        due = {k: loop.time() + interval * k / max(1, streams) for k in range(streams)}
        # a front-end's connection (and shared-memory arena, --shm-mb) to the engine process
        remote = RemoteDataPlane(path, arena_bytes=shm_mb << 20)
        await remote.connect()

        def send(stream: int = 0) -> None:
            if streams:
                sent_at[stream] = time.perf_counter()
                fut = remote._send("submit", model, "", generation, stream_chunk(stream))
            else:
                stream = next(ids)
                fut = remote._send("submit", model, "", generation, next(pick))
            fut.add_done_callback(lambda f, k=stream: on_reply(k, f))

        def on_reply(sent: int, fut: asyncio.Future) -> None:
            nonlocal done
            if fut.exception() is not None:
                if finished.done():  # in flight when the run ended and the connection closed
                    return
                raise fut.exception()
            done += per_submit
            if streams:
                latencies.append(time.perf_counter() - sent_at[sent])
            if loop.time() < stop_at:
                if interval:
                    due[sent] += interval
                    loop.call_at(max(due[sent], loop.time()), send, sent)
                else:
                    send(sent)
            elif not finished.done():
                finished.set_result(None)

        start = loop.time()
        for k in range(streams or max(1, concurrency // per_submit)):
            if interval:
                loop.call_at(due[k], send, k)
            else:
                send(k)
        await finished
        result.put((done / (loop.time() - start), latencies))
        await remote.close()

    from service.eventloop import run

    run(main())  # the server's event loop (uvloop where installed), as front-ends run


def _total(registry, name: str, model: str) -> float:
    return sum(s.value for m in registry.collect() for s in m.samples
               if s.name == name and s.labels.get("model") == model)


async def _serve(args, repo: Path, model: str, profile: cProfile.Profile | None
                 ) -> tuple[float, float, float, list[float], dict[str, float]]:
    from service.dataplane import DataPlane
    from service.dataplane.remote import DataPlaneServer
    from service.registry import ModelRegistry

    from service.metrics import ServerMetrics

    metrics = ServerMetrics()
    registry = ModelRegistry(repo, device="cpu", metrics=metrics)
    dataplane = DataPlane(registry, metrics)
    await dataplane.start()
    path = str(repo / "engine.sock")
    server = DataPlaneServer(dataplane, path)
    await server.start()
    generation = dataplane.model_view(model).generation
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    client = ctx.Process(target=_client, args=(path, model, generation, args.concurrency, args.seconds, 1,
                                                   args.per_submit if model == "bench" else 1, result,
                                                   args.streams, args.paced_ms, args.stateless, args.shm_mb))
    client.start()
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    loop = asyncio.get_running_loop()
    rate, latencies = await loop.run_in_executor(None, result.get)
    if profile is not None:
        profile.disable()
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    client.join()
    totals = {name: _total(metrics.registry, f"rnnserve_{name}", model) for name in (
        "request_duration_seconds_sum", "request_duration_seconds_count", "queue_duration_seconds_sum",
        "queue_duration_seconds_count", "compute_duration_seconds_sum", "batch_size_count", "batch_size_sum")}
    sched = registry.serving(model).scheduler
    await server.stop()
    await dataplane.stop()
    del sched
    return rate, cpu, wall, latencies, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--gpu-ms", type=float, default=0.3, help="time each batch waits without the GIL")
    parser.add_argument("--launch-ms", type=float, default=0.2, help="GIL-held host time of each launch")
    parser.add_argument("--profile", help="write a cProfile of the engine process's event loop here")
    parser.add_argument("--per-submit", type=int, default=1,
                        help="requests per submit frame on the batching model (a front-end's coalescing)")
    parser.add_argument("--only", choices=("bench", "bench_nobatch"))
    parser.add_argument("--shm-mb", type=int, default=32,
                        help="the sending front-end's shared memory for request arrays (rnnserve serve --frontend-shm-mb; "
                             "0: arrays on the socket)")
    parser.add_argument("--streams", type=int, default=0,
                        help="N streams of 10-step chunks (model bench_stream) instead of requests: stateful, "
                             "then stateless (the chunks carry h_0/c_0 and ask for h_n/c_n)")
    parser.add_argument("--paced-ms", type=float, default=0.0,
                        help="with --streams: each stream sends a chunk every this many ms (0: when answered)")
    parser.set_defaults(stateless=False)
    args = parser.parse_args()

    import serve
    from service.registry import registry as registry_module

    spec_engine = lambda model, device="cpu", **_: StandInEngine(model.spec, args.gpu_ms, args.launch_ms)  # noqa: E731
    registry_module.create_engine = spec_engine
    repo = Path(tempfile.mkdtemp(prefix="rnnserve-ep-"))
    try:
        _table(args, repo, serve)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def _table(args: argparse.Namespace, repo: Path, serve) -> None:
    serve.write_repository(repo, 40, 128, 1)
    if args.streams:
        serve.write_stream_model(repo, 40, 256, 2)
        sends = f"one every {args.paced_ms:g} ms per stream" if args.paced_ms else "closed loop"
        print(f"engine process alone: stand-in engine (launch {args.launch_ms} ms GIL-held, wait {args.gpu_ms} ms), "
              f"{args.streams} streams of 10-step chunks, {sends}, {args.seconds}s; latency: client to engine "
              f"process and back over its socket")
        print("| mode      |  chunks/s | p50 ms | p99 ms | server ms | queue ms | batch ms | avg batch | "
              "CPU per chunk (µs) | CPU busy |")
        print("|-----------|----------:|-------:|-------:|----------:|---------:|---------:|----------:|"
              "-------------------:|---------:|")
        for stateless in (False, True):
            args.stateless = stateless
            profile = cProfile.Profile() if args.profile else None
            rate, cpu, wall, lat, t = run(_serve(args, repo, "bench_stream", profile))
            lat_ms = 1e3 * np.asarray(lat)
            reqs, batches = max(1.0, t["request_duration_seconds_count"]), max(1.0, t["batch_size_count"])
            print(f"| {'stateless' if stateless else 'stateful':9s} | {rate:9.0f} | {np.percentile(lat_ms, 50):6.2f} | "
                  f"{np.percentile(lat_ms, 99):6.2f} | {1e3 * t['request_duration_seconds_sum'] / reqs:9.2f} | "
                  f"{1e3 * t['queue_duration_seconds_sum'] / max(1.0, t['queue_duration_seconds_count']):8.2f} | "
                  f"{1e3 * t['compute_duration_seconds_sum'] / batches:8.2f} | {t['batch_size_sum'] / batches:9.1f} | "
                  f"{1e6 * cpu / max(1.0, rate * wall):18.1f} | {100 * cpu / wall:7.0f}% |", flush=True)
            if profile is not None:
                profile.dump_stats(f"{args.profile}.{'stateless' if stateless else 'stateful'}")
        return
    print(f"engine process alone: stand-in engine (launch {args.launch_ms} ms GIL-held, wait {args.gpu_ms} ms), "
          f"concurrency {args.concurrency}, {args.seconds}s per row, lengths 20..200, output_last")
    print("| model         |    req/s | engine-process CPU per request (µs) | CPU busy |")
    print("|---------------|---------:|------------------------------------:|---------:|")
    for model in ("bench", "bench_nobatch"):
        if args.only and model != args.only:
            continue
        profile = cProfile.Profile() if args.profile and model == "bench" else None
        rate, cpu, wall, _, _ = run(_serve(args, repo, model, profile))
        per = 1e6 * cpu / max(1.0, rate * wall)
        print(f"| {model:13s} | {rate:8.0f} | {per:35.1f} | {100 * cpu / wall:7.0f}% |", flush=True)
        if profile is not None:
            profile.dump_stats(args.profile)


if __name__ == "__main__":
    main()

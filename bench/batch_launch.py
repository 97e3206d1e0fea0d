"""Host time the engine process's thread spends per batch: merge + launch, and split once done.

Under load the engine process's one thread is what limits `rnnserve serve` (binary HTTP at
concurrency 64 on an H100 host: that thread at 1.0 core, `bench/serve.py`'s "cores" column),
and most of its time goes to forming and launching batches. This times exactly that path,
``launch_batch`` and ``finish_batch`` of ``service.scheduler.batching``, on the serving
benchmark's LSTM (I=40, H=128, lengths 20..200, many-to-one) with batches made of parts
the way front-end processes send them (1-4 requests merged per message), one batch in
flight behind another as in the server. With ``--arena`` the parts lie in a shared mapping
announced as a front-end's arena (as `rnnserve serve --frontends N` places them), which the
GPU engine maps and gathers batches from (service.engines.cudnn.host_rows); without it they
lie in ordinary memory and batches merge on the host. Run it from two checkouts on one host to compare
code versions without the noise of whole-server runs (autotuning, the host's other load).

    python bench/batch_launch.py [--device cuda] [--batches 8,19,32,64] [--reps 200] [--arena]

``--between-us 0,500``: before each launch the thread also runs that many µs of other Python work
(pickling message-like frames, walking a few MB of objects), untimed, as the server's thread reads and answers
front-end messages between launches; a launch that costs more after it is paying for cold caches, not for
its own work.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


class Placer:
    """Places arrays back to back in a shared mapping announced as a front-end arena (``size`` 0: nowhere)."""

    def __init__(self, size: int) -> None:
        import mmap

        from service.engines import shared_host

        self.buffer = mmap.mmap(-1, size) if size else None
        self.offset = 0
        if self.buffer is not None:
            shared_host.announce("bench-arena", self.buffer)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.buffer is None:
            return x
        if self.offset + x.nbytes > len(self.buffer):
            self.offset = 0  # reused from the start: the pool of batches is built before any runs
        placed = np.ndarray(x.shape, x.dtype, buffer=self.buffer, offset=self.offset)
        placed[...] = x
        self.offset += (x.nbytes + 63) // 64 * 64
        return placed


def make_parts(rng: np.random.Generator, sequences: int, features: int, place=lambda x: x) -> list:
    """``sequences`` requests of 20..200 steps, merged 1-4 per message as a front-end's lane does."""
    from service.scheduler import SequenceWork
    from service.scheduler.batching import merge

    parts, left = [], sequences
    while left:
        k = min(left, int(rng.integers(1, 5)))
        reqs = [SequenceWork(rng.standard_normal((1, n, features)).astype(np.float32), np.array([n]),
                             outputs=frozenset({"output_last"}))
                for n in rng.integers(20, 201, k)]
        m = merge(reqs)
        parts.append(SequenceWork(place(m.x), m.lengths, outputs=frozenset({"output_last"})))
        left -= k
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batches", default="8,19,32,64")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--arena", action="store_true", help="parts in an announced shared mapping (see above)")
    p.add_argument("--between-us", default="0",
                   help="µs of other Python work before each launch, comma-separated for several rows (see above)")
    p.add_argument("--profile", type=Path, default=None,
                   help="write a cProfile of the timed batches (launch and finish) here, as text")
    args = p.parse_args(argv)

    import serve
    from service import create_engine
    from service.repository import load_model
    from service.scheduler.batching import finish_batch, launch_batch

    repo = Path(tempfile.mkdtemp())
    serve.write_repository(repo, 40, 128, 1)
    engine = create_engine(load_model(repo / "bench"), device=args.device)
    place = Placer(64 << 20 if args.arena else 0)
    if not getattr(engine, "launches", False):
        print(f"engine '{engine.name}' does not launch; nothing to time")
        return 0
    rng = np.random.default_rng(0)
    print(f"host ms per batch on the launching thread (median of {args.reps}), engine {engine.name}, "
          f"LSTM I=40 H=128, lengths 20..200, many-to-one, one batch in flight behind another, parts in "
          f"{'a mapped arena' if args.arena else 'ordinary memory'}")
    print("| sequences | parts | other work µs | launch_batch ms | finish_batch ms | per sequence µs | wall ms per batch |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    churn = Churn()
    for b, between in ((int(s), int(u)) for s in args.batches.split(",") for u in args.between_us.split(",")):
        pool = [make_parts(rng, b, 40, place) for _ in range(16)]
        launches, finishes, prev = [], [], None
        profiler = None
        for rep in range(args.reps + 10):
            if rep == 10:
                began = time.perf_counter()
                if args.profile is not None:
                    import cProfile

                    profiler = cProfile.Profile()
                    profiler.enable()
            parts = pool[rep % len(pool)]
            if between:
                churn.run(between * 1e-6)
            t0 = time.perf_counter()
            merged, launched = launch_batch(engine, parts)
            t1 = time.perf_counter()
            if prev is not None:  # the previous batch ends while this one is queued behind it
                prev[1].wait()
                t2 = time.perf_counter()
                finish_batch(engine, *prev)
                t3 = time.perf_counter()
                if rep >= 10:
                    launches.append(t1 - t0)
                    finishes.append(t3 - t2)
            prev = (merged, launched, parts)
        prev[1].wait()
        finish_batch(engine, *prev)
        wall_ms = 1e3 * (time.perf_counter() - began) / args.reps
        if profiler is not None:
            _write_profile(profiler, args.profile, b, args.reps)
        launch_ms, finish_ms = 1e3 * statistics.median(launches), 1e3 * statistics.median(finishes)
        print(f"| {b} | {len(pool[0])} | {between} | {launch_ms:.3f} | {finish_ms:.3f} | {1e3 * (launch_ms + finish_ms) / b:.1f} | {wall_ms:.3f} |",
              flush=True)
    engine.close()
    return 0


class Churn:
    """Python work unrelated to the launch, standing in for reading and answering front-end messages."""

    def __init__(self) -> None:
        self.frame = {"model": "bench", "version": "1", "id": "r-17", "outputs": ["output_last"],
                      "x": np.zeros((1, 120, 40), np.float32), "lengths": np.array([120])}
        self.objects = [{"k": i, "v": (i, str(i))} for i in range(200_000)]  # ~40 MB of small objects
        self.pos = 0

    def run(self, seconds: float) -> None:
        import pickle

        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pickle.loads(pickle.dumps(self.frame))
            window = self.objects[self.pos:self.pos + 2000]
            self.pos = (self.pos + 2000) % len(self.objects)
            sum(d["k"] for d in window)


def _write_profile(profiler, path: Path, batch: int, reps: int) -> None:
    """Append the profile's top functions (own time, then cumulative) for batches of ``batch`` to ``path``."""
    import io
    import pstats

    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"batches of {batch}, {reps} batches (divide times by it for one batch)\n")
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    with path.open("a") as f:
        f.write(out.getvalue())


if __name__ == "__main__":
    raise SystemExit(main())

"""Host time of one ``engine.launch`` by phase, with the GPU idle and with the GPU busy.

The scheduler launches batches from the engine process's event loop, so a launch that
waits for the GPU (a synchronising copy, a pinned buffer still in use) blocks every
request behind it. This launches ragged many-to-one batches of the serving benchmark's
LSTM (bench/serve.py: I=40, H=128, lengths 20..200) once on an idle GPU and once right
behind a long batch still running, and prints the host time of each phase of the launch.
A phase that costs much more behind the busy GPU is waiting for it.

    python bench/launch_phases.py
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PHASES = ("_check", "_staging.upload_inputs", "_run", "_last", "_download")


def main() -> int:
    import serve
    from service.engines.cudnn import CudnnEngine
    from service.repository import load_model

    repo = Path(tempfile.mkdtemp())
    serve.write_repository(repo, 40, 128, 1)
    engine = CudnnEngine(load_model(repo / "bench"), blocking_sync=True)
    spent: dict[str, list[float]] = defaultdict(list)
    for name in PHASES:
        owner, _, attr = name.rpartition(".")
        target = getattr(engine, owner) if owner else engine
        inner = getattr(target, attr)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_name].append(time.perf_counter() - t0)

        setattr(target, attr, timed)
    rng = np.random.default_rng(0)
    long_x = rng.standard_normal((64, 1500, 40)).astype(np.float32)
    print("launch phases, host ms (median of 30), LSTM I=40 H=128, lengths 20..200, last_only; busy = right after "
          "launching a 64 x 1500-step batch")
    print("| B | x MB | GPU | launch ms | " + " | ".join(p.rpartition(".")[2].strip("_") for p in PHASES) + " | wait ms |")
    print("|--:|--:|---|--:|" + "--:|" * len(PHASES) + "--:|")
    for b in (1, 12, 32, 64):
        lengths = rng.integers(20, 201, b)
        x = rng.standard_normal((b, int(lengths.max()), 40)).astype(np.float32)
        for busy in (False, True):
            totals, waits = [], []
            for name in PHASES:
                spent[name].clear()
            for rep in range(33):
                blocker = engine.launch(long_x, None, states_needed=False, last_only=True) if busy else None
                t0 = time.perf_counter()
                launched = engine.launch(x, lengths, states_needed=False, last_only=True)
                t1 = time.perf_counter()
                if blocker is not None:
                    blocker.wait()
                    blocker.finish()
                t2 = time.perf_counter()
                launched.wait()
                launched.finish()
                if rep >= 3:
                    totals.append(t1 - t0)
                    waits.append(time.perf_counter() - t2)
            cells = []
            for name in PHASES:
                got = spent[name][-(30 * (2 if busy else 1)):]
                mine = got[1::2] if busy else got  # busy: every other call is the blocker's
                cells.append(f"{1e3 * statistics.median(mine):.3f}" if mine else "-")
            print(f"| {b} | {x.nbytes / 2**20:.2f} | {'busy' if busy else 'idle'} | "
                  f"{1e3 * statistics.median(totals):.3f} | " + " | ".join(cells) +
                  f" | {1e3 * statistics.median(waits):.3f} |", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

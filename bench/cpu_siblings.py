"""Which CPUs of this host share a physical core, measured rather than read from /sys.

A VM may show every vCPU as a core of its own (`lscpu -e`: one thread per core) while the hypervisor
places two vCPUs on the two hyperthreads of one physical core. Then a busy vCPU slows its hidden
sibling by a third or more, and a process "pinned to a core of its own" is not. This script times a
fixed pure-Python loop on CPU ``--cpu`` alone, then next to a busy loop on each other CPU in turn,
then next to busy loops on all of them, and prints the slowdown of each:

    python bench/cpu_siblings.py            # CPU 0 against every other CPU
    python bench/cpu_siblings.py --cpu 3

A CPU whose busy loop slows ``--cpu`` far more than the others is its likely sibling; the "all busy"
row is what a loaded host costs a thread on ``--cpu`` whatever the pairing (shared caches, memory,
clock).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def _spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    x = 0
    while not stop.is_set():
        for i in range(10000):
            x += i * i


def _timed_loop(n: int) -> float:
    start = time.perf_counter()
    d: dict[int, int] = {}
    x = 0
    for i in range(n):
        x += i * i
        d[i & 1023] = x & 0xFFFF
    return time.perf_counter() - start


def _measure(cpu: int, busy: list[int], n: int, rounds: int) -> float:
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(c, stop), daemon=True) for c in busy]
    for p in procs:
        p.start()
    time.sleep(0.05 if busy else 0.0)
    os.sched_setaffinity(0, {cpu})
    times = [_timed_loop(n) for _ in range(rounds)]
    stop.set()
    for p in procs:
        p.join()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--loop", type=int, default=400_000, help="iterations of the timed loop")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    others = [c for c in cpus if c != args.cpu]
    alone = min(_measure(args.cpu, [], args.loop, args.rounds) for _ in range(3))
    print(f"CPU {args.cpu}, {len(cpus)} CPUs: timed loop alone {1e3 * alone:.1f} ms")
    print("| busy CPU(s) | loop ms | slowdown |")
    print("|---|---:|---:|")
    rows = []
    for c in others:
        t = _measure(args.cpu, [c], args.loop, args.rounds)
        rows.append((t / alone, c))
        print(f"| {c} | {1e3 * t:.1f} | {t / alone:.2f}x |", flush=True)
    t = _measure(args.cpu, others, args.loop, args.rounds)
    print(f"| all {len(others)} others | {1e3 * t:.1f} | {t / alone:.2f}x |")
    worst = max(rows)
    median = statistics.median(r for r, _ in rows)
    print(f"most slowing: CPU {worst[1]} ({worst[0]:.2f}x; median of the others {median:.2f}x)")


if __name__ == "__main__":
    main()

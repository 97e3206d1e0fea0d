"""Where a running server's cores go: CPU of every thread of ``rnnserve serve`` and of its child processes
(front-ends, more engine processes) over a window, summed by process kind and thread name, then the
busiest threads. Shows, for example, whether grpc's own threads in the front-ends take CPU under HTTP load.

    python bench/thread_cpu.py SERVER_PID SECONDS
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def snapshot(pids: list[int]) -> dict[tuple[int, int, str], float]:
    """CPU seconds so far of every thread of ``pids``, keyed by (pid, thread id, thread name)."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
                name = (task / "comm").read_text().strip()
            except FileNotFoundError:  # the thread ended meanwhile
                continue
            fields = stat.rsplit(")", 1)[1].split()
            out[(pid, int(task.name), name)] = (int(fields[11]) + int(fields[12])) / hz
    return out


def main() -> None:
    root, window = int(sys.argv[1]), float(sys.argv[2])
    pids = [root] + [int(p) for p in Path(f"/proc/{root}/task/{root}/children").read_text().split()]
    before = snapshot(pids)
    time.sleep(window)
    after = snapshot(pids)
    rows = sorted(((after[k] - before.get(k, 0.0)) / window, k) for k in after)
    by_name: dict[tuple[str, str], float] = {}
    for cores, (pid, _, name) in rows:
        kind = "main" if pid == root else "child"
        by_name[(kind, name)] = by_name.get((kind, name), 0.0) + cores
    print(f"cores over {window:.0f} s by process (main: the engine process; child: front-ends) and thread name:")
    for (kind, name), cores in sorted(by_name.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:6s} {name:24s} {cores:6.3f}")
    print("busiest threads:")
    for cores, (pid, tid, name) in rows[::-1][:12]:
        print(f"  pid {pid} tid {tid} {name:24s} {cores:6.3f}")


if __name__ == "__main__":
    main()

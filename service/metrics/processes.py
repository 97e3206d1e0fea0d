"""Per-process CPU and memory of the whole server, read from /proc at each scrape.

With ``--frontends N`` / ``--engines N`` the server is several processes, and which one is the
limit (an engine process's thread at one core, a crowded front-end) is the first thing to know
about its load; the engine processes' own registries cannot see the front-ends. So every server
process names itself (``rnnserve``, ``rnnserve-fe-K``, ``rnnserve-eng-K``, and ``rnnserve-js-K``
for the JSON helper of front-end K:
Linux's 15-character process name, ``/proc/PID/comm``), and the process answering ``/metrics``
reads the whole tree, from the topmost process so named down through its children (``rnnserve`` is
the supervisor, which with ``--frontends N`` also runs engine process 0):

- ``rnnserve_process_cpu_seconds_total{process}``: user and system CPU time;
- ``rnnserve_process_resident_memory_bytes{process}``: resident memory.

Off Linux (no /proc) both are absent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "rnnserve"
_PR_SET_NAME = 15
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def name_this_process(name: str) -> None:
    """Set this process's name (``/proc/self/comm``, at most 15 bytes) where the OS allows it; else nothing."""
    library = ctypes.util.find_library("c")
    try:
        prctl = ctypes.CDLL(library, use_errno=True).prctl
    except (OSError, AttributeError, TypeError):
        return  # no libc with prctl (not Linux): the process keeps its name, and its series say "python"
    prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def helper_name() -> str:
    """The name of a helper process (the JSON helper) started by this process's parent: its parent's name with
    ``-js`` in place of its role (``rnnserve-fe-3`` -> ``rnnserve-js-3``)."""
    try:
        parent = _comm(os.getppid())
    except OSError:
        return f"{PREFIX}-js"
    role, _, index = parent.removeprefix(f"{PREFIX}-").partition("-")
    return f"{PREFIX}-js-{index}" if parent.startswith(f"{PREFIX}-") and index else f"{PREFIX}-js"


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _server_pids() -> list[tuple[int, str]]:
    """(pid, name) of every process of this server: the topmost ``rnnserve*`` ancestor of this one (or this one)
    and all its descendants."""
    root = os.getpid()
    while True:
        try:
            parent = int(Path(f"/proc/{root}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent <= 1 or not _comm(parent).startswith(PREFIX):
                break
        except (OSError, ValueError, IndexError):
            break
        root = parent
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            name = _comm(pid)
        except OSError:  # gone meanwhile
            continue
        if name.startswith(PREFIX) or pid == root:  # not multiprocessing's own resource tracker
            out.append((pid, name))
        todo += _children(pid)
    return out


def _families() -> Iterator[Metric]:
    cpu = CounterMetricFamily(f"{PREFIX}_process_cpu_seconds", "CPU time (user and system) of each server "
                              "process, by its name (rnnserve, rnnserve-fe-K, rnnserve-eng-K, rnnserve-js[-K]).",
                              labels=["process"])
    rss = GaugeMetricFamily(f"{PREFIX}_process_resident_memory_bytes", "Resident memory of each server process, "
                            "by its name.", labels=["process"])
    for pid, name in _server_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
        labels = [name]
        cpu.add_metric(labels, (int(fields[11]) + int(fields[12])) / _TICKS)  # utime, stime (fields 14, 15)
        rss.add_metric(labels, pages * _PAGE)
    yield cpu
    yield rss


class _Collector:
    def collect(self) -> Iterator[Metric]:
        yield from _families()


def process_exposition() -> bytes:
    """The two families above as Prometheus text (empty where /proc cannot be read)."""
    if not Path("/proc/self/stat").exists():
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)

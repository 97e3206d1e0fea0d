"""A stopped or wedged child process (front-end or engine) is found by its heartbeat and ended, with the server.

Against real `rnnserve serve` processes: SIGSTOP stands for any child whose event loop no longer runs
(a deadlock, a loop that never yields). Before the heartbeat, such a front-end kept its connections
and their requests waiting for good while health probes, answered by the other front-ends, said 200.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from service.heartbeats import WATCH_S, Heartbeats
from serving_support import build_repository, start_server, stop_server

MESSAGE = "has not run its event loop"


def _children(pid: int) -> list[int]:
    """The server's front-end and engine processes (not multiprocessing's resource tracker)."""
    kids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]


def _role(pid: int) -> str:
    """'engine' or 'frontend': an engine process listens on a Unix socket of its own (engine-K.sock)."""
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            links.append(os.readlink(fd))
        except FileNotFoundError:
            pass
    engine_socks = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
                    if len(line.split()) > 7 and "/engine-" in line.split()[7]}
    if any(link.strip("socket:[]") in engine_socks for link in links if link.startswith("socket:")):
        return "engine"
    return "frontend"


@pytest.mark.parametrize("role", ["frontend", "engine"])
def test_a_stopped_child_is_ended_and_the_server_exits_non_zero(tmp_path, role):
    repo = build_repository(tmp_path / "models")
    output: list[str] = []
    proc, http_url, _ = start_server(repo, "--frontends", "2", "--engines", "2", "--child-stall-timeout-s", "2",
                                     output=output)
    try:
        kids = _children(proc.pid)
        target = next(k for k in kids if _role(k) == role)
        assert httpx.get(f"{http_url}/v2/health/ready", timeout=5).status_code == 200
        os.kill(target, signal.SIGSTOP)
        code = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 1
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any("exited unexpectedly" in line for line in output):
        time.sleep(0.1)
    text = "".join(output)
    assert MESSAGE in text and "killed by SIGKILL" in text, text[-3000:]
    assert all(_zombie_or_gone(k) for k in kids), "children outlived the server"


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_a_whole_server_stopped_and_continued_carries_on(tmp_path):
    """Ctrl-Z then fg stops every process at once: coming back, every child's heartbeat is old, and none of
    them is to blame."""
    repo = build_repository(tmp_path / "models")
    output: list[str] = []
    proc, http_url, _ = start_server(repo, "--frontends", "2", "--child-stall-timeout-s", "1.5", output=output)
    try:
        everyone = [proc.pid, *_children(proc.pid)]
        for pid in everyone:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(4)
        for pid in reversed(everyone):  # the supervisor last: its children count again before it looks
            os.kill(pid, signal.SIGCONT)
        time.sleep(3)
        assert proc.poll() is None, "".join(output)[-3000:]
        assert httpx.get(f"{http_url}/v2/health/ready", timeout=5).status_code == 200
    finally:
        code = stop_server(proc)
    assert code == 0
    assert MESSAGE not in "".join(output)


class _Ctx:
    """multiprocessing's RawArray, as the spawn context gives it."""

    RawArray = staticmethod(multiprocessing.get_context("spawn").RawArray)


def test_the_watch_counts_only_its_own_running_time():
    beats = Heartbeats(_Ctx(), 2)
    assert beats.stalled(WATCH_S, 1.0) == []  # nothing counted yet: starting, never stalled
    for _ in range(10):
        assert beats.stalled(WATCH_S, 1.0) == []
    beats.counts[0] = beats.counts[1] = 1
    assert beats.stalled(WATCH_S, 1.0) == []  # moved
    beats.counts[1] = 2
    assert beats.stalled(WATCH_S, 1.0) == []  # slot 0 still for one look
    beats.counts[1] = 3
    assert beats.stalled(3600.0, 1.0) == [0]  # an hour away counts as two looks: 1.5 s >= 1 s
    beats.counts[0] = 2
    assert beats.stalled(WATCH_S, 1.0) == []
    assert beats.stalled(WATCH_S, 0.0) == []  # 0: never
    assert beats.stalled(3600.0, 0.0) == []

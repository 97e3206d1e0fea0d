"""HTTP connections spread evenly over front-end processes (service/transports/rest/balanced_accept.py).

In one event loop, each "front-end" is a BalancedAcceptor on its own duplicate of one listening
socket (as spawned front-ends hold), with a slot in one ConnectionTable; then a real
`rnnserve serve --frontends 4` whose connections are counted per front-end from /proc.
"""
from __future__ import annotations

import asyncio
import http.client
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.ports import bind_listener
from service.transports.rest import balanced_accept
from service.transports.rest.balanced_accept import BalancedAcceptor, ConnectionTable, shared_listener
from serving_support import build_repository, start_server, stop_server, write_config


class _Held(asyncio.Protocol):
    """Keeps its connection open; ``lost`` is set when it ends."""

    def __init__(self) -> None:
        self.lost = asyncio.Event()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()


async def _wait_for(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _connect(port: int, n: int) -> list[socket.socket]:
    loop = asyncio.get_running_loop()
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        await loop.sock_connect(s, ("127.0.0.1", port))
        socks.append(s)
    return socks


async def _frontends(count: int, slots: int | None = None):
    listener = shared_listener(bind_listener("127.0.0.1", 0))
    table = ConnectionTable(slots or count)
    protocols: list[list[_Held]] = [[] for _ in range(count)]
    acceptors = []
    for k in range(count):
        def factory(k=k):
            p = _Held()
            protocols[k].append(p)
            return p
        a = BalancedAcceptor(listener.dup(), table, k, factory)
        a.start()
        acceptors.append(a)
    return listener, table, acceptors, protocols


def _close(listener, acceptors, socks) -> None:
    for s in socks:
        s.close()
    for a in acceptors:
        a.close()
    listener.close()


@pytest.mark.asyncio
async def test_connections_spread_evenly_and_a_closed_one_frees_its_slot():
    listener, table, acceptors, protocols = await _frontends(4)
    port = listener.getsockname()[1]
    socks = await _connect(port, 14)
    try:
        await _wait_for(lambda: sum(table.counts) == 14 and sum(map(len, protocols)) == 14)
        # within one of each other: 4 4 3 3 in some order (the kernel's hash gave 3..12 of 64 over 8)
        assert sorted(table.counts) == [3, 3, 4, 4]
        assert [len(p) for p in protocols] == list(table.counts)
        # a front-end whose client hangs up holds one fewer, and the next connection goes to one of the fewest
        before = list(table.counts)
        socks.pop(0).close()
        await _wait_for(lambda: sum(table.counts) == 13)
        assert sorted(table.counts) in ([3, 3, 3, 4], [2, 3, 4, 4]) and before != list(table.counts)
        socks += await _connect(port, 1)
        await _wait_for(lambda: sum(table.counts) == 14)
        assert sorted(table.counts) in ([3, 3, 4, 4], [3, 3, 4, 4])
        assert [len([p for p in ps if not p.lost.is_set()]) for ps in protocols] == list(table.counts)
    finally:
        _close(listener, acceptors, socks)


@pytest.mark.asyncio
async def test_a_front_end_with_more_still_accepts_when_the_one_with_fewest_does_not(monkeypatch):
    # slot 1 belongs to a front-end that holds nothing and never accepts (busy or stuck)
    monkeypatch.setattr(balanced_accept, "DEFER_S", 0.01)
    listener, table, acceptors, protocols = await _frontends(1, slots=2)
    table.counts[0] = 5
    port = listener.getsockname()[1]
    t0 = time.monotonic()
    socks = await _connect(port, 1)
    try:
        await _wait_for(lambda: len(protocols[0]) == 1)
        waited = time.monotonic() - t0
        # it looked MAX_DEFERS times, DEFER_S apart, before taking the connection itself
        assert waited >= balanced_accept.MAX_DEFERS * 0.01 * 0.9
        assert table.counts[0] == 6
    finally:
        _close(listener, acceptors, socks)


@pytest.mark.asyncio
async def test_a_closed_acceptor_takes_no_more_connections():
    listener, table, acceptors, protocols = await _frontends(2)
    port = listener.getsockname()[1]
    acceptors[0].close()
    socks = await _connect(port, 3)
    try:
        await _wait_for(lambda: len(protocols[1]) == 3)
        assert len(protocols[0]) == 0 and list(table.counts) == [0, 3]
    finally:
        _close(listener, acceptors, socks)


def _established_per_process(pids: list[int], port: int) -> dict[int, int]:
    """Established TCP connections on local ``port`` that each process holds (Linux /proc)."""
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        for line in Path(name).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":
                inodes.add(f[9])
    held = {}
    for pid in pids:
        n = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                n += 1
        held[pid] = n
    return held


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts connections from /proc")
@pytest.mark.parametrize("balance", ["connections", "kernel"])
def test_a_real_server_spreads_kept_alive_connections_over_its_front_ends(tmp_path, balance):
    repo = build_repository(tmp_path / "models")
    proc, http_url, _ = start_server(repo, "--frontends", "4", "--http-balance", balance)
    conns = []
    try:
        host, port = http_url.split("://")[1].rsplit(":", 1)
        for _ in range(16):
            c = http.client.HTTPConnection(host, int(port), timeout=10)
            c.request("GET", "/v2/health/ready")
            r = c.getresponse()
            r.read()
            assert r.status == 200
            conns.append(c)
        for c in conns:  # every connection still serves (kept alive)
            c.request("GET", "/v2/models/lstm/ready")
            r = c.getresponse()
            r.read()
            assert r.status == 200
        children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        held = _established_per_process(children, int(port))
        assert sum(held.values()) == 16
        if balance == "connections":
            assert sorted(v for v in held.values() if v) == [4, 4, 4, 4]
    finally:
        for c in conns:
            c.close()
        assert stop_server(proc) == 0


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["connections", "kernel"])
def test_new_connections_are_refused_once_the_drain_begins(tmp_path, balance):
    repo = build_repository(tmp_path / "models")
    # a lone request waits 10 s for a fuller batch, so the server is still draining (up to 5 s) when we connect
    write_config(repo, "lstm", max_batch_size=8, max_queue_delay_us=10_000_000)
    proc, http_url, _ = start_server(repo, "--frontends", "2", "--http-balance", balance, "--drain-timeout-s", "5")
    host, port = http_url.split("://")[1].rsplit(":", 1)
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 4], "data": [0.0] * 12}]}
    held = threading.Thread(target=lambda: httpx.post(f"{http_url}/v2/models/lstm/infer", json=body, timeout=30))
    try:
        held.start()
        deadline = time.monotonic() + 20
        while "rnnserve_queue_depth{model=\"lstm\",version=\"1\"} 1.0" not in httpx.get(f"{http_url}/metrics").text:
            assert time.monotonic() < deadline, "the request did not queue"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "connections were still taken 3 s into the drain"
            time.sleep(0.05)
        assert proc.poll() is None, "the server had already exited: the test did not see the drain"
    finally:
        rc = stop_server(proc) if proc.poll() is None else proc.wait()
        held.join(30)
    assert rc == 0


@pytest.mark.asyncio
async def test_a_connection_its_client_reset_before_the_accept_is_skipped():
    # accept() raises ECONNABORTED when the client resets a queued connection; that escaped the reader callback
    listener, table, acceptors, protocols = await _frontends(1)
    real = acceptors[0]._sock
    aborts = []

    class Aborting:
        def accept(self):
            if not aborts:
                aborts.append(1)
                raise ConnectionAbortedError(103, "Software caused connection abort")
            return real.accept()

        def __getattr__(self, name):
            return getattr(real, name)

    acceptors[0]._sock = Aborting()
    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    socks = await _connect(listener.getsockname()[1], 2)
    await _wait_for(lambda: table.counts[0] == 2)
    assert aborts and errors == [] and len(protocols[0]) == 2
    acceptors[0]._sock = real
    _close(listener, acceptors, socks)

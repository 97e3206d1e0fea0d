"""A server's ports are its own: a second server on the same ports fails at start with a message, in every
layout (one process, front-end processes), instead of silently sharing them through SO_REUSEPORT."""
from __future__ import annotations

import asyncio
import errno
import socket
import subprocess
import sys
import urllib.request

import pytest

from service import ports
from service.errors import RNNServeError
from serving_support import ROOT, build_repository, start_server, stop_server

IN_USE = "address already in use; another process \\(perhaps another rnnserve\\) listens there"


def _front_end_socket(port: int) -> socket.socket:
    """What a front-end process binds: SO_REUSEADDR and SO_REUSEPORT, listening."""
    sock = ports.bind_listener("127.0.0.1", port, reuse_port=True)
    sock.listen()
    return sock


def test_a_claimed_port_takes_the_front_ends_and_refuses_another_server():
    claim = ports.claim_port("127.0.0.1", 0)
    try:
        first, second = _front_end_socket(claim.port), _front_end_socket(claim.port)  # both front-ends join
        for other in (lambda: ports.claim_port("127.0.0.1", claim.port),  # another front-end server
                      lambda: ports.bind_listener("127.0.0.1", claim.port)):  # a single-process one
            with pytest.raises(RNNServeError, match=IN_USE):
                other()
        first.close(), second.close()
        # no front-end listens any more, and the holder still keeps others out
        with pytest.raises(RNNServeError, match=IN_USE):
            ports.claim_port("127.0.0.1", claim.port)
    finally:
        claim.close()
    ports.claim_port("127.0.0.1", claim.port).close()  # released


def test_the_holder_takes_no_connections():
    claim = ports.claim_port("127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", claim.port), timeout=2).close()
    finally:
        claim.close()


def test_a_port_another_program_listens_on_cannot_be_claimed():
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    try:
        with pytest.raises(RNNServeError, match=f"127.0.0.1:{other.getsockname()[1]}: {IN_USE}.*choose another port"):
            ports.claim_port("127.0.0.1", other.getsockname()[1])
    finally:
        other.close()


def test_a_picked_grpc_port_is_never_the_http_port(monkeypatch):
    """The system may hand the same free port out twice; the gRPC claim asks again."""
    handed = iter([41000, 41000, 41001])

    class Fake:
        def __init__(self, *_):
            self.port = 0

        def setsockopt(self, *_):
            pass

        def bind(self, address):
            self.port = address[1] or next(handed)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(ports, "_socket", Fake)
    assert ports.claim_port("127.0.0.1", 0).port == 41000
    assert ports.claim_port("127.0.0.1", 0, avoid=41000).port == 41001
    class Same(Fake):
        def bind(self, address):
            self.port = 41000  # every port the system hands out is the HTTP one

    monkeypatch.setattr(ports, "_socket", Same)
    with pytest.raises(RNNServeError, match="set --http-port and --grpc-port"):
        ports.claim_port("127.0.0.1", 0, avoid=41000)


def test_a_grpc_server_does_not_join_a_port_another_grpc_server_listens_on():
    pytest.importorskip("grpc")
    from grpc import aio

    from service.transports.grpc import create_grpc_server

    async def main() -> None:
        other = aio.server()  # grpc's defaults: SO_REUSEPORT on
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        try:
            with pytest.raises(RNNServeError, match=f"127.0.0.1:{port} \\(--grpc-port\\): {IN_USE}"):
                create_grpc_server(None, "127.0.0.1", port)
        finally:
            await other.stop(None)

    asyncio.run(main())


def test_each_reason_a_port_cannot_be_had_says_what_to_change():
    no_such = "192.0.2.1:0 \\(--http-port\\): this machine has no such address; check --host"
    with pytest.raises(RNNServeError, match=no_such):
        ports.bind_listener("192.0.2.1", 0, flag="--http-port")  # TEST-NET-1: never a local address
    denied = ports.listen_error("0.0.0.0:80", PermissionError(errno.EACCES, "Permission denied"))
    assert str(denied) == ("cannot listen on 0.0.0.0:80: permission denied (ports below 1024 need privileges); "
                           "choose a port above 1023")
    assert "its log line above says why" in str(ports.listen_error("0.0.0.0:8001 (--grpc-port)", None))


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [((), ()), (("--frontends", "2"), ("--frontends", "2")),
                                           ((), ("--frontends", "2")), (("--frontends", "2"), ())],
                         ids=["single-single", "frontends-frontends", "single-frontends", "frontends-single"])
def test_a_second_server_on_the_same_ports_fails_and_the_first_keeps_them(tmp_path, first, second):
    repo = build_repository(tmp_path / "models")
    proc, http_url, grpc_url = start_server(repo, *first)
    try:
        http_port, grpc_port = http_url.rsplit(":", 1)[1], grpc_url.rsplit(":", 1)[1]
        for ports_asked, taken, flag in (((http_port, "0"), http_port, "--http-port"),
                                         (("0", grpc_port), grpc_port, "--grpc-port")):
            out = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--repository", str(repo),
                                  "--host", "127.0.0.1", "--http-port", ports_asked[0], "--grpc-port", ports_asked[1],
                                  "--device", "cpu", *second], cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert out.returncode != 0, out.stdout + out.stderr
            assert f"cannot listen on 127.0.0.1:{taken} ({flag}): address already in use" in out.stderr + out.stdout
            assert "rnnserve: HTTP on" not in out.stdout
            assert "server process" not in out.stdout + out.stderr  # uvicorn never started (nor stopped)
        with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=5) as answer:
            assert answer.status == 200
    finally:
        assert stop_server(proc) == 0

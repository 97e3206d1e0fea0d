"""The floor of each transport at concurrency 1: a canned answer, no rnnserve code.

Starts a server process that answers every call with the same bytes, then times
back-to-back calls from a blocking client in this process, for:

- ``grpc``: a grpc.aio server (uvloop) with one unary method, called through grpc's
  blocking stub (what ``tritonclient.grpc`` uses), under grpc's default core
  settings and under rnnserve's (``service/transports/grpc/core_config.py``);
- ``http``: a uvloop asyncio server that answers keep-alive HTTP/1.1 requests
  with a canned response, called over one raw socket.

What rnnserve adds at concurrency 1 (``bench/serve.py``'s "p50 - engine") cannot be
lower than this floor on the same host::

    python bench/transport_floor.py [--calls 3000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD = "/inference.GRPCInferenceService/ModelInfer"
REQUEST = b"r" * 2000
ANSWER = b"a" * 200
HTTP_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 200\r\ncontent-type: application/octet-stream\r\n\r\n" + ANSWER


def serve_grpc() -> None:
    import grpc
    import uvloop
    from grpc import aio

    async def answer(request, context):
        return ANSWER

    async def main():
        server = aio.server()
        handler = grpc.unary_unary_rpc_method_handler(answer)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {"ModelInfer": handler}),))
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def serve_http() -> None:
    import uvloop

    class Canned(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buffer = transport, b""

        def data_received(self, data):
            self.buffer += data
            while True:  # a request: headers, then content-length bytes
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                size = int(self.buffer[:end].lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(self.buffer) < end + 4 + size:
                    return
                self.buffer = self.buffer[end + 4 + size:]
                self.transport.write(HTTP_ANSWER)

    async def main():
        server = await asyncio.get_running_loop().create_server(Canned, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    uvloop.run(main())


def time_grpc(port: int, calls: int) -> list[float]:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(METHOD)
        return _time(lambda: call(REQUEST), calls)


def time_http(port: int, calls: int) -> list[float]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = (f"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: {len(REQUEST)}\r\n\r\n"
               .encode() + REQUEST)

    def one():
        sock.sendall(request)
        got = 0
        while got < len(HTTP_ANSWER):
            got += len(sock.recv(65536))

    try:
        return _time(one, calls)
    finally:
        sock.close()


def _time(fn, calls: int) -> list[float]:
    for _ in range(min(300, calls)):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run(kind: str, experiments: str | None, calls: int) -> list[float]:
    """Starts the ``kind`` server (and times it) with GRPC_EXPERIMENTS=``experiments`` in both processes."""
    env = dict(os.environ)
    env.pop("GRPC_EXPERIMENTS", None)
    if experiments is not None:
        env["GRPC_EXPERIMENTS"] = experiments
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import transport_floor as t; t.serve_{kind}()"
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        if kind == "http":
            return time_http(port, calls)
        out = subprocess.run(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import transport_floor "
             f"as t; print(' '.join(map(repr, t.time_grpc({port}, {calls}))))"],
            env=env, capture_output=True, text=True, check=True)
        return [float(x) for x in out.stdout.split()]
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000, help="timed calls per row (default 3000)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of all rows, interleaved (default 2)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from service.transports.grpc.core_config import DEFAULT_EXPERIMENTS

    rows = [("http", "raw HTTP/1.1, uvloop", None),
            ("grpc", "grpc.aio, grpc defaults", ""),
            ("grpc", f"grpc.aio, rnnserve's ({DEFAULT_EXPERIMENTS})", DEFAULT_EXPERIMENTS)]
    print(f"canned answers at concurrency 1, blocking client, {args.calls} calls per cell, {os.cpu_count()} CPUs")
    print("| transport | round | p50 ms | p90 ms | p99 ms |")
    print("|---|--:|--:|--:|--:|")
    for r in range(1, args.rounds + 1):
        for kind, label, experiments in rows:
            t = sorted(run(kind, experiments, args.calls))
            q = lambda f: t[min(len(t) - 1, int(f * len(t)))] * 1e3  # noqa: E731
            print(f"| {label} | {r} | {statistics.median(t) * 1e3:.3f} | {q(0.9):.3f} | {q(0.99):.3f} |", flush=True)


if __name__ == "__main__":
    main()

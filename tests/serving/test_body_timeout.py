"""A request body that stops arriving gets 408 after --body-timeout-s, and its connection closes.

uvicorn alone waits for a body as long as the connection stays open, so a client that sent its headers, or
part of a body, and then nothing held a connection, its bytes and a task for good (a slowloris). In process
for the answer and the cancel's bookkeeping; against a real server, one process and with front-ends, on a raw
socket, as such a client would send it.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
import urllib.request

import pytest

from serving_support import rest_client, start_server, stop_server

BODY = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2, 4], "data": [0.5] * 8}]}).encode()


@pytest.mark.asyncio
async def test_a_stalled_body_gets_408_and_a_steady_one_is_served(repo):
    async def stalled():
        yield BODY[:20]
        await asyncio.sleep(30)
        yield BODY[20:]

    async def slow_but_steady():  # pauses shorter than the limit, 3 s in all
        for i in range(0, len(BODY), 16):
            await asyncio.sleep(0.25)
            yield BODY[i:i + 16]

    async with rest_client(repo, body_timeout_s=0.5) as (client, _):
        start = time.monotonic()
        r = await client.post("/v2/models/lstm/infer", content=stalled())
        took = time.monotonic() - start
        assert r.status_code == 408, r.text
        assert r.json()["error"] == ("the request body stopped arriving for more than 0.5 s (--body-timeout-s); "
                                     "send the whole body without pausing")
        assert r.headers["connection"] == "close"
        assert took < 5  # the limit, then the next sweep of the shared timer (1 s)
        for path in ("/v2/models/lstm/infer", "/v2/repository/index", "/v1/models/lstm:predict"):
            body = BODY if "infer" in path else (b"{}" if "index" in path else b'{"instances": [[[1, 2, 3, 4]]]}')

            async def steady(body=body):
                for i in range(0, len(body), 8):
                    await asyncio.sleep(0.15)
                    yield body[i:i + 8]

            r = await client.post(path, content=steady())
            assert r.status_code == 200, (path, r.text)
        r = await client.post("/v2/models/lstm/infer", content=slow_but_steady())
        assert r.status_code == 200, r.text
        assert (await client.get("/v2/health/live")).status_code == 200


@pytest.mark.asyncio
async def test_no_limit_with_zero(repo):
    async def paused():
        yield BODY[:20]
        await asyncio.sleep(1.6)  # past the sweep's period, so a timer would have fired
        yield BODY[20:]

    async with rest_client(repo, body_timeout_s=0) as (client, _):
        r = await client.post("/v2/models/lstm/infer", content=paused())
        assert r.status_code == 200, r.text


def _stall(http_url: str, head_only: bool) -> tuple[bytes, float]:
    """Send headers (and part of a body, unless ``head_only``), then nothing; what the server answers, and when."""
    host, port = http_url.split("://")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v2/models/lstm/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(BODY) + (b"" if head_only else BODY[:30]))
        start, answer = time.monotonic(), b""
        while True:
            part = s.recv(65536)
            if not part:  # the server closed the connection after its answer
                return answer, time.monotonic() - start
            answer += part


@pytest.mark.parametrize("layout", [[], ["--frontends", "2"]], ids=["one process", "front-ends"])
def test_a_real_server_answers_a_stalled_client_and_closes(repo, layout):
    proc, http_url, _ = start_server(repo, "--body-timeout-s", "0.5", *layout)
    try:
        for head_only in (True, False):
            answer, took = _stall(http_url, head_only)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b"--body-timeout-s" in answer and took < 5
        req = urllib.request.Request(f"{http_url}/v2/models/lstm/infer", data=BODY,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    finally:
        assert stop_server(proc) == 0


@pytest.mark.parametrize("layout", [[], ["--frontends", "2"]], ids=["one process", "front-ends"])
def test_a_stalled_body_does_not_hold_the_drain(repo, layout):
    """SIGTERM while a client's body is stalled: with no body limit (0) and a 30 s drain, the stall is cut after the
    drain's pause (1 s) with a 503 to send it again, while a body that keeps arriving is still read and answered."""
    import threading

    proc, http_url, _ = start_server(repo, "--body-timeout-s", "0", "--drain-timeout-s", "30", *layout)
    host, port = http_url.split("://")[1].split(":")
    answers: dict[str, bytes] = {}

    def steady() -> None:  # a part every 0.3 s, 3 s in all
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(b"POST /v2/models/lstm/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(BODY))
            step = -(-len(BODY) // 10)
            for i in range(0, len(BODY), step):
                time.sleep(0.3)
                s.sendall(BODY[i:i + step])
            answers["steady"] = s.recv(65536)

    def stalled() -> None:
        answers["stalled"], _ = _stall(http_url, head_only=False)

    threads = [threading.Thread(target=f) for f in (stalled, steady)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)  # both are reading their bodies
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(20)
        assert proc.wait(20) == 0
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert answers["stalled"].startswith(b"HTTP/1.1 503 "), answers["stalled"]
    assert b"shutting down" in answers["stalled"] and b"send it again" in answers["stalled"]
    assert answers["steady"].startswith(b"HTTP/1.1 200 "), answers["steady"]
    assert took < 10  # not the 30 s drain

"""DecodeGate (service.transports.rest.decode_gate): large JSON bodies are decoded a bounded number of bytes at once."""
from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import pytest

from service import create_engine
from service.repository import load_model
from service.transports.rest.decode_gate import OFFLOAD_BYTES, DecodeGate
from serving_support import rest_client

pytestmark = pytest.mark.asyncio


async def _enter(gate: DecodeGate, size: int, entered: list, leave: asyncio.Event) -> None:
    async with gate.hold(size):
        entered.append(size)
        await leave.wait()


async def test_admits_within_capacity_in_arrival_order():
    gate = DecodeGate(100)
    entered: list[int] = []
    leave = {k: asyncio.Event() for k in "abcd"}
    a = asyncio.create_task(_enter(gate, 60, entered, leave["a"]))
    await asyncio.sleep(0)
    b = asyncio.create_task(_enter(gate, 60, entered, leave["b"]))
    c = asyncio.create_task(_enter(gate, 10, entered, leave["c"]))  # would fit, but waits behind b: no starving
    await asyncio.sleep(0.01)
    assert entered == [60] and gate.in_use == 60
    leave["a"].set()
    await asyncio.sleep(0.01)
    assert entered == [60, 60, 10] and gate.in_use == 70
    d = asyncio.create_task(_enter(gate, 500, entered, leave["d"]))  # over the capacity: goes alone, as 100
    await asyncio.sleep(0.01)
    assert entered == [60, 60, 10]
    leave["b"].set()
    leave["c"].set()
    await asyncio.sleep(0.01)
    assert entered[-1] == 500 and gate.in_use == 100
    leave["d"].set()
    await asyncio.gather(a, b, c, d)
    assert gate.in_use == 0


async def test_a_cancelled_waiter_leaves_and_lets_the_next_in():
    gate = DecodeGate(100)
    entered: list[int] = []
    hold, never = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(_enter(gate, 90, entered, hold))
    await asyncio.sleep(0)
    big = asyncio.create_task(_enter(gate, 50, entered, never))
    small = asyncio.create_task(_enter(gate, 10, entered, hold))
    await asyncio.sleep(0.01)
    assert entered == [90]
    big.cancel()
    await asyncio.sleep(0.01)
    assert entered == [90, 10] and gate.in_use == 100  # the 10 behind the cancelled 50 fits now
    hold.set()
    await asyncio.gather(first, small)
    with pytest.raises(asyncio.CancelledError):
        await big
    assert gate.in_use == 0


async def test_large_json_bodies_decode_through_the_gate_and_answer_right(repo, monkeypatch):
    """Bodies past the offload size, at once, more than the gate holds: every answer equals the engine's."""
    held: list[tuple[int, int]] = []  # (size, bytes in use once admitted)
    hold = DecodeGate.hold

    def recording(self, size):
        @contextlib.asynccontextmanager
        async def held_block():
            async with hold(self, size):
                held.append((size, self.in_use))
                yield
        return held_block()

    monkeypatch.setattr(DecodeGate, "hold", recording)
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((1, 4000 + 100 * k, 4)).astype(np.float32) for k in range(6)]
    bodies = [json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                      "data": x.ravel().tolist()}], "outputs": [{"name": "output_last"}]}).encode()
              for x in xs]
    assert all(OFFLOAD_BYTES < len(b) < 400 * 1024 for b in bodies)
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    # the gate holds two bodies at the limit: six large ones at once take turns
    async with rest_client(repo, max_request_bytes=400 * 1024) as (client, _):
        answers = await asyncio.gather(*(client.post("/v2/models/lstm/infer", content=b) for b in bodies))
        instances = {"instances": [xs[0][0, :3000].tolist(), xs[1][0, :1000].tolist()], "outputs": ["output_last"]}
        assert OFFLOAD_BYTES < len(json.dumps(instances)) < 400 * 1024
        predict = await client.post("/v1/models/lstm:predict", content=json.dumps(instances).encode())
        bad = await client.post("/v1/models/lstm:predict", content=json.dumps({**instances, "outputs": ["x"]}).encode())
    # every large body went through the gate, and it never held more than two bodies at the limit
    assert len(held) == 8 and all(size > OFFLOAD_BYTES for size, _ in held)
    assert max(in_use for _, in_use in held) <= 2 * 400 * 1024
    for x, r in zip(xs, answers):
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["outputs"][0]["data"], np.float32)
        np.testing.assert_allclose(got, engine.forward(x).output[0, -1], rtol=1e-5, atol=1e-6)
    assert predict.status_code == 200, predict.text
    for x, p in zip((xs[0][:, :3000], xs[1][:, :1000]), predict.json()["predictions"]):
        np.testing.assert_allclose(p["output_last"], engine.forward(x).output[0, -1], rtol=1e-5, atol=1e-6)
    assert bad.status_code == 400 and "invalid request body: outputs.0" in bad.json()["error"]

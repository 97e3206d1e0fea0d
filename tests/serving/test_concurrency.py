"""Many concurrent REST requests of different lengths; overload (503) and timeouts (504); metrics."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service import create_engine
from service.repository import load_model
from serving_support import rest_client, write_config

pytestmark = pytest.mark.asyncio


def _body(x, lengths, **params):
    body = {"inputs": [
        {"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()},
        {"name": "lengths", "datatype": "INT32", "shape": [len(lengths)], "data": [int(n) for n in lengths]},
    ]}
    if params:
        body["parameters"] = params
    return body


def _outputs(resp):
    return {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in resp.json()["outputs"]}


def _metrics(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples, name, **labels):
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_concurrent_requests_equal_single_requests(repo):
    rng = np.random.default_rng(7)
    requests = []
    for i in range(60):
        b = 1 + i % 3
        t = int(rng.integers(1, 40))
        x = rng.standard_normal((b, t, 4)).astype(np.float32)
        requests.append((x, rng.integers(1, t + 1, size=b)))
    engine = create_engine(load_model(repo / "lstm"), "cpu")
    # the compiled kernel sums every row in one order, so batching leaves every bit as it was; NumPy's matmul
    # takes other paths for other row counts (~1e-7 apart)
    atol = 0 if engine.describe()["cpu_kernel"].startswith("native") else 1e-5
    write_config(repo, "lstm", max_queue_delay_us=5000)
    async with rest_client(repo) as (client, dataplane):
        singles = [_outputs(await client.post("/v2/models/lstm/infer", json=_body(x, n))) for x, n in requests[:10]]
        answers = await asyncio.gather(*(client.post("/v2/models/lstm/infer", json=_body(x, n)) for x, n in requests))
        assert all(r.status_code == 200 for r in answers)
        for i, ((x, n), resp) in enumerate(zip(requests, answers)):
            got = _outputs(resp)
            direct = engine.forward(x, n)
            np.testing.assert_allclose(got["output"], direct.output, rtol=0, atol=atol)
            np.testing.assert_allclose(got["h_n"], direct.h_n, rtol=0, atol=atol)
            np.testing.assert_allclose(got["c_n"], direct.c_n, rtol=0, atol=atol)
            if i < 10:
                for name, value in singles[i].items():
                    np.testing.assert_allclose(got[name], value, rtol=0, atol=atol)
        m = _metrics((await client.get("/metrics")).text)
    sizes = m["rnnserve_batch_size"]
    batches = _value(sizes, "rnnserve_batch_size_count", model="lstm")
    sequences = _value(sizes, "rnnserve_batch_size_sum", model="lstm")
    assert sequences == sum(x.shape[0] for x, _ in requests[:10]) + sum(x.shape[0] for x, _ in requests)
    assert batches < 10 + 60  # concurrent requests were batched together


async def test_overload_gives_503_and_timeout_gives_504(repo, monkeypatch):
    # The long request must still be computing when the late one arrives: NumPy's ~20 us
    # a step gives that with 8000 steps; the compiled LSTM kernel would finish first.
    monkeypatch.setenv("RNNSERVE_NATIVE_CPU", "0")
    write_config(repo, "lstm", max_batch_size=1, max_queue_size=1, max_queue_delay_us=0)
    x = np.random.default_rng(0).standard_normal((1, 400, 4)).astype(np.float32)
    async with rest_client(repo) as (client, _):
        answers = await asyncio.gather(*(client.post("/v2/models/lstm/infer", json=_body(x, [400])) for _ in range(12)))
        codes = [r.status_code for r in answers]
        assert codes.count(200) >= 1 and codes.count(503) >= 1, codes
        busy = next(r for r in answers if r.status_code == 503)
        assert "model 'lstm' is overloaded: 1 requests are waiting (max_queue_size 1); retry later" in busy.json()["error"]

        async def late_with_timeout():
            await asyncio.sleep(0.03)  # the long request (~150 ms of compute) is running by now
            return await client.post("/v2/models/lstm/infer", json=_body(x[:, :5], [5], timeout=1000))

        long_x = np.zeros((1, 8000, 4), np.float32)
        long_one, timed = await asyncio.gather(client.post("/v2/models/lstm/infer", json=_body(long_x, [8000])),
                                               late_with_timeout())
        assert long_one.status_code == 200
        assert timed.status_code == 504 and "timeout ran out after it waited" in timed.json()["error"], timed.text
        assert (await client.get("/v2/health/live")).status_code == 200
        m = _metrics((await client.get("/metrics")).text)
    req = m["rnnserve_requests"]
    assert _value(req, "rnnserve_requests_total", model="lstm", outcome="unavailable") >= 1
    assert _value(req, "rnnserve_requests_total", model="lstm", outcome="deadline_exceeded") == 1


async def test_metrics_exposition(repo):
    x = np.random.default_rng(0).standard_normal((2, 6, 4)).astype(np.float32)
    async with rest_client(repo) as (client, _):
        assert (await client.post("/v2/models/lstm/infer", json=_body(x, [6, 2]))).status_code == 200
        assert (await client.post("/v2/models/lstm/infer", json=_body(x[:, :, :3], [6, 2]))).status_code == 400
        assert (await client.post("/v2/models/ghost/infer", json=_body(x, [6, 2]))).status_code == 404
        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        m = _metrics(r.text)
    lab = {"model": "lstm", "version": "1"}
    assert _value(m["rnnserve_requests"], "rnnserve_requests_total", outcome="success", **lab) == 1
    assert _value(m["rnnserve_requests"], "rnnserve_requests_total", outcome="invalid_argument", **lab) == 1
    assert _value(m["rnnserve_requests"], "rnnserve_requests_total", model="", outcome="not_found") == 1
    for hist in ("rnnserve_request_duration_seconds", "rnnserve_queue_duration_seconds",
                 "rnnserve_compute_duration_seconds", "rnnserve_batch_timesteps"):
        assert _value(m[hist], f"{hist}_count", **lab) == 1, hist
    assert _value(m["rnnserve_batch_size"], "rnnserve_batch_size_sum", **lab) == 2
    assert _value(m["rnnserve_batch_timesteps"], "rnnserve_batch_timesteps_sum", **lab) == 6
    assert _value(m["rnnserve_computed_timesteps"], "rnnserve_computed_timesteps_total", **lab) == 12
    assert _value(m["rnnserve_useful_timesteps"], "rnnserve_useful_timesteps_total", **lab) == 8
    assert _value(m["rnnserve_queue_depth"], "rnnserve_queue_depth", **lab) == 0
    assert _value(m["rnnserve_model_ready"], "rnnserve_model_ready", **lab) == 1
    assert _value(m["rnnserve_model_engine"], "rnnserve_model_engine", engine="reference", **lab) == 1
    assert _value(m["rnnserve_model_load_duration_seconds"], "rnnserve_model_load_duration_seconds_count", **lab) == 1
    assert _value(m["rnnserve_device_memory_bytes"], "rnnserve_device_memory_bytes", device="cpu") == 0


async def test_reload_keeps_the_gauges_and_unload_sets_not_ready(repo):
    x = np.random.default_rng(0).standard_normal((1, 4, 4)).astype(np.float32)
    lab = {"model": "lstm", "version": "1"}
    async with rest_client(repo) as (client, _):
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200  # a reload
        assert (await client.post("/v2/models/lstm/infer", json=_body(x, [4]))).status_code == 200
        m = _metrics((await client.get("/metrics")).text)
        assert _value(m["rnnserve_model_ready"], "rnnserve_model_ready", **lab) == 1
        assert _value(m["rnnserve_queue_depth"], "rnnserve_queue_depth", **lab) == 0
        assert _value(m["rnnserve_model_engine"], "rnnserve_model_engine", engine="reference", **lab) == 1
        assert (await client.post("/v2/repository/models/lstm/unload")).status_code == 200
        m = _metrics((await client.get("/metrics")).text)
        # not ready stays a series, at 0 (alerts on == 0 see it); the gauges of serving go
        assert [(s.labels, s.value) for s in m["rnnserve_model_ready"] if s.labels["model"] == "lstm"] == [(lab, 0)]
        for gauge in ("rnnserve_queue_depth", "rnnserve_model_engine"):
            assert not [s for s in m.get(gauge, []) if s.labels.get("model") == "lstm"], gauge

"""``rnnserve_model_ready`` through a version's life (load, unload, reload, retire, failed load), read from the
REST app's /metrics as Prometheus parses it.

A version that stops serving and stays listed in the repository index (unloaded, or failed) keeps its series at
0: an alert on ``rnnserve_model_ready == 0`` must fire for it, and a series that disappears reads as "no data",
which such an alert never sees. A version that leaves the index (the version policy moved past it, its folder was
deleted) takes its series with it: left at 0, the alert fired for good after every rollout.
"""
from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving_support import LSTM, make_model, rest_client, write_config

pytestmark = pytest.mark.asyncio
GAUGES = ("rnnserve_model_ready", "rnnserve_queue_depth", "rnnserve_model_engine", "rnnserve_active_streams")


def _body(x: np.ndarray, **parameters) -> dict:
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    if parameters:
        body["parameters"] = parameters
    return body


async def _gauges(client, model: str) -> dict[tuple[str, str], float]:
    """(gauge, version) -> value of ``model``'s per-version gauges in the exposition."""
    text = (await client.get("/metrics")).text
    return {(s.name, s.labels["version"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in GAUGES and s.labels.get("model") == model}


async def test_unload_reads_0_and_load_reads_1_again_however_often(repo):
    x = np.ones((1, 3, 4), np.float32)
    async with rest_client(repo) as (client, _):
        for _ in range(3):
            # a live stream at unload: its gauge goes with the version, and nothing trips over it later
            start = await client.post("/v2/models/lstm/infer", json=_body(x, sequence_id=7, sequence_start=True))
            assert start.status_code == 200
            assert (await _gauges(client, "lstm"))[("rnnserve_active_streams", "1")] == 1
            assert (await client.post("/v2/repository/models/lstm/unload")).status_code == 200
            assert await _gauges(client, "lstm") == {("rnnserve_model_ready", "1"): 0}
            r = await client.post("/v2/models/lstm/infer", json=_body(x))
            assert r.status_code == 503 and "not ready" in r.json()["error"]

            assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
            assert (await client.post("/v2/models/lstm/infer", json=_body(x))).status_code == 200
            assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200  # a reload
            assert (await client.post("/v2/models/lstm/infer", json=_body(x))).status_code == 200
            assert await _gauges(client, "lstm") == {
                ("rnnserve_model_ready", "1"): 1, ("rnnserve_queue_depth", "1"): 0,
                ("rnnserve_model_engine", "1"): 1, ("rnnserve_active_streams", "1"): 0}
        assert (await _gauges(client, "gru_bi"))[("rnnserve_model_ready", "1")] == 1  # the other model untouched


async def test_a_version_a_reload_retires_leaves_with_its_series(repo):
    async with rest_client(repo) as (client, _):
        make_model(*LSTM, seed=12).save(repo, "lstm", 2)
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200  # latest: 2 replaces 1
        assert await _gauges(client, "lstm") == {
            ("rnnserve_model_ready", "2"): 1, ("rnnserve_queue_depth", "2"): 0,
            ("rnnserve_model_engine", "2"): 1, ("rnnserve_active_streams", "2"): 0}
        write_config(repo, "lstm", version_policy=[1])  # and back
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        gauges = await _gauges(client, "lstm")
        assert gauges[("rnnserve_model_ready", "1")] == 1 and ("rnnserve_model_ready", "2") not in gauges
        rows = [r for r in (await client.post("/v2/repository/index")).json() if r["name"] == "lstm"]
        assert [r["version"] for r in rows] == ["1"]  # the metrics say what the index says


async def test_deleted_versions_and_models_leave_with_their_series(repo):
    """A failed version whose folder is deleted, and an unloaded model whose folder is deleted, left the index
    but kept rnnserve_model_ready 0 until a restart."""
    import shutil

    async with rest_client(repo) as (client, _):
        make_model(*LSTM, seed=12).save(repo, "lstm", 2)
        write_config(repo, "lstm", version_policy="all")
        (repo / "lstm" / "2" / "model.safetensors").write_bytes(b"\x01\x00")
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 400
        assert (await _gauges(client, "lstm"))[("rnnserve_model_ready", "2")] == 0
        shutil.rmtree(repo / "lstm" / "2")
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        assert ("rnnserve_model_ready", "2") not in await _gauges(client, "lstm")
        assert (await client.post("/v2/repository/models/gru_bi/unload")).status_code == 200
        assert await _gauges(client, "gru_bi") == {("rnnserve_model_ready", "1"): 0}  # listed: unloaded
        shutil.rmtree(repo / "gru_bi")
        assert "gru_bi" not in [r["name"] for r in (await client.post("/v2/repository/index")).json()]
        assert await _gauges(client, "gru_bi") == {}


async def test_the_copy_a_reload_replaced_leaves_the_version_s_gauges_to_the_new_copy(repo):
    x = np.ones((1, 3, 4), np.float32)
    async with rest_client(repo) as (client, dataplane):
        old = dataplane.registry.version("lstm", "1")
        old_streams = old.streams
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200  # a reload of version 1
        assert dataplane.registry.version("lstm", "1") is not old
        start = await client.post("/v2/models/lstm/infer", json=_body(x, sequence_id=9, sequence_start=True))
        assert start.status_code == 200
        assert (await _gauges(client, "lstm"))[("rnnserve_active_streams", "1")] == 1
        # the old copy's store, cleared once more (as a late sweep or drain would), must not write the series
        old_streams.clear("test")
        assert (await _gauges(client, "lstm"))[("rnnserve_active_streams", "1")] == 1


async def test_a_failed_load_reads_0_and_a_failed_reload_of_a_serving_version_keeps_1(repo):
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.safetensors").write_bytes(b"\x01\x00")
    async with rest_client(repo) as (client, _):
        # failed at startup: a series at 0, so that the alert sees a model that never came up
        assert await _gauges(client, "broken") == {("rnnserve_model_ready", "1"): 0}
        # a reload whose new copy fails leaves the serving copy serving, and ready
        make_model(*LSTM, seed=12).save(repo, "lstm", 2)
        write_config(repo, "lstm", version_policy=[1, 2])
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        (repo / "lstm" / "2" / "model.safetensors").write_bytes(b"\x01\x00")
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 400
        gauges = await _gauges(client, "lstm")
        assert gauges[("rnnserve_model_ready", "1")] == 1 and gauges[("rnnserve_model_ready", "2")] == 1
        # unloaded, then loaded from the broken file: not ready
        assert (await client.post("/v2/repository/models/lstm/unload")).status_code == 200
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 400
        gauges = await _gauges(client, "lstm")
        assert gauges[("rnnserve_model_ready", "1")] == 1 and gauges[("rnnserve_model_ready", "2")] == 0


async def test_a_model_that_fails_before_any_version_reads_0_until_a_version_is_ready(tmp_path):
    """A bad config.json (or no version folder) leaves no version to mark: the model's series with version ""
    reads 0, and its first ready version replaces it."""
    repo = tmp_path / "models"
    make_model(*LSTM, seed=3).save(repo, "lstm", 1)
    (repo / "lstm" / "config.json").write_text('{"max_batch_size": 0}')
    (repo / "empty").mkdir()
    async with rest_client(repo) as (client, _):
        assert await _gauges(client, "lstm") == {("rnnserve_model_ready", ""): 0.0}
        assert await _gauges(client, "empty") == {("rnnserve_model_ready", ""): 0.0}
        (repo / "lstm" / "config.json").write_text("{}")
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        gauges = await _gauges(client, "lstm")
        assert gauges[("rnnserve_model_ready", "1")] == 1.0 and ("rnnserve_model_ready", "") not in gauges


async def test_front_end_reports_after_an_unload_do_not_bring_the_queue_gauge_back(repo):
    """A front-end whose connection drops resets its waiting counts to 0 for every version it reported; for a
    version unloaded meanwhile that re-created ``rnnserve_frontend_queue_depth`` at 0 beside ready 0."""
    async with rest_client(repo) as (client, dataplane):
        dataplane.set_frontend_waiting("lstm", "1", 3)
        assert (await client.post("/v2/repository/models/lstm/unload")).status_code == 200
        for requests in (0, 2):
            dataplane.set_frontend_waiting("lstm", "1", requests)
            dataplane.set_frontend_waiting("lstm", "9", requests)  # never a version
            dataplane.set_frontend_waiting("nope", "1", requests)
        text = (await client.get("/metrics")).text
        assert [s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "rnnserve_frontend_queue_depth" and s.labels["model"] in ("lstm", "nope")] == []
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        dataplane.set_frontend_waiting("lstm", "1", 2)
        text = (await client.get("/metrics")).text
        assert [(s.labels["version"], s.value) for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "rnnserve_frontend_queue_depth" and s.labels["model"] == "lstm"] == [("1", 2)]

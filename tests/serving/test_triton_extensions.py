"""Triton's configuration and statistics extensions, and Triton's perf_analyzer against a real server.

In process over REST for every field and error; against a real `rnnserve serve` process with
tritonclient (HTTP and gRPC: the gRPC answers are parsed by tritonclient's own copy of Triton's
protos, so the wire format is Triton's); and with perf_analyzer, the C++ load generator in the
tritonclient wheel, where it can start (it needs libb64 and CUDA's runtime library, which
``.ci/run`` installs; it skips, saying why, elsewhere).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest

from serving_support import metric_value, rest_client, write_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import perf_analyzer_data  # noqa: E402


def _infer_body(x: np.ndarray, lengths: list[int] | None = None) -> dict:
    inputs = [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]
    if lengths is not None:
        inputs.append({"name": "lengths", "datatype": "INT32", "shape": [len(lengths)], "data": lengths})
    return {"inputs": inputs, "outputs": [{"name": "output_last"}]}


@pytest.mark.asyncio
async def test_model_config_describes_the_served_version_in_tritons_terms(repo):
    write_config(repo, "lstm", max_batch_size=16, max_queue_delay_us=500, precision="float16")
    async with rest_client(repo) as (client, _):
        meta = (await client.get("/v2/models/lstm")).json()
        config = (await client.get("/v2/models/lstm/config")).json()
        assert (await client.get("/v2/models/lstm/versions/1/config")).json() == config
        assert "model_configuration" in (await client.get("/v2")).json()["extensions"]
    assert config["name"] == "lstm" and config["platform"] == "rnnserve_reference" and config["backend"] == "rnnserve"
    # whole shapes, as in the metadata (see service/dataplane/model_config.py for why max_batch_size is 0)
    assert config["max_batch_size"] == 0
    assert [(t["name"], t["dims"]) for t in config["input"]] == [(t["name"], t["shape"]) for t in meta["inputs"]]
    assert [(t["name"], t["dims"]) for t in config["output"]] == [(t["name"], t["shape"]) for t in meta["outputs"]]
    assert [t["data_type"] for t in config["input"]] == ["TYPE_FP32", "TYPE_INT32", "TYPE_FP32", "TYPE_FP32"]
    assert [t["optional"] for t in config["input"]] == [False, True, True, True]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert config["instance_group"] == [{"name": "lstm", "kind": "KIND_CPU", "count": 1}]
    assert config["parameters"]["max_batch_size"] == {"string_value": "16"}
    assert config["parameters"]["precision"] == {"string_value": "float16"}
    assert "max_queue_delay_us" not in config["parameters"]


@pytest.mark.asyncio
@pytest.mark.parametrize("path, status, message", [
    ("/v2/models/nope/config", 404, "unknown model 'nope'"),
    ("/v2/models/lstm/versions/3/config", 404, "model 'lstm' has no version '3'"),
    ("/v2/models/nope/stats", 404, "unknown model 'nope'"),
    ("/v2/models/lstm/versions/x/stats", 404, "model 'lstm' has no version 'x'"),
])
async def test_config_and_statistics_of_unknown_models_and_versions(repo, path, status, message):
    async with rest_client(repo) as (client, _):
        r = await client.get(path)
        assert r.status_code == status and message in r.json()["error"]
        assert (await client.get("/v2/health/live")).status_code == 200


@pytest.mark.asyncio
async def test_statistics_count_what_was_served(repo):
    write_config(repo, "lstm", max_queue_delay_us=20_000)  # the three requests meet in one batch
    rng = np.random.default_rng(0)
    started_ms = time.time() * 1000
    async with rest_client(repo) as (client, dataplane):
        bodies = [_infer_body(rng.standard_normal((2, 7, 4)).astype(np.float32), [7, k + 3]) for k in range(3)]
        answers = await asyncio.gather(*(client.post("/v2/models/lstm/infer", json=b) for b in bodies))
        assert [a.status_code for a in answers] == [200, 200, 200]
        bad = await client.post("/v2/models/lstm/infer", json=_infer_body(np.zeros((1, 3, 4), np.float32), [9]))
        assert bad.status_code == 400
        everything = (await client.get("/v2/models/stats")).json()["model_stats"]
        one = (await client.get("/v2/models/lstm/stats")).json()["model_stats"]
        version = (await client.get("/v2/models/lstm/versions/1/stats")).json()["model_stats"]
        batches = metric_value(dataplane, "rnnserve_batch_size_count", model="lstm")
        queue_s = metric_value(dataplane, "rnnserve_queue_duration_seconds_sum", model="lstm")
        assert "statistics" in (await client.get("/v2")).json()["extensions"]
    assert [s["name"] for s in everything] == ["gru_bi", "lstm"]
    assert one == version == [everything[1]]
    (stats,) = one
    infer = stats["inference_stats"]
    assert stats["version"] == "1"
    assert infer["success"]["count"] == 3 and infer["success"]["ns"] > 0
    assert infer["fail"]["count"] == 1  # refused before it was queued: no time of its own
    assert stats["inference_count"] == 6  # sequences
    assert stats["execution_count"] == batches == 1
    assert infer["queue"]["count"] == 3 and infer["queue"]["ns"] == round(queue_s * 1e9)
    assert infer["compute_infer"]["count"] == 3 and 0 < infer["compute_infer"]["ns"] <= infer["success"]["ns"]
    assert infer["compute_input"] == infer["compute_output"] == {"count": 3, "ns": 0}
    assert infer["cache_hit"] == infer["cache_miss"] == {"count": 0, "ns": 0}
    assert started_ms <= stats["last_inference"] <= time.time() * 1000
    gru = everything[0]
    assert gru["execution_count"] == 0 and gru["last_inference"] == 0
    assert gru["inference_stats"]["success"] == {"count": 0, "ns": 0}


def _host(url: str) -> str:
    return urlparse(url).netloc


def test_tritonclient_reads_config_and_statistics_over_http_and_grpc(server_process):
    import tritonclient.grpc as tg
    import tritonclient.http as th

    http_url, grpc_url = server_process
    x = np.ones((3, 6, 4), np.float32)
    with th.InferenceServerClient(_host(http_url)) as client:
        inp = th.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        client.infer("gru_bi", [inp])
        config = client.get_model_config("gru_bi")
        stats = client.get_inference_statistics("gru_bi")
    grpc_client = tg.InferenceServerClient(_host(grpc_url))
    try:
        grpc_config = grpc_client.get_model_config("gru_bi", as_json=True)["config"]
        grpc_stats = grpc_client.get_inference_statistics("gru_bi", as_json=True)
        # a version without a model name was "unknown model ''"
        with pytest.raises(tg.InferenceServerException) as info:
            grpc_client.get_inference_statistics("", model_version="1")
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "statistics of version '1' need a model name" in info.value.message()
    finally:
        grpc_client.close()
    assert config["name"] == grpc_config["name"] == "gru_bi"
    # protobuf's JSON writes 64-bit integers as strings
    assert [[int(d) for d in t["dims"]] for t in grpc_config["input"]] == [t["dims"] for t in config["input"]]
    assert [t["data_type"] for t in grpc_config["output"]] == [t["data_type"] for t in config["output"]]
    assert grpc_config["parameters"] == config["parameters"]
    assert grpc_config["instance_group"][0]["kind"] == "KIND_CPU"
    (http_one,), (grpc_one,) = stats["model_stats"], grpc_stats["model_stats"]
    assert int(grpc_one["inference_stats"]["success"]["count"]) == http_one["inference_stats"]["success"]["count"] >= 1
    assert int(grpc_one["inference_count"]) == http_one["inference_count"] >= 3
    assert int(grpc_one["last_inference"]) == http_one["last_inference"] > 0


def _perf_analyzer() -> tuple[str, dict[str, str]] | None:
    """perf_analyzer's path and environment, or None (with the reason in pytest's skip) when it cannot start."""
    try:
        exe, env = perf_analyzer_data.perf_analyzer_env()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    probe = subprocess.run([exe, "--version"], capture_output=True, text=True, env=env, timeout=30)
    if "error while loading shared libraries" in probe.stderr:
        pytest.skip(f"perf_analyzer cannot start here: {probe.stderr.strip()} "
                    f"(.ci/run installs libb64-0d; the test extra brings nvidia-cuda-runtime-cu12)")
    return exe, env


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_a_model_end_to_end(server_process, tmp_path, protocol):
    exe, env = _perf_analyzer()
    http_url, grpc_url = server_process
    data = tmp_path / "lstm.json"
    assert perf_analyzer_data.main(["--url", _host(http_url), "--model", "lstm", "--count", "16", "--min-len", "2",
                                    "--max-len", "30", "--out", str(data)]) == 0
    first = json.loads(data.read_text())["data"][0]
    assert first["input"]["shape"][:2] == [1, first["lengths"]["content"][0]] and first["input"]["shape"][2] == 4
    url = _host(http_url if protocol == "http" else grpc_url)
    run = subprocess.run([exe, "-m", "lstm", "-u", url, "-i", protocol, "--input-data", str(data),
                          "--concurrency-range", "4", "-p", "500", "-s", "50", "-r", "5"],
                         capture_output=True, text=True, env=env, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    served = re.search(r"Successful request count: (\d+)", out)
    assert served and int(served.group(1)) > 0, out  # from the server's statistics
    assert re.search(r"Concurrency: 4, throughput: [\d.]+ infer/sec", out), out
    assert "compute infer" in out

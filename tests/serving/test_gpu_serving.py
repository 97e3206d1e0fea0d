"""End to end on the GPU: a real `rnnserve serve --device auto` process on the cuDNN engine,
driven by the real tritonclient (HTTP binary, HTTP JSON, gRPC), answers checked against the
reference engine. Skipped where there is no CUDA GPU.
"""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th

from service import create_engine
from service.repository import load_model
from service.repository import PackedModel
from service.spec import BlockSpec, RNNSpec
from serving_support import build_repository, make_model, start_server, stop_server

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=[(), ("--frontends", "2", "--engines", "2")],
                ids=["one-process", "two-engine-processes"])
def gpu_server(tmp_path_factory, request):
    repo = build_repository(tmp_path_factory.mktemp("gpu") / "models")
    for name in ("forecaster", "wave_classifier"):
        shutil.copytree(ROOT / "models" / name, repo / name)
    plain = make_model(BlockSpec("lstm", 4, 8), seed=3)
    PackedModel(RNNSpec((BlockSpec("lstm", 4, 8, variant={"peephole": True}),)), plain.weights,
                {"block0.peephole": np.full((1, 3, 8), 0.1, np.float32)}).save(repo, "lstm_peephole", 1)
    proc, http_url, grpc_url = start_server(repo, "--device", "auto", *request.param, timeout=180)
    try:
        yield repo, http_url.split("://")[1], grpc_url.split("://")[1]
    finally:
        assert stop_server(proc) == 0


def _expected(repo, name, x, lengths):
    return create_engine(load_model(repo / name), "cpu", dtype=np.float64).forward(x.astype(np.float64), lengths)


def test_models_run_on_cudnn_and_variants_fall_back(gpu_server):
    repo, http, _ = gpu_server
    with th.InferenceServerClient(http) as client:
        assert client.is_server_ready()
        for name in ("lstm", "gru_bi", "forecaster", "wave_classifier"):
            assert client.get_model_metadata(name)["platform"] == "rnnserve_cudnn", name
        assert client.get_model_metadata("lstm_peephole")["platform"] == "rnnserve_reference"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("name", ["lstm", "gru_bi", "forecaster", "wave_classifier", "lstm_peephole"])
def test_http_matches_reference(gpu_server, name, binary):
    repo, http, _ = gpu_server
    spec = load_model(repo / name).spec
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 13, spec.input_size)).astype(np.float32)
    lengths = np.array([13, 1, 7, 13, 2], np.int32)
    want = _expected(repo, name, x, lengths)
    inp = th.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    ln = th.InferInput("lengths", [5], "INT32")
    ln.set_data_from_numpy(lengths, binary_data=binary)
    outs = [th.InferRequestedOutput("output", binary_data=binary), th.InferRequestedOutput("output_last", binary_data=binary)]
    with th.InferenceServerClient(http) as client:
        res = client.infer(name, [inp, ln], outputs=outs)
    np.testing.assert_allclose(res.as_numpy("output"), want.output, **TOL)
    last = want.output[np.arange(5), lengths - 1].copy()
    if spec.blocks[-1].bidirectional:  # reverse direction ends at step 0
        half = spec.output_size // 2
        last[:, half:] = want.output[:, 0, half:]
    np.testing.assert_allclose(res.as_numpy("output_last"), last, **TOL)


def test_grpc_concurrent_ragged_requests_equal_single_answers(gpu_server):
    repo, _, grpc = gpu_server
    rng = np.random.default_rng(9)
    seqs = [rng.standard_normal((1, int(t), 4)).astype(np.float32) for t in rng.integers(1, 60, 64)]

    def one(x):
        inp = tg.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        with tg.InferenceServerClient(grpc) as client:
            res = client.infer("lstm", [inp], outputs=[tg.InferRequestedOutput("h_n"), tg.InferRequestedOutput("output")])
        return res.as_numpy("output"), res.as_numpy("h_n")

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, seqs))
    for x, (out, h_n) in zip(seqs, results):
        want = _expected(repo, "lstm", x, None)
        np.testing.assert_allclose(out, want.output, **TOL)
        np.testing.assert_allclose(h_n, want.h_n, **TOL)


def test_grpc_stream_chunks_equal_one_shot(gpu_server):
    repo, _, grpc = gpu_server
    x = np.random.default_rng(11).standard_normal((1, 23, 4)).astype(np.float32)
    want = _expected(repo, "lstm", x, None)
    got = []
    with tg.InferenceServerClient(grpc) as client:
        for k, (a, b) in enumerate([(0, 1), (1, 11), (11, 20), (20, 23)]):
            inp = tg.InferInput("input", [1, b - a, 4], "FP32")
            inp.set_data_from_numpy(np.ascontiguousarray(x[:, a:b]))
            res = client.infer("lstm", [inp], sequence_id=77, sequence_start=k == 0, sequence_end=b == 23,
                               outputs=[tg.InferRequestedOutput("output"), tg.InferRequestedOutput("h_n"),
                                        tg.InferRequestedOutput("c_n")])
            got.append(res.as_numpy("output"))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want.output, **TOL)
    np.testing.assert_allclose(res.as_numpy("h_n"), want.h_n, **TOL)
    np.testing.assert_allclose(res.as_numpy("c_n"), want.c_n, **TOL)


def test_concurrent_long_requests_equal_the_reference(gpu_server):
    """Inputs of 2 KB and more travel in the front-ends' shared memory (two-engine-processes server) and
    reach the GPU gathered from there (service.engines.cudnn.host_rows); concurrency makes batches of them."""
    repo, http, _ = gpu_server
    rng = np.random.default_rng(13)
    seqs = [rng.standard_normal((int(k), int(t), 4)).astype(np.float32)
            for k, t in zip(rng.integers(1, 4, 48), rng.integers(130, 260, 48))]

    def one(x):
        inp = th.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        with th.InferenceServerClient(http) as client:
            res = client.infer("lstm", [inp], outputs=[th.InferRequestedOutput("output_last", binary_data=True),
                                                       th.InferRequestedOutput("h_n", binary_data=True)])
        return res.as_numpy("output_last"), res.as_numpy("h_n")

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, seqs))
    for x, (last, h_n) in zip(seqs, results):
        want = _expected(repo, "lstm", x, None)
        np.testing.assert_allclose(last, want.output[:, -1], **TOL)
        np.testing.assert_allclose(h_n, want.h_n, **TOL)


def test_the_gpus_own_counters_are_exported_once(gpu_server):
    """rnnserve_gpu_* from NVML, one series per GPU whatever the engine processes (merged, not added up)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    _, http, _ = gpu_server
    samples = {s.name: s for f in text_string_to_metric_families(httpx.get(f"http://{http}/metrics", timeout=10).text)
               for s in f.samples if s.name.startswith("rnnserve_gpu_")}
    assert set(samples) == {"rnnserve_gpu_utilization_ratio", "rnnserve_gpu_memory_used_bytes",
                            "rnnserve_gpu_memory_total_bytes", "rnnserve_gpu_power_watts"}, samples
    assert all(s.labels == {"device": "cuda:0"} for s in samples.values())
    assert 0.0 <= samples["rnnserve_gpu_utilization_ratio"].value <= 1.0
    total = samples["rnnserve_gpu_memory_total_bytes"].value
    assert 8 << 30 <= total <= 512 << 30  # one GPU's memory, not two processes' readings added
    assert 0 < samples["rnnserve_gpu_memory_used_bytes"].value <= total
    assert 10 <= samples["rnnserve_gpu_power_watts"].value <= 2000

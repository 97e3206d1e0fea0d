"""Stateful streams against a real `rnnserve serve` process, with the real tritonclient (HTTP and gRPC).

Every check runs on the CPU server; those parametrized with ``device`` also run on a
server started with ``--device cuda`` (marked gpu, skipped where there is no GPU).
The reference answer is always the same server's one-shot answer for the whole sequence.
"""
from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass
from functools import partial

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
import tritonclient.http.aio as thttp_aio
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from serving_support import build_stream_repository, start_server, stop_server

FEATURES = 4
STATEFUL = ("lstm2", "gru2", "rnn2")


@dataclass
class Server:
    device: str
    http: str  # host:port
    grpc: str
    tol: float

    def client(self, protocol: str):
        return thttp.InferenceServerClient(self.http) if protocol == "http" else tgrpc.InferenceServerClient(self.grpc)


@pytest.fixture(scope="session")
def stream_servers(tmp_path_factory):
    repo = build_stream_repository(tmp_path_factory.mktemp("streams") / "models")
    procs: dict[str, tuple] = {}

    def get(device: str) -> Server:
        if device not in procs:
            procs[device] = start_server(repo, device=device, timeout=300)
        _, http_url, grpc_url = procs[device]
        return Server(device, http_url.removeprefix("http://"), grpc_url.removeprefix("grpc://"),
                      1e-5 if device == "cpu" else 1e-4)

    yield get
    for proc, _, _ in procs.values():
        assert stop_server(proc) == 0


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def server(request, stream_servers) -> Server:
    return stream_servers(request.param)


def _module(client):
    return thttp if isinstance(client, (thttp.InferenceServerClient, thttp_aio.InferenceServerClient)) else tgrpc


def _request(client, x, h0=None, c0=None, outputs=None):
    mod = _module(client)
    inputs = []
    for name, arr in (("input", x), ("h_0", h0), ("c_0", c0)):
        if arr is not None:
            t = mod.InferInput(name, list(arr.shape), "FP32")
            t.set_data_from_numpy(np.ascontiguousarray(arr, np.float32))
            inputs.append(t)
    return inputs, [mod.InferRequestedOutput(o) for o in outputs] if outputs else None


def _names(result, outputs):
    return {o: result.as_numpy(o) for o in outputs if result.as_numpy(o) is not None}


def infer(client, model, x, seq=0, start=False, end=False, h0=None, c0=None, outputs=("output", "h_n", "c_n")):
    """One request; returns the outputs the model has among ``outputs``."""
    inputs, _ = _request(client, x, h0, c0)
    result = client.infer(model, inputs, sequence_id=seq, sequence_start=start, sequence_end=end)
    return _names(result, outputs)


async def ainfer(client, model, x, seq, start, end, outputs=("output", "h_n", "c_n")):
    inputs, _ = _request(client, x)
    result = await client.infer(model, inputs, sequence_id=seq, sequence_start=start, sequence_end=end)
    return _names(result, outputs)


def stream(client, model, x, sizes, seq):
    """Send ``x`` [1, T, I] as chunks of ``sizes`` on stream ``seq``; return the outputs of every chunk."""
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] == x.shape[1]
    return [infer(client, model, x[:, a:b], seq, start=i == 0, end=i == len(sizes) - 1)
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


def check_same(chunks, whole, tol):
    np.testing.assert_allclose(np.concatenate([c["output"] for c in chunks], axis=1), whole["output"], atol=tol)
    for name in ("h_n", "c_n"):
        assert (name in chunks[-1]) == (name in whole)
        if name in whole:
            np.testing.assert_allclose(chunks[-1][name], whole[name], atol=tol)


def expect_error(call, http_status: str, grpc_status: str, text: str):
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() in (http_status, grpc_status), info.value
    assert text in info.value.message(), info.value.message()


def metric(server: Server, name: str, **labels) -> float:
    text = httpx.get(f"http://{server.http}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _x(seed, steps, batch=1):
    return np.random.default_rng(seed).standard_normal((batch, steps, FEATURES)).astype(np.float32)


# ---- chunked == one-shot ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [*STATEFUL, "mixed"])
def test_chunks_of_varying_sizes_equal_one_shot(server, model):
    x = _x(1, 23)
    sizes = [1, 5, 1, 9, 2, 1, 4]
    for k, protocol in enumerate(("http", "grpc")):
        client = server.client(protocol)
        whole = infer(client, model, x)
        check_same(stream(client, model, x, sizes, seq=1000 + k), whole, server.tol)
        if model == "mixed":
            assert "h_n" not in whole  # no single state tensor, yet streams work
        client.close()


def test_string_and_uint64_sequence_ids(server):
    x = _x(2, 8)
    with server.client("http") as client:
        whole = infer(client, "lstm2", x)
        check_same(stream(client, "lstm2", x, [3, 5], seq=2**64 - 1), whole, server.tol)
        check_same(stream(client, "lstm2", x, [4, 4], seq="caller-7"), whole, server.tol)
    client = server.client("grpc")
    check_same(stream(client, "lstm2", x, [2, 6], seq="caller-8"), whole, server.tol)
    client.close()


def test_first_chunk_may_carry_its_state_and_stateless_chaining_equals_streaming(server):
    x = _x(3, 12)
    rng = np.random.default_rng(4)
    h0, c0 = rng.standard_normal((1, 2, 8)).astype(np.float32), rng.standard_normal((1, 2, 8)).astype(np.float32)
    for protocol in ("http", "grpc"):
        client = server.client(protocol)
        whole = infer(client, "lstm2", x, h0=h0, c0=c0)
        first = infer(client, "lstm2", x[:, :5], seq=77, start=True, h0=h0, c0=c0)
        rest = infer(client, "lstm2", x[:, 5:], seq=77, end=True)
        check_same([first, rest], whole, server.tol)
        # stateless: the client carries h/c between chunks; no server state, any replica can answer
        chunks, h, c = [], h0, c0
        for a, b in ((0, 1), (1, 7), (7, 12)):
            out = infer(client, "lstm2", x[:, a:b], h0=h, c0=c)
            chunks.append(out)
            h, c = out["h_n"], out["c_n"]
        check_same(chunks, whole, server.tol)
        client.close()


def test_32_interleaved_streams_batch_together_and_equal_one_shot(server):
    n, steps = 32, 20
    xs = _x(5, steps, batch=n)
    rng = np.random.default_rng(6)
    plans = []
    for _ in range(n):
        cuts = np.sort(rng.choice(np.arange(1, steps), size=int(rng.integers(2, 6)), replace=False))
        plans.append(np.diff([0, *cuts, steps]))
    with server.client("http") as client:
        whole = infer(client, "lstm2", xs)  # one-shot: all 32 sequences in one request
    batches_before = metric(server, "rnnserve_batch_size_count", model="lstm2")

    async def run():
        hc, gc = thttp_aio.InferenceServerClient(server.http), tgrpc_aio.InferenceServerClient(server.grpc)

        async def one(i):
            client = hc if i % 2 else gc
            bounds = np.cumsum([0, *plans[i]])
            outs = []
            for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                outs.append(await ainfer(client, "lstm2", xs[i:i + 1, a:b], 5000 + i, j == 0, j == len(plans[i]) - 1))
            return outs

        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await hc.close()
            await gc.close()

    results = asyncio.run(run())
    for i, chunks in enumerate(results):
        check_same(chunks, {k: v[i:i + 1] for k, v in whole.items()}, server.tol)
    chunk_count = sum(len(p) for p in plans)
    batches = metric(server, "rnnserve_batch_size_count", model="lstm2") - batches_before
    assert batches < chunk_count, "chunks of different streams never shared a batch"
    assert metric(server, "rnnserve_active_streams", model="lstm2") == 0


# ---- errors --------------------------------------------------------------------------------------------------


def test_stream_errors(server):
    x = _x(7, 3)
    for k, protocol in enumerate(("http", "grpc")):
        client = server.client(protocol)
        sid = 9000 + 10 * k
        expect_error(lambda: infer(client, "lstm2", x, sid), "404", "StatusCode.NOT_FOUND",
                     f"stream {sid} of model 'lstm2' is not live (never started")
        first = infer(client, "lstm2", x, sid, start=True)
        infer(client, "lstm2", x, sid)  # the stream moves on
        # a second sequence_start while live restarts the stream, as in Triton: from zeros again, not refused
        restarts = metric(server, "rnnserve_stream_ends_total", model="lstm2", reason="restart")
        again = infer(client, "lstm2", x, sid, start=True)
        check_same([again], first, server.tol)
        assert metric(server, "rnnserve_stream_ends_total", model="lstm2", reason="restart") == restarts + 1
        expect_error(lambda: infer(client, "lstm2", x, sid, h0=np.zeros((1, 2, 8), np.float32)), "400",
                     "StatusCode.INVALID_ARGUMENT", "input 'h_0' can only start a stream")
        infer(client, "lstm2", x, sid, end=True)
        expect_error(lambda: infer(client, "lstm2", x, sid), "404", "StatusCode.NOT_FOUND",
                     f"stream {sid} of model 'lstm2' is not live: it ended with sequence_end")
        expect_error(lambda: infer(client, "gru_bi", x, sid + 1, start=True), "400", "StatusCode.INVALID_ARGUMENT",
                     "model 'gru_bi' reads sequences backwards (bidirectional or reverse)")
        expect_error(lambda: infer(client, "lstm2", np.concatenate([x, x]), sid + 2, start=True), "400",
                     "StatusCode.INVALID_ARGUMENT", "a stream request carries one sequence (batch 1), got batch 2")
        client.close()


def test_max_streams_and_idle_expiry(server):
    x = _x(8, 2)
    starts = metric(server, "rnnserve_stream_starts_total", model="lstm_short")
    with server.client("http") as client:
        for sid in (1, 2):
            infer(client, "lstm_short", x, sid, start=True)
        expect_error(lambda: infer(client, "lstm_short", x, 3, start=True), "503", "StatusCode.UNAVAILABLE",
                     "model 'lstm_short' has 2 live streams (max_streams 2, which holds in each engine process)")
        grpc_client = server.client("grpc")
        expect_error(lambda: infer(grpc_client, "lstm_short", x, 4, start=True), "503", "StatusCode.UNAVAILABLE",
                     "max_streams 2")
        grpc_client.close()
        assert metric(server, "rnnserve_active_streams", model="lstm_short") == 2
        import time

        time.sleep(1.2)  # idle timeout 0.5 s; the sweeper drops them without any new chunk
        assert metric(server, "rnnserve_active_streams", model="lstm_short") == 0
        assert metric(server, "rnnserve_stream_expirations_total", model="lstm_short") >= 2
        expect_error(lambda: infer(client, "lstm_short", x, 1), "404", "StatusCode.NOT_FOUND",
                     "stream 1 of model 'lstm_short' is not live: it expired after 0.5s without a chunk")
        infer(client, "lstm_short", x, 3, start=True, end=True)
    assert metric(server, "rnnserve_stream_starts_total", model="lstm_short") - starts == 3
    assert metric(server, "rnnserve_stream_ends_total", model="lstm_short", reason="end") >= 1
    assert metric(server, "rnnserve_stream_chunk_timesteps_count", model="lstm_short") >= 3


def test_unload_ends_streams_with_a_clear_error(server):
    x = _x(9, 2)
    with server.client("http") as client:
        infer(client, "lstm_unload", x, 5, start=True)
        client.unload_model("lstm_unload")
        expect_error(lambda: infer(client, "lstm_unload", x, 5), "503", "StatusCode.UNAVAILABLE",
                     "model 'lstm_unload' version 1 is not ready (state UNAVAILABLE: unloaded)")
        client.load_model("lstm_unload")
        expect_error(lambda: infer(client, "lstm_unload", x, 5), "404", "StatusCode.NOT_FOUND",
                     "stream 5 of model 'lstm_unload' is not live: it was ended when model 'lstm_unload' version 1 "
                     "was unloaded")
    assert metric(server, "rnnserve_stream_ends_total", model="lstm_unload", reason="unload") >= 1


# ---- ModelStreamInfer ------------------------------------------------------------------------------------------


def test_model_stream_infer_keeps_order_and_equals_one_shot(server):
    xa, xb = _x(10, 9), _x(11, 7)
    client = server.client("grpc")
    whole_a, whole_b = infer(client, "gru2", xa), infer(client, "gru2", xb)
    plan = [("a", 0, 4), ("b", 0, 1), ("a", 4, 5), ("b", 1, 7), ("a", 5, 9)]
    ids = {"a": 31, "b": "stream-b"}
    xs = {"a": xa, "b": xb}
    firsts = {"a": 0, "b": 0}
    lasts = {"a": 9, "b": 7}
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    for i, (name, a, b) in enumerate(plan):
        inputs, outputs = _request(client, xs[name][:, a:b], outputs=["output", "h_n"])
        client.async_stream_infer("gru2", inputs, outputs=outputs, request_id=str(i), sequence_id=ids[name],
                                  sequence_start=a == firsts[name], sequence_end=b == lasts[name])
    # an error answers in its place in the stream and the stream goes on
    inputs, _ = _request(client, xa[:, :1])
    client.async_stream_infer("gru2", inputs, request_id="late", sequence_id=31)
    got = [answers.get(timeout=30) for _ in range(len(plan) + 1)]
    client.stop_stream()
    client.close()
    for (result, error), i in zip(got, range(len(plan))):
        assert error is None, error
        assert result.get_response().id == str(i)
    assert got[-1][0] is None and "stream 31 of model 'gru2' is not live" in got[-1][1].message()
    for name, whole in (("a", whole_a), ("b", whole_b)):
        chunks = [{k: r.as_numpy(k) for k in ("output", "h_n")}
                  for (r, _), (n, _, _) in zip(got, plan) if n == name]
        check_same(chunks, whole, server.tol)

"""REST transport over the real dataplane, in process (httpx.ASGITransport): every route and error."""
from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest

from service import create_engine
from service.repository import load_model

from serving_support import LSTM, make_model, metric_value, rest_client, write_config

pytestmark = pytest.mark.asyncio


def _infer_body(x, lengths=None, outputs=None, **params):
    inputs = [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]
    if lengths is not None:
        inputs.append({"name": "lengths", "datatype": "INT32", "shape": [len(lengths)], "data": list(map(int, lengths))})
    body = {"inputs": inputs}
    if outputs is not None:
        body["outputs"] = [{"name": o} for o in outputs]
    if params:
        body["parameters"] = params
    return body


def _outputs(resp) -> dict[str, np.ndarray]:
    doc = resp.json()
    return {o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"]) for o in doc["outputs"]}


def _engine(repo, name):
    return create_engine(load_model(repo / name), "cpu")


async def test_health_and_server_metadata(repo):
    async with rest_client(repo) as (client, _):
        assert (await client.get("/v2/health/live")).json() == {"live": True}
        r = await client.get("/v2/health/ready")
        assert r.status_code == 200 and r.json() == {"ready": True}
        meta = (await client.get("/v2")).json()
        assert meta["name"] == "rnnserve" and "binary_tensor_data" in meta["extensions"]
        assert "model_repository" in meta["extensions"]


async def test_model_metadata_and_readiness(repo):
    async with rest_client(repo) as (client, _):
        meta = (await client.get("/v2/models/lstm")).json()
        assert meta["name"] == "lstm" and meta["versions"] == ["1"] and meta["platform"] == "rnnserve_reference"
        assert meta["inputs"] == [
            {"name": "input", "datatype": "FP32", "shape": [-1, -1, 4]},
            {"name": "lengths", "datatype": "INT32", "shape": [-1]},
            {"name": "h_0", "datatype": "FP32", "shape": [-1, 2, 8]},
            {"name": "c_0", "datatype": "FP32", "shape": [-1, 2, 8]},
        ]
        assert [o["name"] for o in meta["outputs"]] == ["output", "output_last", "h_n", "c_n"]
        assert meta["outputs"][0]["shape"] == [-1, -1, 8]
        gru = (await client.get("/v2/models/gru_bi/versions/1")).json()
        assert [i["name"] for i in gru["inputs"]] == ["input", "lengths", "h_0"]
        assert gru["outputs"][1] == {"name": "output_last", "datatype": "FP32", "shape": [-1, 12]}
        for path in ("/v2/models/lstm/ready", "/v2/models/lstm/versions/1/ready"):
            r = await client.get(path)
            assert r.status_code == 200 and r.json()["ready"] is True


@pytest.mark.parametrize("path, message", [
    ("/v2/models/nope", "unknown model 'nope'; the repository has gru_bi, lstm"),
    ("/v2/models/nope/ready", "unknown model 'nope'"),
    ("/v2/models/lstm/versions/7", "model 'lstm' has no version '7' (served versions: 1)"),
    ("/v2/models/lstm/versions/x/ready", "model 'lstm' has no version 'x'"),
    # int() refuses past 4,300 digits (a 500 before), and str.isdigit takes other scripts' digits ('١' was version 1)
    ("/v2/models/lstm/versions/" + "1" * 4301, "model 'lstm' has no version '1111"),
    ("/v2/models/lstm/versions/%D9%A1/ready", "model 'lstm' has no version '\u0661'"),
    # a message repeats the client's text only in part: gRPC carries messages in a header of bounded size
    ("/v2/models/" + "m" * 17000, "bytes of the message cut ...] mmm"),
])
async def test_metadata_not_found(repo, path, message):
    async with rest_client(repo) as (client, _):
        r = await client.get(path)
        assert r.status_code == 404 and message in r.json()["error"]


async def test_unknown_route_is_json_404(repo):
    async with rest_client(repo) as (client, _):
        r = await client.get("/v2/nothing/here")
        assert r.status_code == 404
        assert r.json()["error"] == "no route GET /v2/nothing/here; the routes rnnserve serves are listed at /docs"


@pytest.mark.parametrize("method, path, words", [
    ("GET", "/v2/systemsharedmemory/status", "system shared memory extension (GET /v2/systemsharedmemory/status)"),
    ("POST", "/v2/systemsharedmemory/region/r/register", "system shared memory extension"),
    ("POST", "/v2/cudasharedmemory/region/r/unregister", "CUDA shared memory extension"),
    ("GET", "/v2/trace/setting", "trace extension"),
    ("POST", "/v2/models/lstm/trace/setting", "trace extension"),
    ("GET", "/v2/logging", "logging extension (GET /v2/logging); set the log level"),
    ("POST", "/v2/models/lstm/generate", "generate extension (POST /v2/models/lstm/generate); recurrent models"),
    ("POST", "/v2/models/lstm/versions/1/generate_stream", "generate extension"),
])
async def test_tritons_unserved_extensions_are_501_saying_what_instead(repo, method, path, words):
    async with rest_client(repo) as (client, _):
        r = await client.request(method, path)
        assert r.status_code == 501 and "rnnserve does not implement Triton's " + words in r.json()["error"]
        assert (await client.post("/v2/models/lstm")).headers["allow"] == "GET"  # other routes keep their answers


async def test_json_infer_matches_engine(repo):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 6, 4)).astype(np.float32)
    lengths = np.array([6, 2, 4])
    expected = _engine(repo, "lstm").forward(x, lengths)
    async with rest_client(repo) as (client, _):
        r = await client.post("/v2/models/lstm/infer", json={"id": "r1", **_infer_body(x, lengths)})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["model_name"] == "lstm" and doc["model_version"] == "1" and doc["id"] == "r1"
        got = _outputs(r)
        assert list(got) == ["output", "output_last", "h_n", "c_n"]
        assert all(o["datatype"] == "FP32" for o in doc["outputs"])
        np.testing.assert_allclose(got["output"], expected.output, atol=1e-5)
        np.testing.assert_allclose(got["h_n"], expected.h_n, atol=1e-5)
        np.testing.assert_allclose(got["c_n"], expected.c_n, atol=1e-5)
        np.testing.assert_allclose(got["output_last"], expected.output[np.arange(3), lengths - 1], atol=1e-5)
        assert np.all(got["output"][1, 2:] == 0)

        # nested data, a version in the path, FP64 input, only the requested output
        nested = {"inputs": [{"name": "input", "datatype": "FP64", "shape": [3, 6, 4], "data": x.tolist()},
                             {"name": "lengths", "datatype": "INT64", "shape": [3], "data": lengths.tolist()}],
                  "outputs": [{"name": "h_n"}]}
        r = await client.post("/v2/models/lstm/versions/1/infer", json=nested)
        got = _outputs(r)
        assert list(got) == ["h_n"]
        np.testing.assert_allclose(got["h_n"], expected.h_n, atol=1e-5)


async def test_state_inputs_and_bidirectional_output_last(repo):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 4)).astype(np.float32)
    lengths = np.array([3, 5])
    h0 = rng.standard_normal((2, 2, 6)).astype(np.float32)
    expected = _engine(repo, "gru_bi").forward(x, lengths, h0)
    body = _infer_body(x, lengths)
    body["inputs"].append({"name": "h_0", "datatype": "FP32", "shape": [2, 2, 6], "data": h0.ravel().tolist()})
    async with rest_client(repo) as (client, _):
        got = _outputs(await client.post("/v2/models/gru_bi/infer", json=body))
    np.testing.assert_allclose(got["output"], expected.output, atol=1e-5)
    np.testing.assert_allclose(got["h_n"], expected.h_n, atol=1e-5)
    for b, n in enumerate(lengths):  # forward half at the last valid step, reverse half at step 0
        np.testing.assert_allclose(got["output_last"][b, :6], expected.output[b, n - 1, :6], atol=1e-5)
        np.testing.assert_allclose(got["output_last"][b, 6:], expected.output[b, 0, 6:], atol=1e-5)


X = np.zeros((1, 2, 4)).ravel().tolist()


def _inp(name="input", datatype="FP32", shape=(1, 2, 4), data=None):
    return {"name": name, "datatype": datatype, "shape": list(shape), "data": X if data is None else data}


BAD = [
    ("nope", {"inputs": [_inp()]}, 404, "unknown model 'nope'"),
    ("lstm", {"inputs": [_inp(shape=(1, 2, 3), data=[0] * 6)]}, 400, "input 'input' has 3 features, model 'lstm' expects 4"),
    ("lstm", {"inputs": [_inp(name="x")]}, 400, "unknown input 'x' for model 'lstm'; its inputs are input, lengths, h_0, c_0"),
    ("lstm", {"inputs": [_inp("lengths", "INT32", (1,), [2])]}, 400, "input 'input' is missing"),
    ("lstm", {"inputs": [_inp(datatype="INT32")]}, 400, "input 'input' has datatype INT32; send FP32, FP16, FP64"),
    ("lstm", {"inputs": [_inp(datatype="BF17")]}, 400, "datatype 'BF17' is not supported"),
    ("lstm", {"inputs": [_inp(data=[True] * 8)]}, 400, "its data must be JSON numbers within its range (no booleans, strings or nulls)"),
    ("lstm", {"inputs": [_inp(data=["0.5"] * 8)]}, 400, "its data must be JSON numbers within its range (no booleans, strings or nulls)"),
    ("lstm", {"inputs": [_inp(data=[None] * 8)]}, 400, "its data must be JSON numbers within its range (no booleans, strings or nulls)"),
    # NumPy reads a boolean among numbers as 1: a length of 1, an input of 1.0, answered before
    ("lstm", {"inputs": [_inp(data=[True] + [0.5] * 7)]}, 400, "got true or false among them"),
    ("lstm", {"inputs": [_inp(data=[[[0.5] * 4, [0.5, 0.5, False, 0.5]]])]}, 400, "got true or false among them"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT32", (1,), [True])]}, 400, "must be whole numbers"),
    ("gru_bi", {"inputs": [_inp(shape=(2, 1, 4), data=[0.5] * 8), _inp("lengths", "INT64", (2,), [True, 1])]}, 400,
     "got true or false among them"),
    ("lstm", {"inputs": [_inp(shape=(1, 8), data=[0] * 8)]}, 400, "must have 3 dimensions"),
    ("lstm", {"inputs": [_inp(shape=(0, 2, 4), data=[])]}, 400, "empty batch"),
    ("lstm", {"inputs": [_inp(shape=(1, 0, 4), data=[])]}, 400, "0 time steps"),
    ("lstm", {"inputs": [_inp(shape=(1, 2, 4), data=[0] * 7)]}, 400, "input 'input' has 7 values but shape [1, 2, 4] needs 8"),
    ("lstm", {"inputs": [_inp(data=[[0, 1], [2]])]}, 400, "cannot be read as FP32"),
    ("lstm", {"inputs": [_inp(data=[float("nan")] + [0] * 7)]}, 400, "contains NaN or infinite values (first at index [0, 0, 0])"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT32", (1,), [3])]}, 400, "lengths[0] = 3 is out of range: every length must be between 1 and T = 2"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT32", (1,), [0])]}, 400, "lengths[0] = 0 is out of range"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "FP32", (1,), [1])]}, 400, "input 'lengths' has datatype FP32; send INT32 or INT64"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT32", (2,), [1, 1])]}, 400, "input 'lengths' must have shape [1]"),
    ("lstm", {"inputs": [_inp(), _inp("h_0", "FP32", (1, 1, 8), [0] * 8)]}, 400, "input 'h_0' must have shape [1, 2, 8]"),
    ("gru_bi", {"inputs": [_inp(), _inp("c_0", "FP32", (1, 2, 6), [0] * 12)]}, 400, "unknown input 'c_0' for model 'gru_bi' (this model has no cell state)"),
    ("lstm", {"inputs": [_inp(), _inp()]}, 400, "input 'input' is given twice"),
    ("lstm", {"inputs": [_inp()], "outputs": [{"name": "h_n"}, {"name": "h_n"}]}, 400,
     "output 'h_n' is requested twice; ask for each output once"),
    ("lstm", {"inputs": [_inp()], "outputs": [{"name": "logits"}]}, 400, "unknown output 'logits' for model 'lstm'; its outputs are output, output_last, h_n, c_n"),
    ("lstm", {"inputs": []}, 400, "request needs a non-empty 'inputs' list"),
    ("lstm", {"inputs": [_inp()], "parameters": {"sequence_id": 42}}, 404, "stream 42 of model 'lstm' is not live"),
    ("lstm", {"inputs": [_inp(shape=(2, 1, 4))], "parameters": {"sequence_id": 1, "sequence_start": True}}, 400,
     "a stream request carries one sequence (batch 1), got batch 2"),
    ("lstm", {"inputs": [_inp(), _inp("h_0", "FP32", (1, 2, 8), [0] * 16)],
              "parameters": {"sequence_id": "a"}}, 400, "input 'h_0' can only start a stream (with sequence_start)"),
    ("lstm", {"inputs": [_inp()], "parameters": {"sequence_id": True}}, 400, "'sequence_id' must be a uint64 or a string"),
    ("lstm", {"inputs": [_inp()], "parameters": {"sequence_start": True}}, 400, "sequence_start/sequence_end need a non-zero"),
    ("lstm", {"inputs": [_inp()], "parameters": {"sequence_id": 3, "sequence_end": "yes"}}, 400, "'sequence_end' must be true or false"),
    ("lstm", {"inputs": [_inp()], "parameters": {"timeout": "soon"}}, 400, "parameter 'timeout' must be a number of microseconds"),
    ("lstm", {"inputs": [_inp()], "parameters": {"timeout": 10 ** 400}}, 400, "parameter 'timeout' must be a number"),  # was a 500
    ("lstm", {"inputs": [_inp()], "parameters": []}, 400, "request 'parameters' must be a JSON object"),
    ("lstm", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, -2, 4], "data": X}]}, 400, "'shape' list of non-negative integers"),
    # JSON integers past a type's range, and fractions for an integer type: NumPy raised OverflowError
    # (a 500) or cut 1.7 to 1 (a length silently wrong)
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT32", (1,), [1.7])]}, 400,
     "input 'lengths' is INT32: its data must be whole numbers from -2147483648 to 2147483647"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT64", (1,), [True])]}, 400, "must be whole numbers"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT32", (1,), [2 ** 40])]}, 400, "must be whole numbers"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT64", (1,), [2 ** 70])]}, 400, "must be whole numbers"),
    ("lstm", {"inputs": [_inp(datatype="INT32", data=[-2 ** 70] * 8)]}, 400, "must be whole numbers"),
    ("lstm", {"inputs": [_inp(), _inp("lengths", "INT32", (1,), [3.0])]}, 400, "lengths[0] = 3 is out of range"),
    ("lstm", {"inputs": [_inp(data=[2 ** 1100] + [0] * 7)]}, 400, "is FP32: an integer in its data is too large for any float"),
    # finite JSON numbers past FP32's or FP16's range were "NaN or infinite" (the cast had made them inf)
    ("lstm", {"inputs": [_inp(data=[0, 1e300] + [0] * 6)]}, 400, "input 'input' has 1e+300 at index [0, 0, 1], outside FP32's range"),
    ("lstm", {"inputs": [_inp(data=[1e39] + [0] * 7)]}, 400, "input 'input' has 1e+39 at index [0, 0, 0], outside FP32's range"),
    ("lstm", {"inputs": [_inp(datatype="FP16", data=[70000.0] + [0] * 7)]}, 400, "has 70000.0 at index [0, 0, 0], outside FP16's range"),
    # a BOOL input was told its data must be numbers; BYTES was offered every numeric type the protocol has
    ("lstm", {"inputs": [_inp(datatype="BOOL", data=[True] * 8)]}, 400, "input 'input' has datatype BOOL; send FP32, FP16, FP64"),
    ("lstm", {"inputs": [_inp(datatype="BOOL", data=[1] * 8)]}, 400, "input 'input' is BOOL: its data must be JSON true or false"),
    ("lstm", {"inputs": [_inp(datatype="BOOL", data=[1] + [True] * 7)]}, 400, "input 'input' is BOOL: its data must be JSON true or false"),
    ("lstm", {"inputs": [_inp(datatype="BYTES")]}, 400,
     "datatype 'BYTES' is not supported; rnnserve's models take FP32, FP16 or FP64 for input, h_0 and c_0, and INT32 or INT64 for lengths"),
    # a lone UTF-16 surrogate (legal JSON, not Unicode) made the error answer itself fail: a bare 500
    ("lstm", {"inputs": [_inp(shape=(), data=[1.0])]}, 400, "input 'input' must have 3 dimensions [batch, time, features], got shape []"),
    ("lstm", {"inputs": [_inp(name="\ud800")]}, 400, "a lone UTF-16 surrogate (\\ud800)"),
    ("lstm", {"inputs": [_inp(datatype="\ud800")]}, 400, "a lone UTF-16 surrogate (\\ud800)"),
    ("lstm", {"inputs": [_inp()], "outputs": [{"name": "\udfff"}]}, 400, "a lone UTF-16 surrogate (\\udfff)"),
    ("lstm", {"id": "\udc00", "inputs": [_inp()]}, 400, "a lone UTF-16 surrogate (\\udc00)"),
    ("lstm", {"inputs": [_inp()], "parameters": {"sequence_id": "\ud800", "sequence_end": True}}, 400, "lone UTF-16"),
    ("lstm", {"inputs": [_inp(shape=(2 ** 40, 0, 2 ** 40), data=[])]}, 400, "whose dimensions multiply to more than 2**48"),
    # NumPy makes no array of over 64 dimensions: a 500 before the check
    ("lstm", {"inputs": [_inp(shape=(1,) * 65, data=[0])]}, 400, "input 'input' has 65 dimensions; rnnserve's tensors have 1 to 3"),
    # finite in FP64, inf in the FP32 the models compute in: answered with NaN before the check
    ("lstm", {"inputs": [_inp(datatype="FP64", data=[0] * 5 + [1e300, 0, 0])]}, 400,
     "input 'input' has 1e+300 at index [0, 1, 1], outside FP32's range"),
    ("lstm", {"inputs": [_inp(), _inp("h_0", "FP64", (1, 2, 8), [-1e39] * 16)]}, 400, "input 'h_0' has -1e+39 at index [0, 0, 0]"),
    ("lstm", {"inputs": [_inp()], "parameters": {"binary_data_output": "false"}}, 400,
     "request parameter 'binary_data_output' must be true or false, got 'false'"),
    ("lstm", {"inputs": [_inp()], "outputs": [{"name": "output", "parameters": {"binary_data": 1}}]}, 400,
     "output 'output' parameter 'binary_data' must be true or false, got 1"),
    ("lstm", {"inputs": [_inp()], "outputs": [{"name": "output_last", "parameters": {"classification": 3}}]}, 400,
     "output 'output_last' asks for classification (class_count), which rnnserve does not do"),
    ("lstm", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2, 4],
                          "parameters": {"shared_memory_region": "in0", "shared_memory_byte_size": 32}}]}, 400,
     "input 'input' uses the shared-memory extension (shared_memory_region), which rnnserve does not support"),
    ("lstm", {"inputs": [_inp()], "outputs": [{"name": "output", "parameters": {"shared_memory_region": "out0"}}]}, 400,
     "output 'output' uses the shared-memory extension"),
]


@pytest.mark.parametrize("model, body, status, message", BAD, ids=[b[3][:40] for b in BAD])
async def test_bad_requests(repo, model, body, status, message):
    async with rest_client(repo) as (client, _):
        r = await client.post(f"/v2/models/{model}/infer", content=json.dumps(body).encode())  # allows NaN
        assert r.status_code == status, r.text
        assert message in r.json()["error"]
        assert (await client.get("/v2/health/live")).status_code == 200
        ok = await client.post("/v2/models/lstm/infer", json={"inputs": [_inp()]})
        assert ok.status_code == 200


async def test_integer_literals_past_int64_are_numbers_for_a_float_input(repo):
    # 1e20 written out in digits: NumPy made an object array of it, refused as "not JSON numbers"
    body = {"inputs": [_inp(data=[10 ** 20] + [0] * 7)], "outputs": [{"name": "output_last"}]}
    async with rest_client(repo) as (client, _):
        r = await client.post("/v2/models/lstm/infer", content=json.dumps(body).encode())
        assert r.status_code == 200, r.text
        same = await client.post("/v2/models/lstm/infer", json={"inputs": [_inp(data=[1e20] + [0] * 7)],
                                                                "outputs": [{"name": "output_last"}]})
        assert r.json()["outputs"] == same.json()["outputs"]


async def test_integer_literal_past_pythons_digit_limit(repo):
    huge = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1, 1], "data": [1' + b"0" * 4400 + b']}]}'
    async with rest_client(repo) as (client, _):
        r = await client.post("/v2/models/lstm/infer", content=huge)
        assert r.status_code == 400 and "more than 4,300 digits" in r.json()["error"], r.text
        assert "set_int_max_str_digits" not in r.json()["error"]
        assert (await client.get("/v2/health/live")).status_code == 200


async def test_wrong_method_says_which_are_allowed(repo):
    async with rest_client(repo) as (client, _):
        r = await client.get("/v2/repository/index")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json() == {"error": "Method Not Allowed"}


async def test_json_nested_past_the_decoders_limit(repo):
    # deeper than the JSON decoder's recursion limit, which it gives up at (Python 3.11: ~1,000; 3.12: ~8,000)
    deep = b"[" * 20000 + b"]" * 20000
    async with rest_client(repo) as (client, _):
        for path in ("/v2/models/lstm/infer", "/v2/repository/index"):
            r = await client.post(path, content=deep)
            assert r.status_code == 400 and "nests arrays or objects too deeply" in r.json()["error"], (path, r.text)
        assert (await client.get("/v2/health/live")).status_code == 200


async def test_request_id_is_echoed_and_must_be_a_string(repo):
    async with rest_client(repo) as (client, _):
        r = await client.post("/v2/models/lstm/infer", json={"id": "req-7", "inputs": [_inp()]})
        assert r.status_code == 200 and r.json()["id"] == "req-7"
        r = await client.post("/v2/models/lstm/infer", json={"id": None, "inputs": [_inp()]})
        assert r.status_code == 200 and "id" not in r.json()
        for bad in ({"x": 1}, 7, ["a"]):
            r = await client.post("/v2/models/lstm/infer", json={"id": bad, "inputs": [_inp()]})
            assert r.status_code == 400 and "request 'id' must be a string" in r.json()["error"], (bad, r.text)


async def test_malformed_bodies(repo):
    async with rest_client(repo, max_request_bytes=4096) as (client, _):
        r = await client.post("/v2/models/lstm/infer", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
        assert "Inference-Header-Content-Length" not in r.json()["error"]  # nothing suggests binary tensors
        r = await client.post("/v2/models/lstm/infer", content=b'{"inputs": []}\x00\x00\x80?')
        assert r.status_code == 400 and "needs the Inference-Header-Content-Length header" in r.json()["error"]
        r = await client.post("/v2/models/lstm/infer", content=b"")
        assert r.status_code == 400 and r.json()["error"] == "request body is empty; send a JSON object with an 'inputs' list"
        r = await client.post("/v2/models/lstm/infer", content=b"{}", headers={"Inference-Header-Content-Length": "0"})
        assert r.status_code == 400 and "Inference-Header-Content-Length is 0, so the request has no JSON header" \
            in r.json()["error"], r.text
        r = await client.post("/v2/models/lstm/infer", content=b"x" * 5000)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]
        nested = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1, 4],
                              "data": json.loads("[" * 200 + "1" + "]" * 200)}]}
        r = await client.post("/v2/models/lstm/infer", content=json.dumps(nested).encode())
        assert r.status_code == 400 and "input 'input'" in r.json()["error"], r.text
        r = await client.post("/v2/models/lstm/infer", content=b"{}", headers={"Inference-Header-Content-Length": "-1"})
        assert r.status_code == 400 and "must be the JSON header's length" in r.json()["error"]
        assert (await client.get("/v2/health/live")).status_code == 200
        r = await client.post("/v2/models/lstm/versions/9/infer", json={"inputs": [_inp()]})
        assert r.status_code == 404 and "has no version '9'" in r.json()["error"]


async def test_max_sequence_length(repo):
    write_config(repo, "lstm", max_sequence_length=3)
    async with rest_client(repo) as (client, _):
        body = {"inputs": [_inp(shape=(1, 4, 4), data=[0] * 16)]}
        r = await client.post("/v2/models/lstm/infer", json=body)
        assert r.status_code == 400 and "has 4 time steps, model 'lstm' accepts at most 3" in r.json()["error"]


async def test_v1_predict_ragged(repo):
    rng = np.random.default_rng(3)
    seqs = [rng.standard_normal((n, 4)).astype(np.float32) for n in (5, 1, 3)]
    engine = _engine(repo, "gru_bi")
    async with rest_client(repo) as (client, _):
        r = await client.post("/v1/models/gru_bi:predict", json={"instances": [s.tolist() for s in seqs]})
        assert r.status_code == 200, r.text
        preds = r.json()["predictions"]
        assert len(preds) == 3
        for seq, pred in zip(seqs, preds):
            alone = engine.forward(seq[None])
            assert np.asarray(pred["output"]).shape == (len(seq), 12)
            np.testing.assert_allclose(pred["output"], alone.output[0], atol=1e-5)
            np.testing.assert_allclose(pred["output_last"][:6], alone.output[0, -1, :6], atol=1e-5)
            np.testing.assert_allclose(pred["output_last"][6:], alone.output[0, 0, 6:], atol=1e-5)
        r = await client.post("/v1/models/lstm:predict", json={"instances": [seqs[0].tolist()], "outputs": ["h_n"]})
        assert list(r.json()["predictions"][0]) == ["h_n"]

        for body, message in [
            ({"instances": []}, "'instances' is empty"),
            ({"instances": [[]]}, "instances[0] has no time steps"),
            ({"instances": [[[1, 2, 3, 4], [1, 2]]]}, "instances[0][1] has 2 features but instances[0][0] has 4"),
            ({"instances": [[[1, 2, 3]]]}, "input 'input' has 3 features, model 'gru_bi' expects 4"),
            ({"instances": "abc"}, "invalid request body: instances"),
            ({"instances": [[[1, 2, 3, True]]]}, "invalid request body: instances.0.0.3: Input should be a valid number"),
            ({"instances": [[[1, 2, 3, "4"]]]}, "invalid request body: instances.0.0.3: Input should be a valid number"),
            ({"instances": [[[1, 2, 3, 4]]], "outputs": ["zzz"]}, "invalid request body: outputs"),
            # finite, past FP32's range: was "NaN or infinite"
            ({"instances": [[[1, 2, 3, 4]], [[1, 2, 3, 4], [1, 1e39, 3, 4]]]},
             "instances[1][1][1] is 1e+39, outside FP32's range"),
            # a V2 key was dropped without a word, and a step without features was named as V2's 'input'
            ({"instances": [[[1, 2, 3, 4]]], "parameters": {"timeout": 1}},
             "unknown key 'parameters': a predict body takes 'instances' and optionally 'outputs' and 'signature_name'"),
            ({"instances": [[[]]]}, "instances[0][0] has no features"),
        ]:
            r = await client.post("/v1/models/gru_bi:predict", json=body)
            assert r.status_code == 400 and message in r.json()["error"], (body, r.text)
        r = await client.post("/v1/models/gru_bi:predict",  # as TensorFlow Serving clients send it
                              json={"signature_name": "serving_default", "instances": [[[1, 2, 3, 4]]]})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/models/nope:predict", json={"instances": [[[1, 2, 3, 4]]]})
        assert r.status_code == 404
        # curl -d sends application/x-www-form-urlencoded; the JSON body is still read
        r = await client.post("/v1/models/gru_bi:predict", content=b'{"instances": [[[1, 2, 3, 4]]]}',
                              headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and len(r.json()["predictions"]) == 1
        r = await client.post("/v1/models/gru_bi:predict", content=b'{"instances": [[[1, 2, 3, 4]]')
        assert r.status_code == 400 and r.json()["error"].startswith("request body is not valid JSON")
        schema = (await client.get("/openapi.json")).json()["paths"]["/v1/models/{model}:predict"]["post"]
        assert "instances" in schema["requestBody"]["content"]["application/json"]["schema"]["properties"]
        docs = (await client.get("/openapi.json")).json()
        assert "/v1/models/{model}:predict" in docs["paths"] and "/v2/models/{model}/infer" in docs["paths"]
        assert (await client.get("/docs")).status_code == 200


async def test_repository_index_load_unload(repo):
    async with rest_client(repo) as (client, dataplane):
        index = (await client.post("/v2/repository/index")).json()
        assert index == [{"name": "gru_bi", "version": "1", "state": "READY", "reason": ""},
                         {"name": "lstm", "version": "1", "state": "READY", "reason": ""}]
        assert (await client.post("/v2/repository/models/lstm/unload", json={})).status_code == 200
        index = (await client.post("/v2/repository/index", json={"ready": False})).json()
        assert {"name": "lstm", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in index
        assert [m["name"] for m in (await client.post("/v2/repository/index", json={"ready": True})).json()] == ["gru_bi"]
        r = await client.get("/v2/models/lstm/ready")
        assert r.status_code == 503 and r.json()["ready"] is False
        r = await client.post("/v2/models/lstm/infer", json={"inputs": [_inp()]})
        assert r.status_code == 503 and "model 'lstm' version 1 is not ready (state UNAVAILABLE: unloaded)" in r.json()["error"]
        # counted under the version the answer names (it was version "", which no version's statistics show)
        assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", version="1", outcome="unavailable") == 1
        assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", version="", outcome="unavailable") == 0
        assert await dataplane.ready()  # an unloaded model is not loadable, so the server stays ready

        # a new version appears; load picks it up (version_policy latest)
        make_model(*LSTM, seed=9).save(repo, "lstm", 2)
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        meta = (await client.get("/v2/models/lstm")).json()
        assert meta["versions"] == ["2"]
        r = await client.post("/v2/models/lstm/infer", json={"inputs": [_inp()]})
        assert r.status_code == 200 and r.json()["model_version"] == "2"

        r = await client.post("/v2/repository/models/ghost/load")
        assert r.status_code == 404 and "no model 'ghost'" in r.json()["error"]
        r = await client.post("/v2/repository/models/ghost/unload")
        assert r.status_code == 404
        r = await client.post("/v2/repository/models/..%2E/load")
        assert r.status_code == 400 and "is not a model name" in r.json()["error"]
        r = await client.post("/v2/repository/index", content=b"[1]")
        assert r.status_code == 400
        r = await client.post("/v2/repository/index", json={"ready": "false"})  # bool("false") listed ready ones only
        assert r.status_code == 400 and "repository index parameter 'ready' must be true or false" in r.json()["error"]
        # Triton's load overrides are refused by name, never ignored (the caller would get another configuration)
        r = await client.post("/v2/repository/models/lstm/load", json={"parameters": {"config": '{"max_batch_size": 8}'}})
        assert r.status_code == 400 and "load parameters are not supported (got config)" in r.json()["error"]
        r = await client.post("/v2/repository/models/lstm/load", json={"parameters": "config"})
        assert r.status_code == 400 and "'parameters' must be a JSON object" in r.json()["error"]
        r = await client.post("/v2/repository/models/lstm/unload", json={"parameters": {"force": True}})
        assert r.status_code == 400 and "unload parameters are not supported (got force)" in r.json()["error"]
        assert (await client.get("/v2/models/lstm/ready")).status_code == 200
        r = await client.post("/v2/repository/models/lstm/unload", json={"parameters": {"unload_dependents": False}})
        assert r.status_code == 200


async def test_broken_models_do_not_stop_others(repo):
    (repo / "empty").mkdir()
    (repo / "badcfg").mkdir()
    (repo / "badcfg" / "config.json").write_text('{"max_batch_sise": 3}')
    (repo / "corrupt" / "1").mkdir(parents=True)
    (repo / "corrupt" / "1" / "model.safetensors").write_bytes(b"\x01\x00")
    # each was LOADING for good with no reason, or a 500 on load, before
    (repo / "cfgdir" / "config.json").mkdir(parents=True)  # IsADirectoryError
    (repo / "_under").mkdir()  # not a model name
    (repo / "nopolicy").mkdir()
    (repo / "nopolicy" / "config.json").write_text('{"version_policy": []}')
    for odd in ("\u00b2", "007", "0"):  # '²' is a digit to str.isdigit, not to int(); '007' is no folder of version 7;
        # versions count from 1 (convert and version_policy say so; Triton skips a folder 0)
        make_model(*LSTM, seed=3).save(repo, "oddversions", 1)
        (repo / "oddversions" / "1").rename(repo / "oddversions" / odd)
    (repo / "oddversions" / "2").mkdir()  # a version folder whose file was never copied in
    async with rest_client(repo) as (client, dataplane):
        assert await dataplane.ready()
        rows = {r["name"]: r for r in (await client.post("/v2/repository/index")).json()}
        assert rows["cfgdir"]["state"] == "UNAVAILABLE" and "is a folder, not a regular" in rows["cfgdir"]["reason"]
        assert rows["_under"]["state"] == "UNAVAILABLE" and "'_under' is not a model name" in rows["_under"]["reason"]
        # not a model, so no model is down: lost+found, at the root of every ext4 volume, fired an alert on
        # rnnserve_model_ready == 0 for good; unload refuses the name as load does (it answered 200)
        assert 'model="_under"' not in (await client.get("/metrics")).text
        r = await client.post("/v2/repository/models/_under/unload")
        assert r.status_code == 400 and "is not a model name" in r.json()["error"]
        assert 'rnnserve_model_ready{model="badcfg",version=""} 0.0' in (await client.get("/metrics")).text
        assert rows["nopolicy"]["state"] == "UNAVAILABLE" and "version_policy" in rows["nopolicy"]["reason"]
        assert rows["oddversions"]["state"] == "UNAVAILABLE" and "has no version folder" in rows["oddversions"]["reason"]
        # the folders that look like versions to whoever made them are named, each with why it is not one
        assert ("'0' (not a version number" in rows["oddversions"]["reason"]
                and "'007' (not a version number" in rows["oddversions"]["reason"]
                and "'2' (no model.safetensors)" in rows["oddversions"]["reason"])
        r = await client.post("/v2/repository/models/cfgdir/load")
        assert r.status_code == 400 and "config.json is a folder, not a regular file" in r.json()["error"]
        assert rows["lstm"]["state"] == "READY"
        assert rows["empty"]["state"] == "UNAVAILABLE" and "has no version folder" in rows["empty"]["reason"]
        assert rows["badcfg"]["state"] == "UNAVAILABLE" and "max_batch_sise" in rows["badcfg"]["reason"]
        assert rows["corrupt"]["state"] == "UNAVAILABLE" and "truncated" in rows["corrupt"]["reason"]
        r = await client.post("/v2/models/corrupt/infer", json={"inputs": [_inp()]})
        assert r.status_code == 503 and "failed to load" in r.json()["error"]
        r = await client.post("/v2/repository/models/badcfg/load")
        assert r.status_code == 400 and "max_batch_sise" in r.json()["error"]
        assert (await client.post("/v2/models/lstm/infer", json={"inputs": [_inp()]})).status_code == 200


async def test_a_reload_retires_the_versions_its_policy_drops(repo):
    """Versions outside the policy after a reload stop serving and leave the index; before, a new version 2
    left version 1 READY beside it, and a policy naming [1] left version 2 answering unversioned requests."""
    x = np.ones((1, 2, 4), np.float32)
    async with rest_client(repo) as (client, dataplane):
        make_model(*LSTM, seed=12).save(repo, "lstm", 2)
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        index = [(r["name"], r["version"], r["state"]) for r in (await client.post("/v2/repository/index")).json()]
        assert index == [("gru_bi", "1", "READY"), ("lstm", "2", "READY")]
        assert (await client.get("/v2/models/lstm/versions/1/ready")).status_code == 404
        write_config(repo, "lstm", version_policy=[1])
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        assert (await client.get("/v2/models/lstm")).json()["versions"] == ["1"]
        r = await client.post("/v2/models/lstm/infer", json=_infer_body(x))
        assert r.json()["model_version"] == "1"
        np.testing.assert_allclose(_outputs(r)["h_n"], _engine(repo, "lstm/1").forward(x).h_n, atol=1e-5)
        metrics = (await client.get("/metrics")).text
        assert 'rnnserve_model_ready{model="lstm",version="2"}' not in metrics  # retired: left the index
        assert 'rnnserve_model_ready{model="lstm",version="1"} 1.0' in metrics
        # a reload whose versions all fail leaves the version that served before serving
        write_config(repo, "lstm", version_policy=[2])
        (repo / "lstm" / "2" / "model.safetensors").write_bytes(b"\x01\x00")
        r = await client.post("/v2/repository/models/lstm/load")
        assert r.status_code >= 400
        r = await client.post("/v2/models/lstm/infer", json=_infer_body(x))
        assert r.status_code == 200 and r.json()["model_version"] == "1"
        # a version that serves while its new copy failed: the index says so beside it (it said nothing)
        write_config(repo, "lstm", version_policy=[1])
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        (repo / "lstm" / "1" / "model.safetensors").write_bytes(b"\x01\x00")
        r = await client.post("/v2/repository/models/lstm/load")
        assert r.status_code == 400
        row = next(r for r in (await client.post("/v2/repository/index")).json() if r["name"] == "lstm")
        assert row["version"] == "1" and row["state"] == "READY"
        assert row["reason"].startswith("serving the earlier load; the last load failed: "), row
        assert (await client.post("/v2/models/lstm/infer", json=_infer_body(x))).status_code == 200


async def test_a_deleted_model_folder_leaves_the_index(repo):
    # a version that failed to load, then its folder deleted: listed for good, and metadata said 503 "not ready"
    broken = repo / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / "model.safetensors").write_bytes(b"not a model")
    async with rest_client(repo) as (client, _):
        rows = {r["name"]: r for r in (await client.post("/v2/repository/index")).json()}
        assert rows["broken"]["state"] == "UNAVAILABLE"
        shutil.rmtree(repo / "broken")
        assert [r["name"] for r in (await client.post("/v2/repository/index")).json()] == ["gru_bi", "lstm"]
        r = await client.get("/v2/models/broken")
        assert r.status_code == 404 and "unknown model 'broken'" in r.json()["error"]
        # an unloaded model whose folder goes leaves too; a serving one keeps serving until it is unloaded
        assert (await client.post("/v2/repository/models/gru_bi/unload")).status_code == 200
        shutil.rmtree(repo / "gru_bi")
        shutil.rmtree(repo / "lstm")
        r = await client.post("/v2/repository/models/gru_bi/load")
        assert r.status_code == 404 and "no model 'gru_bi'" in r.json()["error"]
        assert [r["name"] for r in (await client.post("/v2/repository/index")).json()] == ["lstm"]
        assert (await client.post("/v2/models/lstm/infer", json={"inputs": [_inp()]})).status_code == 200


async def test_version_policy(repo):
    for v in (2, 3):
        make_model(*LSTM, seed=10 + v).save(repo, "lstm", v)
    write_config(repo, "lstm", version_policy=[1, 3])
    write_config(repo, "gru_bi", version_policy="all")
    async with rest_client(repo) as (client, _):
        index = [(r["name"], r["version"]) for r in (await client.post("/v2/repository/index")).json()]
        assert index == [("gru_bi", "1"), ("lstm", "1"), ("lstm", "3")]
        assert (await client.get("/v2/models/lstm")).json()["versions"] == ["1", "3"]
        x = np.ones((1, 2, 4), np.float32)
        r1 = _outputs(await client.post("/v2/models/lstm/versions/1/infer", json=_infer_body(x)))
        r3 = _outputs(await client.post("/v2/models/lstm/infer", json=_infer_body(x)))
        np.testing.assert_allclose(r1["h_n"], _engine(repo, "lstm/1").forward(x).h_n, atol=1e-5)
        np.testing.assert_allclose(r3["h_n"], _engine(repo, "lstm/3").forward(x).h_n, atol=1e-5)
        r = await client.post("/v2/models/lstm/versions/2/infer", json=_infer_body(x))
        assert r.status_code == 404 and "served versions: 1, 3" in r.json()["error"]


async def test_error_body_is_json_everywhere(repo):
    async with rest_client(repo) as (client, _):
        r = await client.post("/v2/models/lstm/infer", content=json.dumps({"inputs": [_inp()]}).encode(),
                              headers={"Content-Encoding": "br"})
        assert r.status_code == 400 and "Content-Encoding 'br' is not supported" in r.json()["error"]


async def test_large_json_request_and_response(repo):
    x = np.random.default_rng(4).standard_normal((2, 5000, 4)).astype(np.float32)
    expected = _engine(repo, "lstm").forward(x)
    body = json.dumps(_infer_body(x, outputs=["output", "h_n"])).encode()
    assert len(body) > 256 * 1024
    async with rest_client(repo) as (client, _):
        r = await client.post("/v2/models/lstm/infer", content=body)
        assert r.status_code == 200
        got = _outputs(r)
    np.testing.assert_allclose(got["output"], expected.output, atol=1e-4)


async def test_json_answers_are_held_to_the_request_limit(repo):
    """An answer can hold far more numbers than its request; as JSON it is refused before it is encoded."""
    # output: 8,000 numbers; inputs in quarters (exact in FP32) keep the 4,000 of the request short
    x = (np.round(np.random.default_rng(5).standard_normal((1, 1000, 4)) * 4) / 4).astype(np.float32)
    async with rest_client(repo, max_request_bytes=64 * 1024) as (client, dataplane):
        body = _infer_body(x, outputs=["output", "h_n"])
        assert len(json.dumps(body)) < 64 * 1024
        r = await client.post("/v2/models/lstm/infer", json=body)
        assert r.status_code == 413, r.text
        assert ("the answer of model 'lstm' would take about 160,324 bytes (h_n: 16 numbers, output: 8,000 numbers), over "
                "the server's limit on JSON answers of 65,536 bytes (--max-request-bytes); ask for binary outputs"
                ) in r.json()["error"]
        r = await client.post("/v2/models/lstm/infer", json={**body, "parameters": {"binary_data_output": True}})
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        per_output = {**body, "outputs": [{"name": "output", "parameters": {"binary_data": True}}, {"name": "h_n"}]}
        r = await client.post("/v2/models/lstm/infer", json=per_output)  # only h_n as JSON: within the limit
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        r = await client.post("/v2/models/lstm/infer", json=_infer_body(x, outputs=["output_last", "h_n"]))
        assert r.status_code == 200
        np.testing.assert_allclose(_outputs(r)["output_last"], _engine(repo, "lstm").forward(x).output[:, -1],
                                   rtol=1e-5, atol=1e-6)
        seqs = {"instances": [x[0].tolist(), x[0, :10].tolist()]}
        r = await client.post("/v1/models/lstm:predict", json=seqs)
        assert r.status_code == 413 and 'ask for "outputs": ["output_last"]' in r.json()["error"]
        # output trimmed to each instance's length: 1,010 steps, not 2 x 1,000
        assert "(output: 8,080 numbers, output_last: 16 numbers)" in r.json()["error"]
        r = await client.post("/v1/models/lstm:predict", json={**seqs, "outputs": ["output_last"]})
        assert r.status_code == 200 and len(r.json()["predictions"]) == 2
        assert (await client.get("/v2/health/live")).status_code == 200
        # refused before they ran: counted as such, and the engine computed only the four answered
        assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", outcome="resource_exhausted") == 2
        assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", outcome="success") == 4
        assert metric_value(dataplane, "rnnserve_batch_size_count", model="lstm") == 4


async def test_model_ready_of_a_broken_folder_is_false(repo):
    (repo / "empty").mkdir()
    async with rest_client(repo) as (client, _):
        r = await client.get("/v2/models/empty/ready")
        assert r.status_code == 503 and r.json()["ready"] is False
        r = await client.get("/v2/models/empty")
        assert r.status_code == 503 and "has no version folder" in r.json()["error"]


async def test_fastapi_infer_route_answers_like_the_fast_path(repo):
    # InferFastPath answers /infer first; the FastAPI route (what /docs shows) must give the same answers.
    import httpx

    from service.transports.rest import create_rest_app

    x = np.random.default_rng(5).standard_normal((2, 5, 4)).astype(np.float32)
    requests = [("/v2/models/lstm/infer", _infer_body(x, np.array([5, 3]))),
                ("/v2/models/lstm/versions/1/infer", _infer_body(x)),
                ("/v2/models/nope/infer", _infer_body(x)),
                ("/v2/models/lstm/infer", _infer_body(x[:, :, :3]))]
    async with rest_client(repo) as (fast, dataplane):
        app = create_rest_app(dataplane).app  # the FastAPI app behind the fast path
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as routed:
            for path, body in requests:
                a, b = await fast.post(path, json=body), await routed.post(path, json=body)
                assert a.status_code == b.status_code and a.json() == b.json(), path
    assert [r for r in app.routes if getattr(r, "path", "") == "/v2/models/{model}/infer"]


async def test_an_error_quoting_a_lone_surrogate_still_answers():
    # decoding refuses such strings first; this is the answer's own guard, for any other way one gets in
    from service.errors import InvalidInput
    from service.transports.rest.responses import error_response

    r = error_response(InvalidInput("unknown input '\ud800'"))
    assert r.status_code == 400 and json.loads(r.body) == {"error": "unknown input '\\ud800'"}


async def test_an_unload_whose_caller_is_cancelled_still_completes_and_drains(repo):
    """A gRPC unload past its deadline is cancelled; the cancellation used to land inside the unload's drain,
    leaving the version UNLOADING for good, later loads and unloads answering 500, and held requests unanswered."""
    from service.spec import BlockSpec

    make_model(BlockSpec("lstm", 4, 128, num_layers=2), seed=3).save(repo, "wide", 1)  # ~0.2 s per 10,000 steps
    x = np.random.default_rng(0).standard_normal((1, 40000, 4)).astype(np.float32)
    head = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "output_last", "parameters": {"binary_data": False}}]}).encode()
    binary = {"content": head + x.tobytes(), "headers": {"Inference-Header-Content-Length": str(len(head))}}
    async with rest_client(repo) as (client, dataplane):
        infers = [asyncio.ensure_future(client.post("/v2/models/wide/infer", **binary)) for _ in range(6)]
        await asyncio.sleep(0.2)  # queued or running (each ~0.8 s of the engine)
        unload = asyncio.ensure_future(dataplane.unload_model("wide"))
        await asyncio.sleep(0.02)
        rows = {r["name"]: r for r in (await client.post("/v2/repository/index")).json()}
        assert rows["wide"]["state"] == "UNLOADING"  # cancelled in the middle of its drain
        unload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unload
        answers = await asyncio.gather(*infers)
        assert [r.status_code for r in answers] == [200] * 6
        for _ in range(100):
            rows = {r["name"]: r for r in (await client.post("/v2/repository/index")).json()}
            if rows["wide"]["state"] != "UNLOADING":
                break
            await asyncio.sleep(0.05)
        assert rows["wide"] == {"name": "wide", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
        assert (await client.post("/v2/repository/models/wide/load")).status_code == 200
        assert (await client.post("/v2/models/wide/infer", **binary)).status_code == 200


async def test_a_reload_that_fails_on_its_config_says_so_beside_the_versions_still_serving(repo):
    """The old versions keep serving, and the index says why the reload did not take (it said nothing)."""
    async with rest_client(repo) as (client, dataplane):
        (repo / "lstm" / "config.json").write_text("{bad")
        r = await client.post("/v2/repository/models/lstm/load")
        assert r.status_code == 400 and "config.json is not valid JSON" in r.json()["error"]
        row = next(r for r in (await client.post("/v2/repository/index")).json() if r["name"] == "lstm")
        assert row["state"] == "READY" and row["reason"].startswith(
            "serving the earlier load; the last load failed: ") and "config.json is not valid JSON" in row["reason"]
        (repo / "lstm" / "config.json").write_text("{}")
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        row = next(r for r in (await client.post("/v2/repository/index")).json() if r["name"] == "lstm")
        assert row == {"name": "lstm", "version": "1", "state": "READY", "reason": ""}


async def test_the_index_lists_a_model_folder_added_after_the_start(repo):
    """Triton's index lists every model of the repository, loaded or not; this one listed only what it had seen."""
    async with rest_client(repo) as (client, _):
        shutil.copytree(repo / "lstm", repo / "lstm_copy")
        (repo / ".hidden").mkdir()
        rows = (await client.post("/v2/repository/index")).json()
        assert [r["name"] for r in rows] == ["gru_bi", "lstm", "lstm_copy"]
        assert rows[2]["version"] == "" and rows[2]["state"] == "" and "not loaded" in rows[2]["reason"]
        assert [r["name"] for r in (await client.post("/v2/repository/index", json={"ready": True})).json()] == \
            ["gru_bi", "lstm"]
        r = await client.post("/v2/models/lstm_copy/infer", json={"inputs": [_inp()]})
        assert r.status_code == 404 and "is in repository" in r.json()["error"]
        assert "/v2/repository/models/lstm_copy/load" in r.json()["error"]
        assert (await client.post("/v2/repository/models/lstm_copy/load")).status_code == 200
        rows = (await client.post("/v2/repository/index")).json()
        assert {"name": "lstm_copy", "version": "1", "state": "READY", "reason": ""} in rows
        assert (await client.post("/v2/models/lstm_copy/infer", json={"inputs": [_inp()]})).status_code == 200


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy says the relu cell overflows (inf, then inf - inf)
async def test_non_finite_outputs_are_written_as_triton_writes_them(repo):
    from service.spec import BlockSpec

    from service.repository import PackedModel

    small = make_model(BlockSpec("rnn_relu", 1, 2), seed=1)
    PackedModel(small.spec, [np.abs(w) * 1e30 for w in small.weights]).save(repo, "relu", 1)
    async with rest_client(repo) as (client, _):
        body = {"inputs": [_inp(shape=(1, 2, 1), data=[1e38, 1e38])], "outputs": [{"name": "output"}]}
        r = await client.post("/v2/models/relu/infer", json=body)
        assert r.status_code == 200
        # the inputs are finite; the relu cell overflows: NaN/Infinity tokens, which Python's json reads
        assert b"Infinity" in r.content or b"NaN" in r.content, r.content
        values = np.array(json.loads(r.content)["outputs"][0]["data"], np.float32)
        assert not np.isfinite(values).all()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_answers_are_compressed_when_the_request_accepts_it(repo, binary):
    import gzip
    import zlib

    x = np.random.default_rng(3).standard_normal((2, 5, 4)).astype(np.float32)
    body = {**_infer_body(x), "outputs": [{"name": "output", "parameters": {"binary_data": binary}}]}
    async with rest_client(repo) as (client, _):
        plain = await client.post("/v2/models/lstm/infer", json=body, headers={"accept-encoding": "identity"})
        assert plain.status_code == 200, plain.text
        assert "content-encoding" not in plain.headers and plain.headers["vary"] == "Accept-Encoding"
        for accept, coding, inflate in [("gzip", "gzip", gzip.decompress), ("deflate", "deflate", zlib.decompress),
                                        ("deflate;q=0.5, gzip;q=0.9", "gzip", gzip.decompress),
                                        ("gzip;q=0, deflate", "deflate", zlib.decompress)]:
            # httpx would inflate it itself: read the raw bytes
            request = client.build_request("POST", "/v2/models/lstm/infer", json=body,
                                           headers={"accept-encoding": accept})
            r = await client.send(request, stream=True)
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
            assert r.status_code == 200 and r.headers["content-encoding"] == coding, accept
            assert inflate(raw) == plain.content
            # the binary extension's header length counts the JSON header before compression, as Triton's
            assert r.headers.get("inference-header-content-length") == plain.headers.get("inference-header-content-length")
        r = await client.post("/v2/models/lstm/infer", json=body, headers={"accept-encoding": "br, *;q=0.1"})
        assert "content-encoding" not in r.headers and r.content == plain.content


async def test_a_model_asked_for_before_the_startup_scan_is_loading_not_missing(repo):
    """With front-end processes, a front-end could ask the engine process for a model before its registry had
    scanned the repository: 404 "not loaded; load it first" (and the index said the same) for a model that was
    about to load. Until the scan it is LOADING, and a request gets 503."""
    from service.errors import Unavailable
    from service.registry import ModelRegistry

    registry = ModelRegistry(repo)
    with pytest.raises(Unavailable, match="model 'lstm' is not ready: the server is starting"):
        registry.entry("lstm")
    assert {(r["name"], r["state"]) for r in registry.index()} == {("gru_bi", "LOADING"), ("lstm", "LOADING")}
    await registry.start()
    try:
        assert registry.serving("lstm").state.value == "READY"
        shutil.copytree(repo / "lstm", repo / "later")
        with pytest.raises(Exception, match="not loaded .* load it first"):
            registry.entry("later")
    finally:
        await registry.stop()


async def test_a_repository_whose_models_all_failed_is_not_ready_until_one_loads(tmp_path):
    """It answered ready and then refused every request: a rollout of a broken repository replaced good pods. A
    repository with no model folder (lost+found aside) is still ready: models are loaded into it later."""
    repo = tmp_path / "models"
    (repo / "lost+found").mkdir(parents=True)
    async with rest_client(repo) as (client, _):
        assert (await client.get("/v2/health/ready")).status_code == 200
    (repo / "lstm" / "1").mkdir(parents=True)
    (repo / "lstm" / "1" / "model.safetensors").write_bytes(b"\x01\x00")
    async with rest_client(repo) as (client, dataplane):
        assert (await client.get("/v2/health/ready")).status_code == 503
        assert (await client.get("/v2/health/live")).status_code == 200
        make_model(*LSTM, seed=3).save(repo, "lstm", 1, replace=True)
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        assert (await client.get("/v2/health/ready")).status_code == 200
        assert (await client.post("/v2/models/lstm/infer", json={"inputs": [_inp()]})).status_code == 200


async def test_the_series_of_a_version_that_leaves_the_index_go_with_it(repo):
    """Counters and histograms of retired versions stayed until a restart: /metrics grew ~100 series a rollout. A
    version that comes back later counts afresh, not into the removed series."""
    x = np.ones((1, 2, 4), np.float32)
    async with rest_client(repo) as (client, dataplane):
        assert (await client.post("/v2/models/lstm/infer", json=_infer_body(x))).status_code == 200
        assert 'model="lstm",version="1"' in (await client.get("/metrics")).text
        for rollout in (2, 3):  # a new version, then the old folder deleted
            make_model(*LSTM, seed=rollout).save(repo, "lstm", rollout)
            assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
            shutil.rmtree(repo / "lstm" / str(rollout - 1))
            r = await client.post("/v2/models/lstm/infer", json=_infer_body(x))
            assert r.json()["model_version"] == str(rollout)
            metrics = (await client.get("/metrics")).text
            assert f'model="lstm",version="{rollout - 1}"' not in metrics, rollout
            assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", version=str(rollout),
                                outcome="success") == 1
        # version 2 again: its counts start from what it now serves
        make_model(*LSTM, seed=2).save(repo, "lstm", 2)
        write_config(repo, "lstm", version_policy=[2])
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        for _ in range(2):
            assert (await client.post("/v2/models/lstm/infer", json=_infer_body(x))).status_code == 200
        assert metric_value(dataplane, "rnnserve_requests_total", model="lstm", version="2", outcome="success") == 2
        assert 'model="lstm",version="3"' not in (await client.get("/metrics")).text
        # a deleted and unloaded model takes every series with it, those counted before it had a version too
        assert (await client.post("/v2/models/gru_bi/versions/9/infer", json=_infer_body(x))).status_code == 404
        assert 'model="gru_bi"' in (await client.get("/metrics")).text
        shutil.rmtree(repo / "gru_bi")
        assert (await client.post("/v2/repository/models/gru_bi/unload")).status_code == 200
        # at once, not at the next index call: an alert on rnnserve_model_ready == 0 kept firing until then
        assert 'model="gru_bi"' not in (await client.get("/metrics")).text
        r = await client.get("/v2/models/gru_bi/ready")
        assert r.status_code == 404 and "unknown model 'gru_bi'" in r.json()["error"]


async def test_infer_takes_the_version_query_parameter_the_docs_list(repo):
    """/docs lists ?version= on POST /v2/models/{model}/infer, as on the other model routes; infer ignored it."""
    make_model(*LSTM, seed=12).save(repo, "lstm", 2)
    write_config(repo, "lstm", version_policy="all")
    x = np.ones((1, 2, 4), np.float32)
    async with rest_client(repo) as (client, _):
        spec = (await client.get("/openapi.json")).json()
        params = spec["paths"]["/v2/models/{model}/infer"]["post"].get("parameters", [])
        assert any(p["name"] == "version" and p["in"] == "query" for p in params)
        r = await client.post("/v2/models/lstm/infer?version=1", json=_infer_body(x))
        assert r.status_code == 200 and r.json()["model_version"] == "1"
        r = await client.post("/v2/models/lstm/infer", json=_infer_body(x))
        assert r.json()["model_version"] == "2"
        r = await client.post("/v2/models/lstm/infer?version=7", json=_infer_body(x))
        assert r.status_code == 404 and "has no version '7'" in r.json()["error"]



async def test_the_openapi_examples_run_on_the_bundled_models():
    """The /docs examples had 3 features a step: sent as they are to the bundled models, they got 400."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2] / "models"
    async with rest_client(repo) as (client, _):
        spec = (await client.get("/openapi.json")).json()
        infer = spec["paths"]["/v2/models/{model}/infer"]["post"]["requestBody"]["content"]["application/json"]
        for example in infer["examples"].values():
            r = await client.post("/v2/models/forecaster/infer", json=example["value"])
            assert r.status_code == 200, r.text
        predict = spec["paths"]["/v1/models/{model}:predict"]["post"]["requestBody"]["content"]["application/json"]
        for example in predict["schema"]["examples"]:
            r = await client.post("/v1/models/forecaster:predict", json=example)
            assert r.status_code == 200, r.text
        assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


async def test_unloading_every_model_keeps_the_server_ready(repo):
    """Not ready would take the pod out of its Service, and with it the repository API to load a model again."""
    async with rest_client(repo) as (client, _):
        for name in ("lstm", "gru_bi"):
            assert (await client.post(f"/v2/repository/models/{name}/unload")).status_code == 200
        assert (await client.get("/v2/health/ready")).status_code == 200


async def test_a_key_given_twice_in_a_request_is_refused(repo):
    """Python's json kept the last copy and answered on it; Triton's parser takes the first: refused, as in
    config.json."""
    tensor = '{"name": "input", "datatype": "FP32", "shape": [1, 2, 4], "data": [%s], "data": [%s]}' % (
        ", ".join(["0.5"] * 8), ", ".join(["5"] * 8))
    async with rest_client(repo) as (client, _):
        for path, body in [("/v2/models/lstm/infer", '{"inputs": [%s]}' % tensor),
                           ("/v2/models/lstm/infer", '{"inputs": [], "inputs": [%s]}' % tensor.replace(
                               ', "data": [%s]' % ", ".join(["5"] * 8), "")),
                           ("/v1/models/lstm:predict", '{"instances": [[[1, 2, 3, 4]]], "instances": [[[0, 0, 0, 0]]]}')]:
            r = await client.post(path, content=body.encode())
            assert r.status_code == 400 and "more than once; keep one" in r.json()["error"], (path, r.text)


async def test_a_request_listing_more_tensors_than_a_model_has_is_refused_at_once(repo):
    async with rest_client(repo) as (client, _):
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1, 4], "data": [0, 0, 0, 0]}],
                "outputs": [{"name": "h_n"}] * 17}
        r = await client.post("/v2/models/lstm/infer", content=json.dumps(body).encode())
        assert r.status_code == 400 and "lists 17 outputs" in r.json()["error"]


async def test_a_model_loaded_again_after_an_unload_is_loading_while_it_loads(repo, monkeypatch):
    """The index said UNAVAILABLE "unloaded", and requests "not ready (state UNAVAILABLE: unloaded)", for the whole
    load, as if the load had not started."""
    from service.registry.registry import ModelRegistry

    release = asyncio.Event()
    build = ModelRegistry._build

    def slow_build(self, model_dir, version, config):
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
        return build(self, model_dir, version, config)

    loop = asyncio.get_running_loop()
    async with rest_client(repo) as (client, _):
        assert (await client.post("/v2/repository/models/lstm/unload")).status_code == 200
        monkeypatch.setattr(ModelRegistry, "_build", slow_build)
        load = asyncio.ensure_future(client.post("/v2/repository/models/lstm/load"))
        await asyncio.sleep(0.2)
        row = next(r for r in (await client.post("/v2/repository/index")).json() if r["name"] == "lstm")
        assert (row["version"], row["state"], row["reason"]) == ("1", "LOADING", "")
        r = await client.post("/v2/models/lstm/infer", json={"inputs": [_inp()]})
        assert r.status_code == 503 and "state LOADING" in r.json()["error"]
        release.set()
        assert (await load).status_code == 200
        assert (await client.post("/v2/models/lstm/infer", json={"inputs": [_inp()]})).status_code == 200


async def test_a_failed_reload_is_told_beside_its_own_version_only(repo):
    """Version 2's new copy failed and version 1's loaded: both READY rows blamed the failure."""
    make_model(*LSTM, seed=21).save(repo, "lstm", 2)
    write_config(repo, "lstm", version_policy="all")
    async with rest_client(repo) as (client, _):
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        (repo / "lstm" / "2" / "model.safetensors").write_bytes(b"\x01\x00")
        assert (await client.post("/v2/repository/models/lstm/load")).status_code >= 400
        rows = {r["version"]: r for r in (await client.post("/v2/repository/index")).json() if r["name"] == "lstm"}
        assert rows["1"] == {"name": "lstm", "version": "1", "state": "READY", "reason": ""}
        assert rows["2"]["state"] == "READY"
        assert rows["2"]["reason"].startswith("serving the earlier load; the last load failed: ")
        assert "version 2" in rows["2"]["reason"]


@pytest.mark.parametrize("policy", ["all", "latest"])
async def test_a_stream_a_reload_ended_is_explained_by_the_new_latest_version(repo, policy):
    """A stream started without naming a version on version 1; a reload brought version 2, which unversioned chunks
    now reach. It said the stream was "never started, or ended long ago"."""
    x = np.ones((1, 2, 4), np.float32)
    async with rest_client(repo) as (client, _):
        r = await client.post("/v2/models/lstm/infer", json=_infer_body(x, sequence_id=7, sequence_start=True))
        assert r.status_code == 200 and r.json()["model_version"] == "1"
        make_model(*LSTM, seed=22).save(repo, "lstm", 2)
        write_config(repo, "lstm", version_policy=policy)
        assert (await client.post("/v2/repository/models/lstm/load")).status_code == 200
        r = await client.post("/v2/models/lstm/infer", json=_infer_body(x, sequence_id=7))
        assert r.status_code == 404, r.text
        assert "stream 7 of model 'lstm' is not live: it was ended when model 'lstm' version 1 was unloaded or " \
               "reloaded" in r.json()["error"]

"""Seeded random malformed requests, over REST (in-process) and gRPC (a real server process).

Every answer must be a result or a clear client error: a 4xx/503/504 with a JSON ``error`` over REST,
a gRPC status other than INTERNAL/UNKNOWN with a message; and the server must stay live. The hand-written
cases of test_rest.py and test_grpc.py name each error; these find the ones nobody wrote down (a 2.7 for
an INT32 length was cut to 2, integers past 64 bits and shapes like [0, 2**40, 2**40] answered 500/INTERNAL).
"""
from __future__ import annotations

import gzip
import json
import random
import zlib
from typing import Any

import numpy as np
import pytest

from serving_support import rest_client

CASES = 400
REST_STATUSES = {200, 400, 404, 413, 422, 503, 504}
WEIRD: list[Any] = [None, True, False, 0, -1, 1, 2 ** 70, -2 ** 70, 1.5, 2.7, float("nan"), "", "x", "1", [], [1],
                    {}, {"a": 1}, [[1]], 1e308, 2 ** 1100]
DATATYPES = ["FP32", "FP32", "FP16", "FP64", "INT32", "INT64", "UINT8", "BOOL", "BYTES", "fp32", "XX"]
NAMES = ["input", "input", "input", "lengths", "h_0", "c_0", "bogus", ""]


class Malformed:
    """A seeded source of mostly-wrong infer requests for the test repository's models (I=4)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def weird(self) -> Any:
        return self.rng.choice(WEIRD)

    def shape(self) -> list[int]:
        r = self.rng
        if r.random() < 0.15:
            return [r.choice([0, 2 ** 40, -1, 3]) for _ in range(r.choice([0, 1, 3, 4]))]
        return [r.choice([1, 2, 0]), r.choice([1, 3, 0]), r.choice([4, 4, 4, 3])]

    def json_tensor(self) -> dict:
        r = self.rng
        name = r.choice(NAMES)
        shape = [r.choice([1, 2])] if name == "lengths" else self.shape()
        count = int(np.prod([max(0, min(s, 50)) for s in shape])) if shape else 1
        data: Any = [r.choice([r.random(), r.randrange(1, 4)]) for _ in range(count)]
        t = {"name": name, "datatype": "INT32" if name == "lengths" and r.random() < 0.7 else r.choice(DATATYPES),
             "shape": shape, "data": data}
        field = r.choice(["name", "datatype", "shape", "data", "parameters", None, None, None])
        if field is not None:
            t[field] = self.weird() if r.random() < 0.8 else [[self.weird()]]
        return t

    def valid_inputs(self) -> list[dict]:
        """A request the server answers: odd batch and time sizes, each float type, lengths or not."""
        r = self.rng
        b, t = r.randrange(1, 4), r.randrange(1, 6)
        x = {"name": "input", "datatype": r.choice(["FP32", "FP16", "FP64"]), "shape": [b, t, 4],
             "data": [r.uniform(-2, 2) for _ in range(b * t * 4)]}
        if r.random() < 0.5:
            return [x]
        return [x, {"name": "lengths", "datatype": r.choice(["INT32", "INT64"]), "shape": [b],
                    "data": [r.randrange(1, t + 1) for _ in range(b)]}]

    def json_body(self) -> Any:
        r = self.rng
        if r.random() < 0.3:
            inputs = self.valid_inputs()
        else:
            inputs = [self.json_tensor() for _ in range(r.choice([1, 1, 2, 3]))]
        body: dict[str, Any] = {"inputs": inputs}
        if r.random() < 0.2:
            body["outputs"] = r.choice([self.weird(), [{"name": r.choice(["output", "output_last", "zz"])}],
                                        [{"name": "output", "parameters": self.weird()}]])
        if r.random() < 0.3:
            body["parameters"] = r.choice([
                self.weird(), {"sequence_id": self.weird()}, {"timeout": self.weird()},
                {"sequence_id": r.choice([7, "s"]), "sequence_start": self.weird(), "sequence_end": self.weird()},
                {"binary_data_output": self.weird()}])
        if r.random() < 0.05:
            return self.weird()
        return body

    def rest(self) -> tuple[str, dict[str, str], bytes]:
        """(path, headers, body) of one request."""
        r = self.rng
        model = r.choice(["lstm", "lstm", "gru_bi", "nope"])
        path = f"/v2/models/{model}{r.choice(['', '', '/versions/1', '/versions/x'])}/infer"
        headers = {"content-type": "application/json"}
        body = self.json_body()
        raw = json.dumps(body, allow_nan=True).encode()
        kind = r.random()
        if kind < 0.25 and isinstance(body, dict) and isinstance(body["inputs"][0], dict):
            binary = np.zeros(r.choice([0, 4, 12, 16]), np.float32).tobytes()
            body["inputs"][0].pop("data", None)
            body["inputs"][0]["parameters"] = {"binary_data_size": r.choice([len(binary), len(binary) + 4, -4, "x"])}
            head = json.dumps(body).encode()
            headers["inference-header-content-length"] = str(r.choice([len(head), len(head) + 1, -1, "abc"]))
            raw = head + binary
        elif kind < 0.3:
            raw = raw[: r.randrange(len(raw) + 1)]
        elif kind < 0.35:
            headers["content-encoding"] = r.choice(["gzip", "deflate", "br"])
            raw = r.choice([gzip.compress(raw), zlib.compress(raw), raw])
        return path, headers, raw

    def predict(self) -> Any:
        r = self.rng
        step = [r.random() for _ in range(r.choice([4, 4, 3]))]
        instances = r.choice([[[step] * r.randrange(0, 3)] * r.randrange(0, 3), self.weird(), [[self.weird()]],
                              [[[self.weird()] * 4]], [[step], [step[:2]]]])
        return r.choice([{"instances": instances}, {"instances": instances, "outputs": self.weird()}, self.weird()])


def _assert_clear(status: int, body: bytes, what: str) -> None:
    assert status in REST_STATUSES, f"{status} for {what}: {body[:300]!r}"
    if status != 200:
        message = json.loads(body)["error"]
        assert isinstance(message, str) and message, what


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2])
async def test_rest_answers_malformed_requests_with_clear_errors(repo, seed):
    source = Malformed(seed)
    answered = set()
    async with rest_client(repo) as (client, _):
        for _ in range(CASES):
            path, headers, raw = source.rest()
            r = await client.post(path, content=raw, headers=headers)
            _assert_clear(r.status_code, r.content, f"POST {path} {headers} {raw[:300]!r}")
            answered.add(r.status_code)
        for _ in range(CASES // 4):
            body = json.dumps(source.predict()).encode()
            r = await client.post("/v1/models/lstm:predict", content=body, headers={"content-type": "application/json"})
            _assert_clear(r.status_code, r.content, f"predict {body[:300]!r}")
        assert (await client.get("/v2/health/live")).status_code == 200
    assert {200, 400} <= answered  # the source reaches the engine as well as the validation


def test_grpc_answers_malformed_requests_with_clear_statuses(server_process):
    grpc = pytest.importorskip("grpc")
    from service.transports.grpc.generated import inference_pb2 as pb
    from service.transports.grpc.generated import inference_pb2_grpc as pbg

    _, grpc_url = server_process
    if grpc_url is None:
        pytest.skip("the server runs without gRPC")
    grpc_url = grpc_url.removeprefix("grpc://")
    refused = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
    rng = random.Random(3)

    def tensor(msg: Any) -> bytes | None:
        t = msg.inputs.add(name=rng.choice(NAMES), datatype=rng.choice(DATATYPES))
        shape = Malformed(rng.randrange(1 << 30)).shape()
        t.shape.extend(shape)
        count = int(np.prod([max(0, min(s, 50)) for s in shape])) if shape else 1
        how = rng.random()
        if how < 0.5:
            return np.zeros(count * rng.choice([1, 2, 4, 8]) + rng.choice([0, 0, 1]), np.uint8).tobytes()
        if how < 0.65:
            t.contents.fp32_contents.extend([rng.random() for _ in range(count)])
        elif how < 0.8:
            t.contents.int_contents.extend([rng.randrange(-5, 300) for _ in range(count)])
        elif how < 0.9:
            t.contents.fp64_contents.extend([float("nan")] * count)
        return None

    codes = set()
    with grpc.insecure_channel(grpc_url) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        for _ in range(CASES):
            msg = pb.ModelInferRequest(model_name=rng.choice(["lstm", "lstm", "gru_bi", "nope", ""]),
                                       model_version=rng.choice(["", "", "1", "x"]))
            raws = [tensor(msg) for _ in range(rng.choice([0, 1, 1, 2]))]
            if any(b is not None for b in raws) and rng.random() < 0.9:
                msg.raw_input_contents.extend([b or b"" for b in raws])
            keys = ["sequence_id", "sequence_start", "sequence_end", "timeout"]
            for key in rng.sample(keys, rng.choice([0, 0, 1, 2])):
                param = msg.parameters[key]
                choice = rng.random()
                if choice < 0.4:
                    param.int64_param = rng.choice([0, 1, -1, 2 ** 63 - 1])
                elif choice < 0.7:
                    param.string_param = rng.choice(["", "a", "1"])
                else:
                    param.bool_param = rng.choice([True, False])
            try:
                stub.ModelInfer(msg, timeout=30)
                codes.add(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                assert exc.code() not in refused and exc.details(), f"{exc.code()} {exc.details()} for {msg}"
                codes.add(exc.code())
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
    assert grpc.StatusCode.INVALID_ARGUMENT in codes

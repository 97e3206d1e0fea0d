"""InferTensor pickles as its raw buffer (front-ends <-> engine process) and comes back equal."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from service.dataplane.types import InferRequest, InferTensor, RequestedOutput


@pytest.mark.parametrize("data", [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::2],  # not contiguous
    np.array([3, 1], dtype=np.int64),
    np.array([True, False, True]),
    np.zeros((0, 5), dtype=np.float16),
    np.float32(2.5) * np.ones((), np.float32),
])
def test_tensor_round_trip(data):
    t = InferTensor("x", "FP32", list(data.shape), data, {"binary_data": True})
    back = pickle.loads(pickle.dumps(t, protocol=5))
    assert back.name == "x" and back.datatype == "FP32" and back.shape == list(data.shape)
    assert back.parameters == {"binary_data": True}
    assert back.data.dtype == data.dtype and back.data.shape == data.shape
    np.testing.assert_array_equal(back.data, data)


def test_request_round_trip_keeps_everything():
    x = np.random.default_rng(0).standard_normal((1, 7, 4)).astype(np.float32)
    req = InferRequest("m", "2", "id-1", [InferTensor("input", "FP32", [1, 7, 4], x)],
                       [RequestedOutput("output_last", {"binary_data": False})], {"sequence_id": 5})
    back = pickle.loads(pickle.dumps(req, protocol=5))
    assert back.model_name == "m" and back.model_version == "2" and back.id == "id-1"
    assert back.outputs[0].name == "output_last" and back.parameters == {"sequence_id": 5}
    np.testing.assert_array_equal(back.inputs[0].data, x)

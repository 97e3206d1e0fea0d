"""What crosses the socket between front-ends and the engine process pickles as raw buffers and comes back equal."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from service.dataplane.types import InferRequest, InferTensor, RequestedOutput
from service.dataplane.validation import StreamRequest
from service.dataplane.view import Prepared
from service.scheduler import SequenceWork
from service.wire import wire


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


@pytest.mark.parametrize("with_states", [False, True])
def test_prepared_work_round_trip(with_states):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    h0 = rng.standard_normal((2, 4, 6)).astype(np.float32)[:, ::2] if with_states else None  # not contiguous
    c0 = rng.standard_normal((2, 2, 6)).astype(np.float32) if with_states else None
    work = SequenceWork(x, np.array([5, 2]), h0, c0, frozenset({"output_last", "h_n"}))
    assert work.steps == 5  # a cached value does not travel in place of the arrays
    sent = Prepared(work, 123.5, StreamRequest("7", True, False) if with_states else None)
    back = pickle.loads(pickle.dumps(sent, protocol=5))
    assert back.deadline == 123.5 and back.stream == sent.stream
    got = back.work
    np.testing.assert_array_equal(got.x, x)
    np.testing.assert_array_equal(got.lengths, [5, 2])
    assert got.outputs == frozenset({"output_last", "h_n"}) and got.steps == 5 and got.sequences == 2
    if with_states:
        np.testing.assert_array_equal(got.h0, h0)
        np.testing.assert_array_equal(got.c0, c0)
    else:
        assert got.h0 is None and got.c0 is None
    assert got.pool is None and got.slot == -1 and not got.resume


def test_results_travel_as_plain_arrays():
    last = np.arange(30 * 8, dtype=np.float32).reshape(30, 8)
    back = pickle.loads(pickle.dumps({"output_last": wire(last[3:5]), "h_n": wire(last[:, ::2])}, protocol=5))
    assert type(back["output_last"]) is np.ndarray
    np.testing.assert_array_equal(back["output_last"], last[3:5])
    np.testing.assert_array_equal(back["h_n"], last[:, ::2])
    assert wire(None) is None


@pytest.mark.parametrize("cut", [1, 7, 1000, None])
def test_frames_split_anywhere_arrive_whole_and_in_order(cut):
    from service.dataplane.frames import FrameConnection, frame_parts

    rng = np.random.default_rng(0)
    sent = [(k, "submit", (wire(rng.standard_normal((k + 1, 3, 2)).astype(np.float32)),)) for k in range(6)]
    stream = b"".join(part for m in sent for part in frame_parts(m))
    got = []
    conn = FrameConnection(got.append)
    if cut is None:  # two reads: all but the last 5 bytes, then the rest
        pieces = [stream[:-5], stream[-5:]]
    else:
        pieces = [stream[i:i + cut] for i in range(0, len(stream), cut)]
    for piece in pieces:
        conn.data_received(piece)
    assert [m[0] for m in got] == list(range(6)) and not conn._buf
    for (_, _, (arr,)), (_, _, (wired,)) in zip(got, sent):
        np.testing.assert_array_equal(arr, wired.array)
        arr[...] = 0  # a decoded array is the receiver's own, writable memory

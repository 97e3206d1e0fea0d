"""Wire <-> protocol conversion of the gRPC transport, without a server."""
from __future__ import annotations

import numpy as np
import pytest

from service.dataplane.types import InferResponse, InferTensor
from service.errors import InvalidInput
from service.transports.grpc.codec import decode_parameters, decode_request, encode_parameters, encode_response
from service.transports.grpc.generated import inference_pb2 as pb


def test_response_is_little_endian_raw_whatever_the_array_byte_order():
    big = np.arange(6, dtype=">f4").reshape(2, 3)
    msg = encode_response(InferResponse("m", "1", "id", [InferTensor("output", "FP32", [2, 3], big)]))
    assert msg.raw_output_contents[0] == np.arange(6, dtype="<f4").tobytes()
    assert list(msg.outputs[0].shape) == [2, 3] and msg.outputs[0].datatype == "FP32"
    assert (msg.model_name, msg.model_version, msg.id) == ("m", "1", "id")


def test_response_parameters_keep_their_types():
    msg = pb.ModelInferResponse()
    params = {"flag": True, "n": -3, "big": 2**64 - 1, "x": 0.5, "s": "text", "np": np.int32(7)}
    encode_parameters(params, msg.parameters)
    assert msg.parameters["flag"].WhichOneof("parameter_choice") == "bool_param"
    assert msg.parameters["big"].WhichOneof("parameter_choice") == "uint64_param"
    assert decode_parameters(msg.parameters) == {**params, "np": 7}


def test_empty_tensor_needs_no_data():
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="input", datatype="FP32", shape=[0, 4, 3])
    decoded = decode_request(request)
    assert decoded.inputs[0].data.shape == (0, 4, 3)
    assert decoded.outputs is None


@pytest.mark.parametrize("raw", [False, True])
def test_a_shape_numpy_cannot_describe_is_refused_not_a_crash(raw):
    # a zero beside dimensions of 2**40: no data needed, but np.zeros and reshape raised ValueError (INTERNAL)
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="input", datatype="FP32", shape=[0, 2**40, 2**40])
    if raw:
        request.raw_input_contents.append(b"")
    with pytest.raises(InvalidInput, match=r"input 'input' has shape \[0, 1099511627776, 1099511627776\], whose "
                                            r"dimensions multiply to more than 2\*\*48"):
        decode_request(request)


def test_shared_memory_inputs_are_refused_by_name():
    request = pb.ModelInferRequest(model_name="m")
    t = request.inputs.add(name="input", datatype="FP32", shape=[1, 2, 3])
    t.parameters["shared_memory_region"].string_param = "in0"
    t.parameters["shared_memory_byte_size"].int64_param = 24
    with pytest.raises(InvalidInput, match=r"input 'input' uses the shared-memory extension \(shared_memory_region\), "
                                            r"which rnnserve does not support; send the data in the request"):
        decode_request(request)


def test_typed_int8_out_of_range_is_refused_not_wrapped():
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="lengths", datatype="INT8", shape=[2]).contents.int_contents.extend([5, -300])
    with pytest.raises(InvalidInput, match=r"input 'lengths' has a value in contents.int_contents out of range "
                                            r"for INT8 \(-128..127\)"):
        decode_request(request)


def test_raw_inputs_decode_in_input_order_with_parameters():
    a, b = np.ones((1, 2, 3), np.float32), np.array([2], np.int64)
    request = pb.ModelInferRequest(model_name="m", model_version="2", id="r",
                                   raw_input_contents=[a.tobytes(), b.tobytes()])
    request.inputs.add(name="input", datatype="FP32", shape=a.shape)
    request.inputs.add(name="lengths", datatype="INT64", shape=b.shape).parameters["note"].string_param = "x"
    request.outputs.add(name="h_n").parameters["binary_data"].bool_param = True
    decoded = decode_request(request)
    assert (decoded.model_name, decoded.model_version, decoded.id) == ("m", "2", "r")
    assert [t.name for t in decoded.inputs] == ["input", "lengths"]
    np.testing.assert_array_equal(decoded.inputs[1].data, b)
    assert decoded.inputs[1].parameters == {"note": "x"}
    assert [(o.name, o.parameters) for o in decoded.outputs] == [("h_n", {"binary_data": True})]


def test_answers_do_not_repeat_the_parameters_of_requested_outputs():
    # the dataplane hands the request's options for an output (binary_data, anything a client sends) to the
    # encoders on the answer's tensors; repeated over gRPC, they were unbounded text past the message limit
    x = np.ones((1, 2), np.float32)
    response = InferResponse("m", "1", "r", [InferTensor("output_last", "FP32", [1, 2], x, {"note": "y" * 1000})])
    msg = encode_response(response)
    assert [o.name for o in msg.outputs] == ["output_last"] and not msg.outputs[0].parameters


def test_a_message_of_millions_of_output_entries_is_refused_before_they_are_decoded():
    """3 MB of empty 'outputs' entries (16 KB gzip'd) held the event loop for seconds, a minute at 64 MB; with
    front-ends the heartbeat then ended the server."""
    import time


    msg = pb.ModelInferRequest.FromString(b"\x0a\x03abc" + b"\x32\x00" * 1_500_000)
    started = time.perf_counter()
    with pytest.raises(InvalidInput, match="lists 1,500,000 outputs"):
        decode_request(msg)
    assert time.perf_counter() - started < 0.05

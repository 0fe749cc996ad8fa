"""omni_serve.grpc_stream: the request built from public protos, over a channel of our own.

No tritonserver: an in-process grpc.aio server stands in for Triton's
GRPCInferenceService (ModelStreamInfer only) and records what it got.
"""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor

from omni_serve.grpc_stream import (
    ENABLE_EMPTY_FINAL,
    FINAL,
    SharedMemoryInput,
    StreamChannel,
    StreamError,
    build_request,
    channel_args,
    stream_request,
)

MIB = 1024 * 1024


def test_the_request_carries_inline_arrays_in_order_and_shared_memory_as_parameters():
    text = np.array([b"hi", "h\u00e9".encode()], dtype=np.object_)
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    shm = SharedMemoryInput("FP32", (4, 8), "omni_shm_r", 128, offset=64)
    request = build_request("llm", {"text_input": text, "embeds": shm, "ids": ids},
                            ["text_output", "finish_reason"], request_id="r-1",
                            parameters={"omni_abort": "r-0", "n": 3, "flag": True, "x": 0.5})

    assert (request.model_name, request.id) == ("llm", "r-1")
    by_name = {t.name: t for t in request.inputs}
    assert [t.name for t in request.inputs] == ["text_input", "embeds", "ids"]
    assert (by_name["text_input"].datatype, list(by_name["text_input"].shape)) == ("BYTES", [2])
    assert (by_name["ids"].datatype, list(by_name["ids"].shape)) == ("INT64", [2, 3])
    # only the inline tensors have raw contents, in input order (as Triton indexes them)
    assert len(request.raw_input_contents) == 2
    assert list(deserialize_bytes_tensor(request.raw_input_contents[0])) == list(text)
    assert request.raw_input_contents[1] == ids.tobytes()
    embeds = by_name["embeds"]
    assert (embeds.datatype, list(embeds.shape)) == ("FP32", [4, 8])
    assert embeds.parameters["shared_memory_region"].string_param == "omni_shm_r"
    assert embeds.parameters["shared_memory_byte_size"].int64_param == 128
    assert embeds.parameters["shared_memory_offset"].int64_param == 64
    assert [o.name for o in request.outputs] == ["text_output", "finish_reason"]
    params = request.parameters
    assert params["omni_abort"].string_param == "r-0" and params["n"].int64_param == 3
    assert params["flag"].bool_param and params["x"].double_param == 0.5
    assert params[ENABLE_EMPTY_FINAL].bool_param


def test_each_array_gets_the_datatype_tritonclient_gives_its_dtype():
    arrays = {"a": np.array([b"x" * 10], dtype=np.object_), "b": np.ones((2, 2), np.float32),
              "c": np.array([True]), "d": np.array([], dtype=np.object_),
              "e": np.zeros(3, np.uint32)}
    request = build_request("m", arrays, [])
    assert [t.datatype for t in request.inputs] == ["BYTES", "FP32", "BOOL", "BYTES", "UINT32"]
    for tensor, array in zip(request.inputs, arrays.values(), strict=True):
        # tritonclient's own InferInput accepts the array under that datatype
        grpcclient.InferInput(tensor.name, list(tensor.shape), tensor.datatype
                              ).set_data_from_numpy(array)
    assert request.raw_input_contents[2] == b"\x01" and request.raw_input_contents[3] == b""


@pytest.mark.parametrize("parameters, match", [
    ({"triton_enable_empty_final_response": False}, "reserved"),
    ({"priority": 1}, "reserved"),
    ({"x": [1]}, "unsupported type"),
])
def test_bad_parameters_are_refused_before_anything_is_sent(parameters, match):
    with pytest.raises(ValueError, match=match):
        build_request("m", {}, [], parameters=parameters)


def test_an_array_without_a_triton_datatype_is_refused():
    with pytest.raises(ValueError, match="no Triton datatype"):
        build_request("m", {"z": np.zeros(2, np.complex64)}, [])


def test_the_channel_takes_the_message_sizes_and_keepalive_of_tritonclient():
    args = dict(channel_args())
    assert args["grpc.max_send_message_length"] == grpcclient.MAX_GRPC_MESSAGE_SIZE
    assert args["grpc.max_receive_message_length"] == grpcclient.MAX_GRPC_MESSAGE_SIZE
    keepalive = grpcclient.KeepAliveOptions()
    assert args["grpc.keepalive_time_ms"] == keepalive.keepalive_time_ms
    assert args["grpc.keepalive_timeout_ms"] == keepalive.keepalive_timeout_ms


# --- over a real grpc.aio channel ----------------------------------------------------------

def _response(request: service_pb2.ModelInferRequest, final: bool, payload: bytes = b""):
    r = service_pb2.ModelStreamInferResponse()
    r.infer_response.model_name = request.model_name
    r.infer_response.id = request.id
    if payload:
        r.infer_response.outputs.add(name="blob", datatype="UINT8", shape=[len(payload)])
        r.infer_response.raw_output_contents.append(payload)
    r.infer_response.parameters[FINAL].bool_param = final
    return r


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """ModelStreamInfer by model name: "echo" answers twice (the second final), "big" once
    with a 6 MiB output, "bad" fails INVALID_ARGUMENT, "hang" answers once, then waits."""

    def __init__(self):
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.metadata: list[dict] = []
        self.cancelled = asyncio.Event()

    async def ModelStreamInfer(self, request_iterator, context):
        self.metadata.append(dict(context.invocation_metadata()))
        async for request in request_iterator:
            self.requests.append(request)
            if request.model_name == "bad":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
            if request.model_name == "big":
                yield _response(request, True, b"\x07" * (6 * MIB))
                continue
            yield _response(request, False, bytes(request.raw_input_contents[0]))
            if request.model_name == "hang":
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
            yield _response(request, True)


def _serve(scenario):
    async def main():
        servicer = FakeTriton()
        server = grpc.aio.server(options=channel_args())
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = StreamChannel(f"127.0.0.1:{port}")
        try:
            return await scenario(channel.stub, servicer)
        finally:
            await channel.close()
            await server.stop(None)

    return asyncio.run(main())


def test_responses_come_until_the_final_one_with_the_request_as_built():
    async def scenario(stub, triton):
        got = [r async for r in stream_request(
            stub, "echo", {"x": np.arange(3, dtype=np.int32)}, ["blob"], request_id="r-7",
            timeout_s=10, strict=True)]
        return got, triton

    got, triton = _serve(scenario)
    assert len(got) == 2 and isinstance(got[0], grpcclient.InferResult)
    assert got[0].as_numpy("blob").tobytes() == np.arange(3, dtype=np.int32).tobytes()
    assert got[1].get_response().parameters[FINAL].bool_param
    [request] = triton.requests
    assert request.id == "r-7" and request.parameters[ENABLE_EMPTY_FINAL].bool_param
    assert triton.metadata[0].get("triton_grpc_error") == "true"


def test_without_strict_no_header_is_sent():
    async def scenario(stub, triton):
        async for _ in stream_request(stub, "echo", {"x": np.zeros(1, np.int8)}, [],
                                      request_id="r", timeout_s=10):
            pass
        return triton.metadata

    assert "triton_grpc_error" not in _serve(scenario)[0]


def test_messages_larger_than_grpc_defaults_go_both_ways():
    big = np.full(6 * MIB, 3, dtype=np.uint8)  # gRPC's default limit is 4 MiB

    async def scenario(stub, triton):
        got = [r async for r in stream_request(stub, "big", {"x": big}, ["blob"],
                                               request_id="r", timeout_s=30)]
        return got, triton

    got, triton = _serve(scenario)
    assert got[0].as_numpy("blob").size == 6 * MIB
    assert triton.requests[0].raw_input_contents[0] == big.tobytes()


def test_a_failed_call_raises_its_grpc_code():
    async def scenario(stub, triton):
        with pytest.raises(StreamError) as e:
            async for _ in stream_request(stub, "bad", {}, [], request_id="r", timeout_s=10):
                pass
        return e.value

    error = _serve(scenario)
    assert (error.code, error.message) == ("INVALID_ARGUMENT", "bad request")


@pytest.mark.parametrize("how", ["close", "timeout"])
def test_leaving_early_cancels_the_call(how):
    async def scenario(stub, triton):
        stream = stream_request(stub, "hang", {"x": np.zeros(1, np.int8)}, [], request_id="r",
                                timeout_s=0.3 if how == "timeout" else 10)
        first = await stream.__anext__()
        assert not first.get_response().parameters[FINAL].bool_param
        if how == "close":
            await stream.aclose()
        else:
            with pytest.raises(TimeoutError):
                await stream.__anext__()
        async with asyncio.timeout(5):
            await triton.cancelled.wait()  # the server saw the cancel
        return True

    assert _serve(scenario)

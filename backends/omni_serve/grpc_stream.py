"""One request on one Triton gRPC bi-directional stream, for asyncio callers.

Runs in the caller's event loop: the omni orchestrator (in its Triton stub)
calls its stages with it, and AsyncOmniClient uses it too. It lives here,
beside the contract, so the backend never imports the client SDK.

The request is built from tritonclient's public protos (`service_pb2`) out
of numpy arrays by name (or `SharedMemoryInput`s, for tensors already placed
in a registered system shared-memory region), and `ModelStreamInfer` is
called through a `service_pb2_grpc.GRPCInferenceServiceStub` on a grpc.aio
channel of our own: a `StreamChannel`, one per server URL, created once by
its client and closed with it, with tritonclient's channel arguments
(messages up to MAX_GRPC_MESSAGE_SIZE: large image/audio tensors go
through it). Nothing here uses tritonclient's private API.

The request is written once and the stream stays open until the response
flagged `triton_final_response` arrives; leaving early (an error, a timeout,
the caller closing the generator or its task being cancelled) cancels the
gRPC call, which makes Triton cancel the request (a stage such as omni_llm
then aborts it). Timeouts are per response (asyncio.timeout); a failed call
raises StreamError with its gRPC code name; `strict` sends the strict-errors
header.

tritonclient's own `stream_infer` is not used because closing it does not
cancel the call at once, and its errors lose their gRPC code.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import (
    TRITON_RESERVED_REQUEST_PARAMS,
    TRITON_RESERVED_REQUEST_PARAMS_PREFIX,
    np_to_triton_dtype,
    serialize_byte_tensor,
)

from omni_serve.errors import STRICT_STREAM_ERRORS_HEADER, strict_stream_errors_safe

# Request parameter asking Triton to flag the last response, even an output-less one.
ENABLE_EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"
# Stream header: an error response closes the stream with its gRPC code (only sent
# where omni_serve.errors.strict_stream_errors_safe says the server survives it).
STRICT_ERRORS = ((STRICT_STREAM_ERRORS_HEADER, "true"),)


def channel_args() -> list[tuple[str, int]]:
    """The channel arguments tritonclient's aio InferenceServerClient sets by default:
    messages up to MAX_GRPC_MESSAGE_SIZE both ways, and its keepalive."""
    keepalive = grpcclient.KeepAliveOptions()
    return [("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data)]


class StreamChannel:
    """A grpc.aio channel to one Triton server and the service stub `stream_request` calls.

    One per server URL: create it in the event loop that uses it (beside its
    client's tritonclient InferenceServerClient) and close it with that client.
    `options` are grpc channel arguments (default: `channel_args()`).
    """

    def __init__(self, url: str, options: Sequence[tuple[str, int | str]] | None = None):
        self.url = url
        self._channel = grpc.aio.insecure_channel(
            url, options=channel_args() if options is None else list(options))
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        """Close the channel; calls still running on it fail (CANCELLED)."""
        await self._channel.close()


@dataclass(frozen=True)
class SharedMemoryInput:
    """An input tensor whose bytes are in a system shared-memory region registered with
    the server: `byte_size` bytes from `offset`, of Triton `datatype` and `shape`."""

    datatype: str
    shape: tuple[int, ...]
    region: str
    byte_size: int
    offset: int = 0


StreamInput = np.ndarray | SharedMemoryInput


async def strict_errors_safe(client: grpcaio.InferenceServerClient,
                             timeout_s: float = 5.0) -> bool | None:
    """Whether `client`'s server survives the strict-errors header (its version, asked);
    None when it cannot say now (ask again later)."""
    from tritonclient.utils import InferenceServerException

    try:
        async with asyncio.timeout(timeout_s):
            metadata = await client.get_server_metadata(as_json=True)
    except (InferenceServerException, TimeoutError):
        return None
    return strict_stream_errors_safe(metadata.get("version", ""))


class StreamError(Exception):
    """The stream failed: `code` is the gRPC status name ("INVALID_ARGUMENT", ...), or
    None for an in-band error message (no code was sent)."""

    def __init__(self, code: str | None, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def is_final(result: grpcclient.InferResult) -> bool:
    final = result.get_response().parameters.get(FINAL)
    return final is not None and final.bool_param


def _raw(array: np.ndarray, datatype: str) -> bytes:
    """The tensor's bytes as Triton reads them (tritonclient's InferInput encoding)."""
    if datatype == "BYTES":
        serialized = serialize_byte_tensor(array)
        return serialized.item() if serialized.size > 0 else b""
    return array.tobytes()


def build_request(model: str, inputs: Mapping[str, StreamInput], outputs: Sequence[str], *,
                  request_id: str = "",
                  parameters: Mapping[str, str | bool | int | float] | None = None,
                  ) -> service_pb2.ModelInferRequest:
    """The ModelInferRequest of one request; asks for the flagged final response.

    Each numpy array goes inline (`raw_input_contents`, in input order), its
    Triton datatype named after its numpy dtype; a SharedMemoryInput goes as
    its region's parameters.

    Raises:
        ValueError: an array's dtype has no Triton datatype, or a parameter is
            reserved by Triton or of an unsupported type.
    """
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, value in inputs.items():
        tensor = request.inputs.add(name=name)
        if isinstance(value, SharedMemoryInput):
            tensor.datatype = value.datatype
            tensor.shape.extend(value.shape)
            tensor.parameters["shared_memory_region"].string_param = value.region
            tensor.parameters["shared_memory_byte_size"].int64_param = value.byte_size
            if value.offset:
                tensor.parameters["shared_memory_offset"].int64_param = value.offset
            continue
        array = np.asarray(value)
        datatype = np_to_triton_dtype(array.dtype)
        if datatype is None:
            raise ValueError(f"input {name!r}: numpy dtype {array.dtype} has no Triton datatype")
        tensor.datatype = datatype
        tensor.shape.extend(array.shape)
        request.raw_input_contents.append(_raw(array, datatype))
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        if key in TRITON_RESERVED_REQUEST_PARAMS or key.startswith(
                TRITON_RESERVED_REQUEST_PARAMS_PREFIX):
            raise ValueError(f"request parameter {key!r} is reserved by Triton")
        param = request.parameters[key]
        if isinstance(value, str):
            param.string_param = value
        elif isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            raise ValueError(f"request parameter {key!r}: unsupported type "
                             f"{type(value).__name__}")
    request.parameters[ENABLE_EMPTY_FINAL].bool_param = True
    return request


async def stream_request(stub: service_pb2_grpc.GRPCInferenceServiceStub, model: str,
                         inputs: Mapping[str, StreamInput], outputs: Sequence[str], *,
                         request_id: str, timeout_s: float | None,
                         parameters: Mapping[str, str | bool | int | float] | None = None,
                         strict: bool = False,
                         ) -> AsyncIterator[grpcclient.InferResult]:
    """Yield the responses of one request until (and including) its final one.

    `stub` is a StreamChannel's; `inputs` are numpy arrays (or SharedMemoryInputs)
    by input name, `outputs` the names of the outputs to return.
    `parameters` are the request's own parameters (e.g. omni_llm's abort control).
    `strict` sends the strict-errors header: an error then carries its gRPC code;
    without it the error is in-band and StreamError.code is None.

    Raises:
        TimeoutError: no response within `timeout_s` (the call is cancelled).
        StreamError: the server or the transport failed the request.
        ValueError: the request cannot be built (see build_request); nothing is sent.
    """
    request = build_request(model, inputs, outputs, request_id=request_id,
                            parameters=parameters)
    done = asyncio.Event()

    async def requests():
        yield request
        await done.wait()  # the stream stays open until the request is complete

    call = stub.ModelStreamInfer(requests(), metadata=STRICT_ERRORS if strict else None)
    finished = False
    try:
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result
                # when the read completes as the task is cancelled, losing the cancel
                async with asyncio.timeout(timeout_s):
                    response = await call.read()
            except grpc.aio.AioRpcError as exc:
                finished = True
                raise StreamError(exc.code().name, exc.details() or str(exc)) from None
            if response is grpc.aio.EOF:
                finished = True
                return
            if response.error_message:
                finished = True
                raise StreamError(None, response.error_message)
            result = grpcclient.InferResult(response.infer_response)
            yield result
            if is_final(result):
                finished = True
                return
    finally:
        done.set()
        if not finished:
            call.cancel()

"""One request on one Triton gRPC bi-directional stream, for asyncio callers.

Runs in the caller's event loop: the omni orchestrator (in its Triton stub)
calls its stages with it, and AsyncOmniClient uses it too. It lives here,
beside the contract, so the backend never imports the client SDK. The request is written once and the
stream stays open until the response flagged `triton_final_response`
arrives; leaving early (an error, a timeout, the caller closing the
generator or its task being cancelled) cancels the gRPC call, which makes
Triton cancel the request (a stage such as omni_llm then aborts it).

tritonclient's own `stream_infer` is not used because closing it does not
cancel the call at once, and its errors lose their gRPC code.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc._utils import _get_inference_request

from omni_serve.errors import STRICT_STREAM_ERRORS_HEADER, strict_stream_errors_safe

# Request parameter asking Triton to flag the last response, even an output-less one.
ENABLE_EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"
# Stream header: an error response closes the stream with its gRPC code (only sent
# where omni_serve.errors.strict_stream_errors_safe says the server survives it).
STRICT_ERRORS = ((STRICT_STREAM_ERRORS_HEADER, "true"),)


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


async def stream_request(client: grpcaio.InferenceServerClient, model: str,
                         inputs: Sequence[grpcclient.InferInput],
                         outputs: Sequence[grpcclient.InferRequestedOutput], *, request_id: str,
                         timeout_s: float | None,
                         parameters: Mapping[str, str | bool | int] | None = None,
                         strict: bool = False,
                         ) -> AsyncIterator[grpcclient.InferResult]:
    """Yield the responses of one request until (and including) its final one.

    `parameters` are the request's own parameters (e.g. omni_llm's abort control).
    `strict` sends the strict-errors header: an error then carries its gRPC code;
    without it the error is in-band and StreamError.code is None.

    Raises:
        TimeoutError: no response within `timeout_s` (the call is cancelled).
        StreamError: the server or the transport failed the request.
    """
    request = _get_inference_request(
        model_name=model, inputs=list(inputs), model_version="", request_id=request_id,
        outputs=list(outputs), sequence_id=0, sequence_start=False, sequence_end=False,
        priority=0, timeout=None, parameters=dict(parameters) if parameters else None)
    request.parameters[ENABLE_EMPTY_FINAL].bool_param = True
    done = asyncio.Event()

    async def requests():
        yield request
        await done.wait()  # the stream stays open until the request is complete

    call = client._client_stub.ModelStreamInfer(requests(), metadata=STRICT_ERRORS if strict else None)
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

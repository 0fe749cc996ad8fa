"""omni_client without a server: error mapping, request tensors, stream handling.

A `FakeTritonClient` stands in for tritonclient's gRPC InferenceServerClient
(injected through `client_factory`); responses are real tritonclient
`InferResult`s built from protobuf, so parsing runs the library's own code.
"""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
)

from omni_client import (
    BadRequestError,
    CancelledError,
    Completion,
    OmniClient,
    OmniClientError,
    RequestTimeoutError,
    ServerError,
    TextDelta,
    UnavailableError,
    from_triton,
)
from omni_client._llm_io import FINAL_RESPONSE_PARAMETER
from omni_serve.contract import LLM, LLM_CONTRACT

# --- fakes -------------------------------------------------------------------------


def make_result(
    text: str | None = None,
    *,
    finish_reason: str | None = None,
    num_input_tokens: int | None = None,
    num_output_tokens: int | None = None,
    final: bool = False,
) -> grpcclient.InferResult:
    """One LLM-stage response as tritonclient would hand it to the stream callback."""
    response = service_pb2.ModelInferResponse(model_name="llm", id="r")
    values = {
        LLM.TEXT_OUTPUT: None if text is None else np.array([text.encode()], dtype=object),
        LLM.FINISH_REASON: (None if finish_reason is None
                            else np.array([finish_reason.encode()], dtype=object)),
        LLM.NUM_INPUT_TOKENS: (None if num_input_tokens is None
                               else np.array([num_input_tokens], dtype=np.uint32)),
        LLM.NUM_OUTPUT_TOKENS: (None if num_output_tokens is None
                                else np.array([num_output_tokens], dtype=np.uint32)),
    }
    for name, array in values.items():
        if array is None:
            continue
        spec = LLM_CONTRACT.output(name)
        response.outputs.add(name=name, datatype=spec.wire_dtype, shape=list(array.shape))
        raw = (serialize_byte_tensor(array).item() if spec.wire_dtype == "BYTES"
               else array.tobytes())
        response.raw_output_contents.append(raw)
    if final:
        response.parameters[FINAL_RESPONSE_PARAMETER].bool_param = True
    return grpcclient.InferResult(response)


Event = tuple[grpcclient.InferResult | None, InferenceServerException | None]


class FakeTritonClient:
    """Records what OmniClient does with a tritonclient gRPC client and replays scripted
    (result, error) pairs to the stream callback when a request is sent."""

    def __init__(self, events: list[Event] | None = None) -> None:
        self.events = list(events or [])
        self.callback: Callable[..., None] | None = None
        self.headers: dict | None = None
        self.requests: list[dict[str, Any]] = []
        self.stop_calls: list[bool] = []
        self.closed = False
        self.start_error: InferenceServerException | None = None
        self.send_error: InferenceServerException | None = None
        self.live = True
        self.ready = True
        self.live_error: InferenceServerException | None = None
        self.version = "2.53.0"
        self.metadata_calls = 0

    def start_stream(self, callback, stream_timeout=None, headers=None,
                     compression_algorithm=None) -> None:
        if self.start_error is not None:
            raise self.start_error
        self.callback = callback
        self.headers = headers

    def async_stream_infer(self, model_name, inputs, **kwargs) -> None:
        assert self.callback is not None, "async_stream_infer before start_stream"
        self.requests.append({"model_name": model_name, "inputs": inputs, **kwargs})
        for result, error in self.events:
            self.callback(result=result, error=error)
        if self.send_error is not None:
            raise self.send_error

    def stop_stream(self, cancel_requests=False) -> None:
        self.stop_calls.append(cancel_requests)
        self.callback = None

    def close(self) -> None:
        self.closed = True

    def get_server_metadata(self, headers=None, as_json=False, client_timeout=None) -> dict:
        self.metadata_calls += 1
        return {"name": "triton", "version": self.version, "extensions": []}

    def is_server_live(self, headers=None, client_timeout=None) -> bool:
        if self.live_error is not None:
            raise self.live_error
        return self.live

    def is_model_ready(self, model_name, model_version="", headers=None,
                       client_timeout=None) -> bool:
        return self.ready


class FakeFactory:
    """client_factory that hands out the given fakes in order."""

    def __init__(self, *fakes: FakeTritonClient) -> None:
        self.fakes = list(fakes)
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, url: str, verbose: bool) -> FakeTritonClient:
        self.calls.append((url, verbose))
        return self.fakes.pop(0)


def omni_client(*fakes: FakeTritonClient, **kwargs: Any) -> tuple[OmniClient, FakeFactory]:
    """An OmniClient over fakes; a short default timeout so a broken stream fails fast."""
    factory = FakeFactory(*fakes)
    kwargs.setdefault("timeout", 2.0)
    return OmniClient("triton:8001", client_factory=factory, **kwargs), factory


def sent_values(request: dict[str, Any]) -> dict[str, Any]:
    """Decode the input tensors of a recorded request into {name: python value}."""
    values = {}
    for tensor in request["inputs"]:
        raw = tensor._get_content()
        if tensor.datatype() == "BYTES":
            values[tensor.name()] = deserialize_bytes_tensor(raw)[0].decode()
        else:
            values[tensor.name()] = np.frombuffer(raw, dtype=np.bool_)[0].item()
    return values


STREAMED = [
    (make_result("Hel", finish_reason="None", num_input_tokens=3, num_output_tokens=1), None),
    (make_result("lo", num_input_tokens=3, num_output_tokens=1), None),
    (make_result("!", finish_reason="stop", num_input_tokens=3, num_output_tokens=1), None),
    (make_result(final=True), None),
]


# --- error mapping -----------------------------------------------------------------


@pytest.mark.parametrize(("code", "expected"), [
    (grpc.StatusCode.INVALID_ARGUMENT, BadRequestError),
    (grpc.StatusCode.UNAVAILABLE, UnavailableError),
    (grpc.StatusCode.NOT_FOUND, UnavailableError),
    (grpc.StatusCode.CANCELLED, CancelledError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, RequestTimeoutError),
    (grpc.StatusCode.INTERNAL, ServerError),
    (grpc.StatusCode.UNKNOWN, ServerError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ServerError),
])
def test_grpc_status_strings_map_to_their_error_class(code, expected):
    exc = InferenceServerException(msg="boom", status=str(code))

    mapped = from_triton(exc)

    assert type(mapped) is expected
    assert mapped.message == "boom"
    assert mapped.status == str(code)


def test_triton_core_code_names_are_understood_too():
    assert type(from_triton(InferenceServerException("x", status="INVALID_ARG"))) is BadRequestError


@pytest.mark.parametrize(("message", "expected"), [
    ("[StatusCode.INVALID_ARGUMENT] max_tokens must be positive", BadRequestError),
    ("[INVALID_ARG] bad json in sampling_parameters", BadRequestError),
    ("[UNAVAILABLE] stage llm is restarting", UnavailableError),
    (("[request id: 7] unexpected shape for input 'text_input' for model 'llm'. "
     "Expected [1], got [2]"), BadRequestError),
    (("[request id: <id_unknown>] expected number of inputs between 1 and 7 but got 0 inputs "
     "for model 'llm'"), BadRequestError),
    ("Request for unknown model: 'nope' is not found", BadRequestError),
    ("Request for unknown model: 'llm' has no available versions", UnavailableError),
    ("Request was cancelled", CancelledError),
    ("Deadline Exceeded", RequestTimeoutError),
    ("max_tokens must be at least 1, got 0", ServerError),
    ("AsyncLLM engine is dead", ServerError),
])
def test_status_less_stream_errors_are_mapped_from_their_message(message, expected):
    mapped = from_triton(InferenceServerException(msg=message))

    assert type(mapped) is expected
    assert mapped.status is None
    assert mapped.message == message


def test_every_grpc_status_maps_to_an_omni_client_error():
    for code in grpc.StatusCode:
        assert isinstance(from_triton(InferenceServerException("x", status=str(code))),
                          OmniClientError)


def test_the_timeout_error_is_also_a_builtin_timeout_error():
    assert issubclass(RequestTimeoutError, TimeoutError)
    assert issubclass(RequestTimeoutError, OmniClientError)


def test_a_mapped_error_prints_status_and_message():
    mapped = from_triton(InferenceServerException("no", status="StatusCode.UNAVAILABLE"))
    assert str(mapped) == "[StatusCode.UNAVAILABLE] no"
    assert str(from_triton(InferenceServerException("no"))) == "no"


# --- request tensors ---------------------------------------------------------------


def test_the_request_carries_every_contract_input_with_its_dtype_and_shape():
    fake = FakeTritonClient(STREAMED)
    client, _ = omni_client(fake)

    list(client.generate_stream("hi"))

    inputs = fake.requests[0]["inputs"]
    omni_extras = {LLM.PROMPT_TOKEN_IDS, LLM.IMAGE_EMBEDS, LLM.IMAGE_GRID_THW, LLM.AUDIO_FEATURES,
                   LLM.AUDIO_FEATURE_LENGTHS, LLM.RETURN_TOKEN_IDS,
                   LLM.RETURN_HIDDEN_STATES, LLM.HIDDEN_STATES_IN_SHM, LLM.RETURN_INPUT_TOKEN_IDS,
                   LLM.MESSAGES,  # a chat instead of text_input (stream(history=...))
                   # vllm_backend's, which omni_client does not ask for
                   LLM.RETURN_CUMULATIVE_LOGPROB, LLM.RETURN_LOGPROBS, LLM.IMAGE,
                   LLM.EMBEDDING_REQUEST, LLM.AUDIO, LLM.VIDEO, LLM.USE_AUDIO_IN_VIDEO}
    assert sorted(t.name() for t in inputs) == sorted(
        s.name for s in LLM_CONTRACT.inputs if s.name not in omni_extras)
    for tensor in inputs:
        spec = LLM_CONTRACT.input(tensor.name())
        assert tensor.datatype() == spec.wire_dtype
        assert tensor.shape() == [1]


def test_the_request_asks_for_deltas_without_the_prompt_and_with_counts():
    fake = FakeTritonClient(STREAMED)
    client, _ = omni_client(fake)

    list(client.generate_stream("héllo wörld"))

    values = sent_values(fake.requests[0])
    assert values[LLM.TEXT_INPUT] == "héllo wörld"
    assert values[LLM.STREAM] is True
    assert values[LLM.EXCLUDE_INPUT_IN_OUTPUT] is True
    assert values[LLM.RETURN_FINISH_REASON] is True
    assert values[LLM.RETURN_NUM_INPUT_TOKENS] is True
    assert values[LLM.RETURN_NUM_OUTPUT_TOKENS] is True


def test_generate_turns_the_stream_flag_off():
    fake = FakeTritonClient([(make_result("ok", finish_reason="stop", final=True), None)])
    client, _ = omni_client(fake)

    client.generate("hi")

    assert sent_values(fake.requests[0])[LLM.STREAM] is False


def test_sampling_parameters_are_merged_with_the_keyword_shortcuts_which_win():
    fake = FakeTritonClient(STREAMED)
    client, _ = omni_client(fake)

    list(client.generate_stream(
        "hi", sampling_parameters={"max_tokens": 5, "top_p": 0.9, "temperature": 1.0},
        max_tokens=7))

    sent = json.loads(sent_values(fake.requests[0])[LLM.SAMPLING_PARAMETERS])
    assert sent == {"max_tokens": 7, "top_p": 0.9, "temperature": 1.0}


def test_a_shortcut_left_as_none_does_not_override():
    fake = FakeTritonClient(STREAMED)
    client, _ = omni_client(fake)

    list(client.generate_stream("hi", sampling_parameters={"temperature": 0.0},
                                temperature=None, max_tokens=3))

    sent = json.loads(sent_values(fake.requests[0])[LLM.SAMPLING_PARAMETERS])
    assert sent == {"temperature": 0.0, "max_tokens": 3}


def test_the_request_names_the_model_asks_for_the_final_flag_and_the_contract_outputs():
    fake = FakeTritonClient(STREAMED)
    client, _ = omni_client(fake, model="text_chat_llm")

    list(client.generate_stream("hi", request_id="req-1"))

    request = fake.requests[0]
    assert request["model_name"] == "text_chat_llm"
    assert request["request_id"] == "req-1"
    assert request["enable_empty_final_response"] is True
    contract_outputs = {s.name for s in LLM_CONTRACT.outputs}
    assert {o.name() for o in request["outputs"]} <= contract_outputs
    assert LLM.TEXT_OUTPUT in {o.name() for o in request["outputs"]}


@pytest.mark.parametrize("sampling_parameters", [{"stop": {"a", "b"}}, {"temperature": float("nan")},
                                                 ["max_tokens", 3]])
def test_unencodable_sampling_parameters_are_a_bad_request_raised_by_the_call(
        sampling_parameters):
    client, factory = omni_client()

    with pytest.raises(BadRequestError):
        client.generate_stream("hi", sampling_parameters=sampling_parameters)
    assert factory.calls == []


def test_a_non_string_prompt_is_a_bad_request():
    client, _ = omni_client()

    with pytest.raises(BadRequestError, match="prompt"):
        client.generate(b"bytes")


# --- responses ---------------------------------------------------------------------


def test_generate_stream_yields_a_delta_per_response_and_stops_at_the_final_one():
    fake = FakeTritonClient(STREAMED + [(make_result("never read"), None)])
    client, _ = omni_client(fake)

    deltas = list(client.generate_stream("hi"))

    assert deltas == [
        TextDelta("Hel", None, 3, 1),
        TextDelta("lo", None, 3, 1),
        TextDelta("!", "stop", 3, 1),
    ]


def test_a_final_response_that_carries_text_is_yielded_then_ends_the_stream():
    fake = FakeTritonClient([(make_result("a"), None),
                             (make_result("b", finish_reason="length", final=True), None)])
    client, _ = omni_client(fake)

    assert [d.text for d in client.generate_stream("hi")] == ["a", "b"]


def test_generate_returns_one_completion():
    fake = FakeTritonClient([
        (make_result("Paris.", finish_reason="stop", num_input_tokens=6, num_output_tokens=2),
         None),
        (make_result(final=True), None),
    ])
    client, _ = omni_client(fake)

    assert client.generate("Capital of France?") == Completion("Paris.", "stop", 6, 2)


def test_a_cleanly_finished_stream_is_stopped_gracefully_and_its_client_reused():
    fake = FakeTritonClient(STREAMED)
    client, factory = omni_client(fake)

    list(client.generate_stream("one"))
    list(client.generate_stream("two"))

    assert len(factory.calls) == 1
    assert fake.stop_calls == [False, False]
    assert not fake.closed
    client.close()
    assert fake.closed


# --- timeouts, errors and cancellation ---------------------------------------------


def test_a_silent_server_raises_request_timeout_and_cancels_the_stream():
    fake = FakeTritonClient([(make_result("partial"), None)])
    client, factory = omni_client(fake, FakeTritonClient(STREAMED), timeout=0.05)

    stream = client.generate_stream("hi")
    assert next(stream).text == "partial"
    started = time.monotonic()
    with pytest.raises(RequestTimeoutError):
        next(stream)

    assert time.monotonic() - started < 5
    assert fake.stop_calls == [True]
    assert fake.closed
    list(client.generate_stream("again"))
    assert len(factory.calls) == 2


def test_generate_times_out_with_the_per_call_timeout():
    fake = FakeTritonClient([])
    client, _ = omni_client(fake, timeout=None)

    with pytest.raises(TimeoutError):
        client.generate("hi", timeout=0.05)
    assert fake.stop_calls == [True]


def test_breaking_out_of_the_loop_cancels_the_request():
    fake = FakeTritonClient(STREAMED)
    client, _ = omni_client(fake)

    for _delta in client.generate_stream("hi"):
        break

    assert fake.stop_calls == [True]
    assert fake.closed


def test_an_error_response_raises_the_mapped_error_chained_and_cancels():
    server_error = InferenceServerException(
        msg="[request id: r] unexpected inference input 'foo' for model 'llm'")
    fake = FakeTritonClient([(make_result("a"), None), (None, server_error)])
    client, _ = omni_client(fake)

    with pytest.raises(BadRequestError) as caught:
        list(client.generate_stream("hi"))

    assert caught.value.__cause__ is server_error
    assert fake.stop_calls == [True]


def test_a_broken_stream_raises_unavailable():
    fake = FakeTritonClient([(None, InferenceServerException(
        msg="failed to connect to all addresses", status="StatusCode.UNAVAILABLE"))])
    client, _ = omni_client(fake)

    with pytest.raises(UnavailableError):
        client.generate("hi")


def test_a_stream_that_cannot_start_raises_the_mapped_error():
    fake = FakeTritonClient()
    fake.start_error = InferenceServerException("no route", status="StatusCode.UNAVAILABLE")
    client, _ = omni_client(fake)

    with pytest.raises(UnavailableError):
        client.generate("hi")
    assert fake.stop_calls == [True]


def test_a_stream_that_broke_before_the_request_was_queued_raises_the_callbacks_error():
    # tritonclient refuses the request with a generic message once its
    # handler thread has seen the stream fail; the real error is in the callback.
    fake = FakeTritonClient([(None, InferenceServerException(
        msg="failed to connect to all addresses", status="StatusCode.UNAVAILABLE"))])
    fake.send_error = InferenceServerException(
        "The stream is no longer in valid state, the error detail is reported through "
        "provided callback.")
    client, _ = omni_client(fake)

    with pytest.raises(UnavailableError, match="failed to connect"):
        client.generate("hi")


def test_strict_stream_errors_sends_the_triton_grpc_error_header():
    plain, strict = FakeTritonClient(STREAMED), FakeTritonClient(STREAMED)
    list(omni_client(plain, strict_stream_errors=False)[0].generate_stream("hi"))
    list(omni_client(strict, strict_stream_errors=True)[0].generate_stream("hi"))

    assert plain.headers is None
    assert strict.headers == {"triton_grpc_error": "true"}


@pytest.mark.parametrize("version,header", [
    ("2.51.0", None), ("2.52.1", None), ("2.53.0", {"triton_grpc_error": "true"}),
    ("2.68.0", {"triton_grpc_error": "true"}), ("", None),
])
def test_by_default_the_header_goes_only_to_a_triton_that_survives_it(version, header):
    fake = FakeTritonClient(STREAMED)
    fake.version = version
    client, _ = omni_client(fake)
    list(client.generate_stream("hi"))
    list(client.generate_stream("again"))

    assert fake.headers == header
    assert fake.metadata_calls == 1  # asked once per client


def test_an_in_band_stream_error_keeps_its_code_from_the_message():
    fake = FakeTritonClient([(None, InferenceServerException(
        msg="stage 'thinker' (model llm) failed: sampling_parameters.max_tokenz: unknown"))])
    fake.version = "2.51.0"
    client, _ = omni_client(fake)
    with pytest.raises(BadRequestError, match="max_tokenz"):
        client.generate("hi")


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_a_non_positive_timeout_is_rejected(timeout):
    with pytest.raises(ValueError, match="timeout"):
        OmniClient(timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        omni_client()[0].generate_stream("hi", timeout=timeout)


def test_a_closed_client_refuses_calls():
    client, _ = omni_client(FakeTritonClient(STREAMED))
    with client:
        pass

    with pytest.raises(OmniClientError, match="closed"):
        client.generate("hi")


# --- readiness ---------------------------------------------------------------------


def test_is_ready_needs_a_live_server_and_a_ready_model():
    live_and_ready = FakeTritonClient()
    not_ready = FakeTritonClient()
    not_ready.ready = False
    unreachable = FakeTritonClient()
    unreachable.live_error = InferenceServerException("refused", status="StatusCode.UNAVAILABLE")

    assert omni_client(live_and_ready)[0].is_ready() is True
    assert omni_client(not_ready)[0].is_ready() is False
    assert omni_client(unreachable)[0].is_ready() is False


# --- the real tritonclient, nothing listening ----------------------------------------


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_tritonclient_without_a_server_gives_unavailable():
    with OmniClient(f"127.0.0.1:{_unused_port()}", timeout=10) as client:
        assert client.is_ready(timeout=2) is False
        with pytest.raises(UnavailableError):
            list(client.generate_stream("hi"))

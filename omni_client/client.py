"""OmniClient: the synchronous SDK for an omni pipeline served by Triton.

Runs in the caller's process. The LLM stage is a decoupled model, so every
generation goes over Triton's gRPC bi-directional stream: a call takes a
tritonclient `InferenceServerClient` of its own (tritonclient allows one
stream per client object), starts a stream whose callback puts
`(result, error)` pairs on a queue, sends one request and reads the queue
until the response flagged `triton_final_response`. Leaving early (timeout,
error, the caller breaking out of the loop) cancels the gRPC stream, which
makes the server abort the generation. Clients whose stream ended cleanly
are kept for reuse (their channel stays connected); others are closed.
"""
from __future__ import annotations

import enum
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Self

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from omni_client import _llm_io
from omni_client.errors import OmniClientError, RequestTimeoutError, from_triton
from omni_client.types import Completion, TextDelta

logger = logging.getLogger(__name__)

ClientFactory = Callable[[str, bool], grpcclient.InferenceServerClient]
"""Makes a tritonclient gRPC client from (url, verbose)."""

# Stream header that makes Triton (>= 24.09) close the stream with the real
# gRPC status code on an error response, instead of a status-less message.
_STRICT_ERRORS_HEADERS = {"triton_grpc_error": "true"}
_MAX_IDLE_CLIENTS = 4


class _Default(enum.Enum):
    CLIENT_TIMEOUT = "the client's timeout"


_CLIENT_TIMEOUT = _Default.CLIENT_TIMEOUT
Timeout = float | None | _Default


def _default_client_factory(url: str, verbose: bool) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(url=url, verbose=verbose)


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return timeout


class OmniClient:
    """Synchronous client of an omni LLM (or orchestrator) model on Triton over gRPC.

    Use as a context manager, or call `close()`::

        with OmniClient("localhost:8001") as client:
            for delta in client.generate_stream("Hello", max_tokens=32):
                print(delta.text, end="")

    Safe to share between threads: every call uses its own gRPC stream.

    Args:
        url: Triton gRPC endpoint, "host:port".
        timeout: default seconds to wait for each response (None: forever);
            calls may override it.
        model: name of the model in the repository.
        verbose: let tritonclient print its requests and responses.
        strict_stream_errors: send the `triton_grpc_error` stream header so
            error responses carry their gRPC code (e.g. INVALID_ARGUMENT)
            instead of a status-less message. On by default: every omni
            stage sends an error response together with its FINAL flag
            (omni_serve.tritonio.ResponseSender). Turn it off for other
            decoupled models: Triton before 2.68 (server PR #8708) segfaults
            in this mode when a model sends the error and the FINAL flag in
            two sends (seen with 2.51).
        client_factory: makes tritonclient gRPC clients from (url, verbose);
            tests inject fakes here.

    Raises:
        ValueError: `timeout` is not positive.
    """

    def __init__(
        self,
        url: str = "localhost:8001",
        *,
        timeout: float | None = 60.0,
        model: str = "llm",
        verbose: bool = False,
        strict_stream_errors: bool = True,
        client_factory: ClientFactory | None = None,
    ) -> None:
        self.url = url
        self.model = model
        self.timeout = _check_timeout(timeout)
        self._verbose = verbose
        self._stream_headers = _STRICT_ERRORS_HEADERS if strict_stream_errors else None
        self._client_factory = client_factory or _default_client_factory
        self._lock = threading.Lock()
        self._idle: list[grpcclient.InferenceServerClient] = []
        self._control: grpcclient.InferenceServerClient | None = None
        self._closed = False

    # --- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close idle connections; calls still running close theirs when they end."""
        with self._lock:
            self._closed = True
            clients, self._idle = self._idle, []
            if self._control is not None:
                clients.append(self._control)
                self._control = None
        for client in clients:
            _close_quietly(client)

    # --- public calls ----------------------------------------------------------------

    def is_ready(self, *, timeout: Timeout = _CLIENT_TIMEOUT) -> bool:
        """Whether the server is live and the model is ready.

        Returns False (and logs why at DEBUG) when the server cannot be
        reached or answers with an error.

        Raises:
            OmniClientError: the client is closed.
            ValueError: `timeout` is not positive.
        """
        wait_s = self._resolve_timeout(timeout)
        client = self._control_client()
        try:
            return bool(client.is_server_live(client_timeout=wait_s)) and bool(
                client.is_model_ready(self.model, client_timeout=wait_s))
        except InferenceServerException as exc:
            logger.debug("model=%s not ready: %s", self.model, exc)
            return False

    def generate_stream(
        self,
        prompt: str,
        *,
        sampling_parameters: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: Timeout = _CLIENT_TIMEOUT,
        request_id: str | None = None,
    ) -> Iterator[TextDelta]:
        """Generate text for `prompt`, yielding a TextDelta per streamed response.

        The request is sent when iteration starts. Breaking out of the loop
        (or closing the iterator) cancels the request on the server.

        Args:
            prompt: the prompt text.
            sampling_parameters: vLLM SamplingParams fields, sent as JSON.
            max_tokens, temperature: shortcuts that override the same keys
                of `sampling_parameters`.
            timeout: seconds to wait for each response; None waits forever;
                default: the client's timeout.
            request_id: Triton request id (default: a random one), also used
                in this client's log lines.

        Raises:
            BadRequestError: the arguments or the server reject the request
                (raised by this call for bad arguments, else while iterating).
            ValueError: `timeout` is not positive.
            While iterating:
            RequestTimeoutError: no response within `timeout`; the request is cancelled.
            UnavailableError: the server is unreachable or the model is not ready.
            CancelledError: the server cancelled the request.
            ServerError: any other server or transport failure.
            OmniClientError: the client is closed.
        """
        inputs = self._build_inputs(prompt, True, sampling_parameters, max_tokens, temperature)
        return self._responses(inputs, self._resolve_timeout(timeout), request_id)

    def generate(
        self,
        prompt: str,
        *,
        sampling_parameters: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: Timeout = _CLIENT_TIMEOUT,
        request_id: str | None = None,
    ) -> Completion:
        """Generate text for `prompt` in one response (the stream flag off).

        Arguments as for `generate_stream`; `timeout` bounds the wait for
        the (single) response.

        Raises:
            BadRequestError: the arguments or the server reject the request.
            ValueError: `timeout` is not positive.
            RequestTimeoutError: no response within `timeout`; the request is cancelled.
            UnavailableError: the server is unreachable or the model is not ready.
            CancelledError: the server cancelled the request.
            ServerError: any other server or transport failure.
            OmniClientError: the client is closed.
        """
        inputs = self._build_inputs(prompt, False, sampling_parameters, max_tokens, temperature)
        deltas = list(self._responses(inputs, self._resolve_timeout(timeout), request_id))
        return Completion(
            text="".join(d.text for d in deltas),
            finish_reason=_last(d.finish_reason for d in deltas),
            num_input_tokens=_last(d.num_input_tokens for d in deltas),
            num_output_tokens=_last(d.num_output_tokens for d in deltas),
        )

    # --- one request on one stream ---------------------------------------------------

    def _responses(
        self, inputs: list[grpcclient.InferInput], wait_s: float | None, request_id: str | None
    ) -> Iterator[TextDelta]:
        request_id = request_id or uuid.uuid4().hex
        responses: queue.Queue[tuple[Any, InferenceServerException | None]] = queue.Queue()
        client = self._acquire()
        finished = False
        try:
            self._send(client, inputs, request_id, responses)
            while True:
                result = self._next_result(responses, wait_s, request_id)
                delta = _llm_io.parse_response(result)
                if delta is not None:
                    yield delta
                if _llm_io.is_final(result):
                    break
            finished = True
        finally:
            if not finished:
                logger.debug("model=%s request_id=%s cancelling", self.model, request_id)
            self._release(client, cancel=not finished)

    def _send(
        self,
        client: grpcclient.InferenceServerClient,
        inputs: list[grpcclient.InferInput],
        request_id: str,
        responses: queue.Queue,
    ) -> None:
        def on_response(result: Any, error: InferenceServerException | None) -> None:
            responses.put((result, error))

        logger.debug("model=%s request_id=%s sending", self.model, request_id)
        try:
            client.start_stream(callback=on_response, headers=self._stream_headers)
            client.async_stream_infer(
                self.model, inputs, outputs=_llm_io.requested_outputs(),
                request_id=request_id, enable_empty_final_response=True)
        except InferenceServerException as exc:
            # A stream that broke before the request was queued (e.g. nothing
            # listening) makes tritonclient refuse the request with a generic
            # message; the real error is already on the queue.
            cause = _queued_error(responses) or exc
            raise from_triton(cause) from cause

    def _next_result(
        self, responses: queue.Queue, wait_s: float | None, request_id: str
    ) -> grpcclient.InferResult:
        try:
            result, error = responses.get(timeout=wait_s)
        except queue.Empty:
            raise RequestTimeoutError(
                f"no response from model {self.model!r} within {wait_s}s "
                f"(request id {request_id})") from None
        if error is not None:
            mapped = from_triton(error)
            logger.debug("model=%s request_id=%s failed: %r", self.model, request_id, mapped)
            raise mapped from error
        return result

    # --- tritonclient clients --------------------------------------------------------

    def _new_client(self) -> grpcclient.InferenceServerClient:
        try:
            return self._client_factory(self.url, self._verbose)
        except InferenceServerException as exc:
            raise from_triton(exc) from exc

    def _acquire(self) -> grpcclient.InferenceServerClient:
        with self._lock:
            self._raise_if_closed()
            if self._idle:
                return self._idle.pop()
        return self._new_client()

    def _release(self, client: grpcclient.InferenceServerClient, *, cancel: bool) -> None:
        try:
            client.stop_stream(cancel_requests=cancel)
        except Exception:  # a failed stop must not mask the call's outcome
            logger.debug("model=%s stop_stream failed", self.model, exc_info=True)
            cancel = True
        with self._lock:
            if not cancel and not self._closed and len(self._idle) < _MAX_IDLE_CLIENTS:
                self._idle.append(client)
                return
        _close_quietly(client)

    def _control_client(self) -> grpcclient.InferenceServerClient:
        with self._lock:
            self._raise_if_closed()
            if self._control is None:
                self._control = self._new_client()
            return self._control

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise OmniClientError("OmniClient is closed")

    # --- helpers ---------------------------------------------------------------------

    def _resolve_timeout(self, timeout: Timeout) -> float | None:
        if timeout is _CLIENT_TIMEOUT:
            return self.timeout
        return _check_timeout(timeout)

    def _build_inputs(
        self,
        prompt: str,
        stream: bool,
        sampling_parameters: Mapping[str, Any] | None,
        max_tokens: int | None,
        temperature: float | None,
    ) -> list[grpcclient.InferInput]:
        merged = _llm_io.merge_sampling_parameters(
            sampling_parameters, max_tokens=max_tokens, temperature=temperature)
        return _llm_io.build_inputs(prompt, stream=stream, sampling_parameters=merged)


def _queued_error(responses: queue.Queue) -> InferenceServerException | None:
    try:
        _result, error = responses.get_nowait()
    except queue.Empty:
        return None
    return error


def _last(values: Iterator[Any]) -> Any:
    found = None
    for value in values:
        if value is not None:
            found = value
    return found


def _close_quietly(client: grpcclient.InferenceServerClient) -> None:
    try:
        client.close()
    except Exception:  # closing is best effort
        logger.debug("closing a tritonclient failed", exc_info=True)

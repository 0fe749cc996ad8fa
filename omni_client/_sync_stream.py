"""The synchronous client's transport: a pool of tritonclient gRPC clients, one stream each.

Runs in the caller's process, on the caller's thread plus tritonclient's stream
thread. A streamed request takes a tritonclient `InferenceServerClient` of its
own (tritonclient allows one stream per client object), starts a stream whose
callback puts `(result, error)` pairs on a queue, sends one request and reads
the queue until the response flagged `triton_final_response`. Leaving early
(timeout, error, the caller breaking out of the loop) cancels the gRPC stream,
which makes the server abort the generation. Clients whose stream ended
cleanly are kept for reuse (their channel stays connected); others are closed.
"""
from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from omni_client import _llm_io
from omni_client._calls import Prepared
from omni_client.errors import OmniClientError, RequestTimeoutError, from_triton
from omni_serve.errors import STRICT_STREAM_ERRORS_HEADER, strict_stream_errors_safe

logger = logging.getLogger("omni_client")

ClientFactory = Callable[[str, bool], grpcclient.InferenceServerClient]
"""Makes a tritonclient gRPC client from (url, verbose)."""

# Stream header that makes Triton close the stream with the real gRPC status code
# on an error response, instead of a status-less message.
_STRICT_ERRORS_HEADERS = {STRICT_STREAM_ERRORS_HEADER: "true"}
_MAX_IDLE_CLIENTS = 4


def default_client_factory(url: str, verbose: bool) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(url=url, verbose=verbose)


class StreamPool:
    """tritonclient clients for one server: one shared for unary calls, pooled ones for streams.

    `strict` is OmniClient's strict_stream_errors (None: asked of the server once).
    `timed_out(model, wait_s, request_id)` makes the error of a response that never came.
    """

    def __init__(self, url: str, verbose: bool, factory: ClientFactory, strict: bool | None,
                 timed_out: Callable[[str, float | None, str], RequestTimeoutError]) -> None:
        self.url = url
        self._verbose = verbose
        self._factory = factory
        self._strict = strict
        self._timed_out = timed_out
        self._lock = threading.Lock()
        self._idle: list[grpcclient.InferenceServerClient] = []
        self._control: grpcclient.InferenceServerClient | None = None
        self._closed = False

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

    def control(self) -> grpcclient.InferenceServerClient:
        """The client for unary calls (readiness, configs, DiT requests)."""
        with self._lock:
            self._raise_if_closed()
            if self._control is None:
                self._control = self._new_client()
            return self._control

    # --- one request on one stream ---------------------------------------------------

    def results(self, prepared: Prepared, wait_s: float | None, request_id: str | None,
                *, parse: bool = False) -> Iterator[Any]:
        """The responses of one streamed request until its final one (parsed, with `parse`)."""
        request_id = request_id or uuid.uuid4().hex
        responses: queue.Queue[tuple[Any, InferenceServerException | None]] = queue.Queue()
        client = self._acquire()
        finished = False
        try:
            self._send(client, prepared, request_id, responses)
            while True:
                result = self._next_result(responses, wait_s, request_id, prepared.model)
                if parse:
                    yield from prepared.parse(result)
                else:
                    yield result
                if _llm_io.is_final(result):
                    break
            finished = True
        finally:
            if not finished:
                logger.debug("model=%s request_id=%s cancelling", prepared.model, request_id)
            self._release(client, cancel=not finished)

    def _send(self, client: grpcclient.InferenceServerClient, prepared: Prepared,
              request_id: str, responses: queue.Queue) -> None:
        def on_response(result: Any, error: InferenceServerException | None) -> None:
            responses.put((result, error))

        logger.debug("model=%s request_id=%s sending", prepared.model, request_id)
        try:
            client.start_stream(callback=on_response, headers=self._stream_headers(client))
            client.async_stream_infer(
                prepared.model, prepared.inputs, outputs=prepared.outputs,
                request_id=request_id, enable_empty_final_response=True)
        except InferenceServerException as exc:
            # A stream that broke before the request was queued (e.g. nothing
            # listening) makes tritonclient refuse the request with a generic
            # message; the real error is already on the queue.
            cause = _queued_error(responses) or exc
            raise from_triton(cause) from cause

    def _stream_headers(self, client: grpcclient.InferenceServerClient) -> dict | None:
        if self._strict is None:
            try:
                version = client.get_server_metadata(as_json=True).get("version", "")
            except InferenceServerException:
                return None  # asked again on the next stream
            self._strict = strict_stream_errors_safe(version)
        return _STRICT_ERRORS_HEADERS if self._strict else None

    def _next_result(self, responses: queue.Queue, wait_s: float | None, request_id: str,
                     model: str) -> grpcclient.InferResult:
        try:
            result, error = responses.get(timeout=wait_s)
        except queue.Empty:
            raise self._timed_out(model, wait_s, request_id) from None
        if error is not None:
            mapped = from_triton(error)
            logger.debug("model=%s request_id=%s failed: %r", model, request_id, mapped)
            raise mapped from error
        return result

    # --- tritonclient clients --------------------------------------------------------

    def _new_client(self) -> grpcclient.InferenceServerClient:
        try:
            return self._factory(self.url, self._verbose)
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
            logger.debug("stop_stream failed", exc_info=True)
            cancel = True
        with self._lock:
            if not cancel and not self._closed and len(self._idle) < _MAX_IDLE_CLIENTS:
                self._idle.append(client)
                return
        _close_quietly(client)

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise OmniClientError("OmniClient is closed")


def _queued_error(responses: queue.Queue) -> InferenceServerException | None:
    try:
        _result, error = responses.get_nowait()
    except queue.Empty:
        return None
    return error


def _close_quietly(client: grpcclient.InferenceServerClient) -> None:
    try:
        client.close()
    except Exception:  # closing is best effort
        logger.debug("closing a tritonclient failed", exc_info=True)

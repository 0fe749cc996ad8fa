"""OmniClient: the synchronous SDK for omni pipelines served by Triton.

Runs in the caller's process. `stream()` works with any entry model (an omni
orchestrator, an LLM stage, a DiT stage) and yields typed events; `chat()`,
`speech()`, `generate_image()` and `generate()` are built on it. What to send
to which kind of model is decided in `_calls` (shared with the asyncio client);
this module is the transport.

Decoupled models (orchestrator, LLM) answer over Triton's gRPC bi-directional
stream: a call takes a
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
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Self

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from omni_client import _calls, _llm_io
from omni_client._calls import ModelInfo, Prepared
from omni_client.errors import OmniClientError, RequestTimeoutError, UnavailableError, from_triton
from omni_client.media import AudioInput, ImageInput
from omni_client.types import ChatResult, Completion, Event, ImageOutput, SpeechResult, TextDelta
from omni_serve.errors import STRICT_STREAM_ERRORS_HEADER, strict_stream_errors_safe

logger = logging.getLogger(__name__)

ClientFactory = Callable[[str, bool], grpcclient.InferenceServerClient]
"""Makes a tritonclient gRPC client from (url, verbose)."""

# Stream header that makes Triton close the stream with the real gRPC status code
# on an error response, instead of a status-less message.
_STRICT_ERRORS_HEADERS = {STRICT_STREAM_ERRORS_HEADER: "true"}
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
            instead of a status-less message (whose code the client then
            reads from the message). None (the default): only to a server
            that is Triton >= 2.53, asked once; Triton 2.51 can crash in
            this mode when streams end in errors (server PR #7840), and
            Triton before 2.68 (server PR #8708) when a model sends the
            error and the FINAL flag in two sends (omni stages send them
            together).
        client_factory: makes tritonclient gRPC clients from (url, verbose);
            tests inject fakes here.
        retries: how many times a call that is safe to repeat (model
            listing, readiness, image generation) is retried after an
            UnavailableError, with exponential back-off from `retry_backoff_s`.
            Streams are never retried: a generation may have started.

    Raises:
        ValueError: `timeout` is not positive or `retries` is negative.
    """

    def __init__(
        self,
        url: str = "localhost:8001",
        *,
        timeout: float | None = 60.0,
        model: str = "llm",
        verbose: bool = False,
        strict_stream_errors: bool | None = None,
        client_factory: ClientFactory | None = None,
        retries: int = 2,
        retry_backoff_s: float = 0.2,
    ) -> None:
        self.url = url
        self.model = model
        self.retries = _calls.check_retries(retries)
        self.retry_backoff_s = retry_backoff_s
        self._configs: dict[str, dict] = {}
        self.timeout = _check_timeout(timeout)
        self._verbose = verbose
        self._strict = strict_stream_errors
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

    # --- any pipeline ----------------------------------------------------------------

    def list_models(self, *, timeout: Timeout = _CLIENT_TIMEOUT) -> list[ModelInfo]:
        """The server's entry models (omni pipelines, LLMs, image generators) and their readiness.

        Stage models that only serve a pipeline (encoders, decoders) are
        left out. Retried on UnavailableError (see `retries`).

        Raises:
            UnavailableError: the server cannot be reached.
            ServerError: any other server or transport failure.
            OmniClientError: the client is closed.
        """
        wait_s = self._resolve_timeout(timeout)

        def index() -> list[ModelInfo]:
            client = self._control_client()
            rows = self._call(lambda: client.get_model_repository_index(
                as_json=True, client_timeout=wait_s))
            models = []
            for row in rows.get("models", []):
                name = row.get("name", "")
                if row.get("state") != "READY":
                    continue
                info = _calls.model_info(name, self._config(name, wait_s))
                if info is not None:
                    models.append(info)
            return models

        return self._retrying(index)

    def stream(self, text: str, *, model: str | None = None, image: ImageInput | None = None,
               audio: AudioInput | None = None, audio_sample_rate: int | None = None,
               modalities: Sequence[str] | None = None,
               sampling_parameters: Mapping[str, Any] | None = None, max_tokens: int | None = None,
               temperature: float | None = None, speaker: str | None = None, seed: int | None = None,
               task: str | None = None, session_id: str | None = None,
               history: Sequence[Mapping[str, str]] | None = None,
               talker_sampling: Mapping[str, Any] | None = None,
               stream_audio: bool | None = None, return_codec_ids: bool = False,
               inputs: Mapping[str, Any] | None = None,
               timeout: Timeout = _CLIENT_TIMEOUT, request_id: str | None = None) -> Iterator[Event]:
        """Run one request on any entry model, yielding events as they arrive.

        Omni pipelines yield TextDelta, AudioChunk, ImageOutput (and, with
        `return_codec_ids`, CodecIds) events in arrival order; LLM stages
        TextDeltas; DiT stages one ImageOutput (`text` is the prompt). The
        last event is always a Final with the finish reason and token usage.
        Breaking out of the loop cancels the request on the server.

        Args:
            text: the user's message (or the image prompt).
            model: entry model name; default: the server's first omni pipeline
                (else `self.model`).
            image, audio: media inputs (omni pipelines): a path, the file's
                bytes, a PIL image / numpy samples (give `audio_sample_rate`).
            modalities: outputs wanted, e.g. ["text", "audio"] (omni pipelines).
            sampling_parameters: vLLM SamplingParams fields for the LLM;
                `max_tokens` and `temperature` override the same keys.
            speaker: voice of the speech output; seed: of the generators.
            task: "chat" (default) or "speech" (read `text` aloud).
            session_id: omni pipelines with several thinker engines send a
                session's requests to the same one (its prefix cache hits).
            history: earlier turns, [{"role": "user"|"assistant", "content": str}].
            talker_sampling: the talker's sampling (omni pipelines with speech):
                any of temperature (0: greedy), top_k, top_p,
                repetition_penalty, max_tokens, min_tokens; unset keys keep the
                checkpoint's defaults. Its seed is `seed`.
            stream_audio: False decodes the whole utterance at once and sends
                it as one AudioChunk (default, None: the server's, streamed).
            return_codec_ids: also yield the talker's codec ids (CodecIds
                events; ChatResult.codec_ids); needs audio output.
            inputs: further inputs of the omni contract by name.
            timeout: seconds to wait for each response (None: forever).
            request_id: Triton request id (default: random).

        Raises:
            BadRequestError: bad arguments (raised by this call), or the
                server rejects the request (INVALID_ARG; while iterating).
            ValueError: `timeout` is not positive.
            While iterating:
            RequestTimeoutError: no response within `timeout`; the request is cancelled.
            UnavailableError: the server, model or one of its stages is down.
            CancelledError: the server cancelled the request.
            ServerError: any other server or transport failure.
            OmniClientError: the client is closed.
        """
        wait_s = self._resolve_timeout(timeout)
        name = model or self._default_model("omni", "llm", "image")
        prepared = _calls.prepare_stream(
            name, self._config(name, wait_s), text, image=image, audio=audio,
            audio_sample_rate=audio_sample_rate, modalities=modalities,
            sampling_parameters=sampling_parameters, max_tokens=max_tokens,
            temperature=temperature, speaker=speaker, seed=seed, task=task,
            session_id=session_id, history=history, talker_sampling=talker_sampling,
            stream_audio=stream_audio, return_codec_ids=return_codec_ids, inputs=inputs)
        return self._events(prepared, wait_s, request_id)

    def chat(self, text: str, **kwargs: Any) -> ChatResult:
        """Run `stream()` to the end and gather its events into a ChatResult.

        Takes the arguments of `stream()` and raises what it raises.
        """
        return ChatResult.from_events(self.stream(text, **kwargs))

    def speech(self, text: str, *, model: str | None = None, voice: str | None = None,
               seed: int | None = None, talker_sampling: Mapping[str, Any] | None = None,
               stream_audio: bool | None = None, return_codec_ids: bool = False,
               timeout: Timeout = _CLIENT_TIMEOUT) -> SpeechResult:
        """Read `text` aloud with an omni pipeline's talker and audio decoder.

        Args:
            voice: a speaker of the pipeline's audio stage (default: its own)
                or an alias of the orchestrator's voice map (OpenAI's voices).
            talker_sampling, stream_audio, return_codec_ids: as for `stream()`
                (the codec ids land in SpeechResult.codec_ids).

        Raises:
            BadRequestError: empty text, unknown voice, or a pipeline with no talker.
            ValueError, RequestTimeoutError, UnavailableError, CancelledError,
            ServerError, OmniClientError: as for `stream()`.
        """
        result = self.chat(text, model=model or self._default_model("omni"), speaker=voice,
                           seed=seed, task="speech", talker_sampling=talker_sampling,
                           stream_audio=stream_audio, return_codec_ids=return_codec_ids,
                           timeout=timeout)
        return _calls.speech_result(result)

    def generate_image(self, prompt: str, *, model: str | None = None, width: int | None = None,
                       height: int | None = None, steps: int | None = None,
                       guidance_scale: float | None = None, negative_prompt: str | None = None,
                       seed: int | None = None, timeout: Timeout = _CLIENT_TIMEOUT) -> ImageOutput:
        """Generate one image with a DiT stage (default: the server's first).

        With a seed the same image comes back alone or batched, so the call is
        retried on UnavailableError (see `retries`).

        Raises:
            BadRequestError: the server rejects a field (size, steps, ...).
            ValueError: `timeout` is not positive.
            RequestTimeoutError: no answer within `timeout`.
            UnavailableError: the server or model is down (after the retries).
            ServerError: any other server or transport failure.
            OmniClientError: the client is closed.
        """
        wait_s = self._resolve_timeout(timeout)
        name = model or self._default_model("image")
        prepared = _calls.prepare_image(name, prompt, width=width, height=height, steps=steps,
                                        guidance_scale=guidance_scale,
                                        negative_prompt=negative_prompt, seed=seed)
        client = self._control_client()
        result = self._retrying(lambda: self._call(lambda: client.infer(
            name, prepared.inputs, outputs=prepared.outputs, client_timeout=wait_s)))
        return _calls.parse_image(result)

    def _events(self, prepared: Prepared, wait_s: float | None,
                request_id: str | None) -> Iterator[Event]:
        if prepared.unary:
            client = self._control_client()
            result = self._call(lambda: client.infer(
                prepared.model, prepared.inputs, outputs=prepared.outputs, client_timeout=wait_s))
            yield from prepared.parse(result)
            yield from prepared.finish()
            return
        for result in self._results(prepared, wait_s, request_id):
            yield from prepared.parse(result)
        yield from prepared.finish()

    # --- models ----------------------------------------------------------------------

    def _config(self, model: str, wait_s: float | None) -> dict:
        config = self._configs.get(model)
        if config is None:
            client = self._control_client()
            config = self._retrying(lambda: self._call(lambda: client.get_model_config(
                model, as_json=True, client_timeout=wait_s)))
            config = config.get("config", config)
            self._configs[model] = config
        return config

    def _default_model(self, *kinds: str) -> str:
        models = self.list_models()  # one index request, whatever the kinds
        for kind in kinds:
            for info in models:
                if info.kind == kind and not info.internal:
                    return info.name
        return self.model

    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except InferenceServerException as exc:
            raise from_triton(exc) from exc

    def _retrying(self, fn: Callable[[], Any]) -> Any:
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except UnavailableError:
                if attempt == self.retries:
                    raise
                delay = self.retry_backoff_s * 2 ** attempt
                logger.debug("unavailable; retry %d/%d in %.2fs", attempt + 1, self.retries, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # --- one request on one stream ---------------------------------------------------

    def _responses(
        self, inputs: list[grpcclient.InferInput], wait_s: float | None, request_id: str | None
    ) -> Iterator[TextDelta]:
        prepared = Prepared(self.model, inputs, _llm_io.requested_outputs(), unary=False,
                            parse=lambda r: [] if (d := _llm_io.parse_response(r)) is None else [d])
        yield from self._results(prepared, wait_s, request_id, parse=True)

    def _results(self, prepared: Prepared, wait_s: float | None, request_id: str | None,
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

    def _send(
        self,
        client: grpcclient.InferenceServerClient,
        prepared: Prepared,
        request_id: str,
        responses: queue.Queue,
    ) -> None:
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

    def _next_result(
        self, responses: queue.Queue, wait_s: float | None, request_id: str, model: str
    ) -> grpcclient.InferResult:
        try:
            result, error = responses.get(timeout=wait_s)
        except queue.Empty:
            raise RequestTimeoutError(
                f"no response from model {model!r} within {wait_s}s "
                f"(request id {request_id})") from None
        if error is not None:
            mapped = from_triton(error)
            logger.debug("model=%s request_id=%s failed: %r", model, request_id, mapped)
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

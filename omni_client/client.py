"""OmniClient: the synchronous SDK for omni pipelines served by Triton.

Runs in the caller's process. `stream()` works with any entry model (an omni
orchestrator, an LLM stage, a DiT stage) and yields typed events; `chat()`,
`speech()`, `generate_image()` and `generate()` are built on it. What to send
to which kind of model is decided in `_calls`, the arguments, defaults and
retries in `_base` (both shared with the asyncio client); decoupled models
(orchestrator, LLM) answer over one gRPC stream per request (`_sync_stream`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Self, Unpack

from tritonclient.utils import InferenceServerException

from omni_client import _calls
from omni_client._base import (
    CLIENT_TIMEOUT,
    ClientBase,
    ImageOptions,
    StreamOptions,
    Timeout,
    completion,
)
from omni_client._calls import ModelInfo, Prepared
from omni_client._sync_stream import ClientFactory, StreamPool, default_client_factory
from omni_client.errors import UnavailableError, from_triton
from omni_client.types import ChatResult, Completion, Event, ImageOutput, SpeechResult, TextDelta

logger = logging.getLogger(__name__)

class OmniClient(ClientBase):
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
        super().__init__(url, timeout=timeout, model=model, retries=retries,
                         retry_backoff_s=retry_backoff_s,
                         strict_stream_errors=strict_stream_errors)
        self._pool = StreamPool(url, verbose, client_factory or default_client_factory,
                                strict_stream_errors, self._timed_out)

    # --- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close idle connections; calls still running close theirs when they end."""
        self._pool.close()

    # --- public calls ----------------------------------------------------------------

    def is_live(self, *, timeout: Timeout = CLIENT_TIMEOUT) -> bool:
        """Whether the server answers its liveness check (False when unreachable).

        Raises:
            OmniClientError: the client is closed.
            ValueError: `timeout` is not positive.
        """
        wait_s = self._resolve_timeout(timeout)
        try:
            return bool(self._pool.control().is_server_live(client_timeout=wait_s))
        except InferenceServerException as exc:
            logger.debug("server not live: %s", exc)
            return False

    def is_ready(self, model: str | None = None, *, timeout: Timeout = CLIENT_TIMEOUT) -> bool:
        """Whether the server is live and `model` (default: `self.model`) is ready.

        Returns False (and logs why at DEBUG) when the server cannot be
        reached or answers with an error.

        Raises:
            OmniClientError: the client is closed.
            ValueError: `timeout` is not positive.
        """
        wait_s = self._resolve_timeout(timeout)
        client = self._pool.control()
        try:
            return bool(client.is_server_live(client_timeout=wait_s)) and bool(
                client.is_model_ready(model or self.model, client_timeout=wait_s))
        except InferenceServerException as exc:
            logger.debug("model=%s not ready: %s", model or self.model, exc)
            return False

    def generate_stream(
        self,
        prompt: str,
        *,
        sampling_parameters: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: Timeout = CLIENT_TIMEOUT,
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
        prepared = self._llm_request(prompt, True, sampling_parameters, max_tokens, temperature)
        return self._pool.results(prepared, self._resolve_timeout(timeout), request_id, parse=True)

    def generate(
        self,
        prompt: str,
        *,
        sampling_parameters: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: Timeout = CLIENT_TIMEOUT,
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
        prepared = self._llm_request(prompt, False, sampling_parameters, max_tokens, temperature)
        return completion(list(self._pool.results(prepared, self._resolve_timeout(timeout),
                                             request_id, parse=True)))

    # --- any pipeline ----------------------------------------------------------------

    def list_models(self, *, timeout: Timeout = CLIENT_TIMEOUT) -> list[ModelInfo]:
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
            client = self._pool.control()
            rows = self._call(lambda: client.get_model_repository_index(
                as_json=True, client_timeout=wait_s))
            infos = (_calls.model_info(name, self._config(name, wait_s))
                     for name in self._ready_models(rows))
            return [info for info in infos if info is not None]

        return self._retrying(index)

    def stream(self, text: str, *, model: str | None = None,
               timeout: Timeout = CLIENT_TIMEOUT, request_id: str | None = None,
               **options: Unpack[StreamOptions]) -> Iterator[Event]:
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
            options: what to send besides the text (media, modalities,
                sampling, voice, seed, history, ...): see StreamOptions.
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
        prepared = _calls.prepare_stream(name, self._config(name, wait_s), text, **options)
        return self._events(prepared, wait_s, request_id)

    def chat(self, text: str, **kwargs: Any) -> ChatResult:
        """Run `stream()` to the end and gather its events into a ChatResult.

        Takes the arguments of `stream()` and raises what it raises.
        """
        return ChatResult.from_events(self.stream(text, **kwargs))

    def speech(self, text: str, *, model: str | None = None, voice: str | None = None,
               seed: int | None = None, talker_sampling: Mapping[str, Any] | None = None,
               stream_audio: bool | None = None, return_codec_ids: bool = False,
               timeout: Timeout = CLIENT_TIMEOUT) -> SpeechResult:
        """Read `text` aloud with an omni pipeline's talker and audio decoder.

        Args:
            voice: a voice of the pipeline's audio stage (default: its own)
                or an alias of the orchestrator's voice map (OpenAI's voices).
            talker_sampling, stream_audio, return_codec_ids: as for `stream()`
                (the codec ids land in SpeechResult.codec_ids).

        Raises:
            BadRequestError: empty text, unknown voice, or a pipeline with no talker.
            ValueError, RequestTimeoutError, UnavailableError, CancelledError,
            ServerError, OmniClientError: as for `stream()`.
        """
        result = self.chat(text, model=model or self._default_model("omni"), voice=voice,
                           seed=seed, task="speech", talker_sampling=talker_sampling,
                           stream_audio=stream_audio, return_codec_ids=return_codec_ids,
                           timeout=timeout)
        return _calls.speech_result(result)

    def generate_image(self, prompt: str, *, model: str | None = None,
                       timeout: Timeout = CLIENT_TIMEOUT,
                       **options: Unpack[ImageOptions]) -> ImageOutput:
        """Generate one image with a DiT stage (default: the server's first).

        `options`: width, height, steps, guidance_scale, negative_prompt, seed
        (see ImageOptions; unset: the stage's defaults).

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
        prepared = _calls.prepare_image(name, prompt, **options)
        client = self._pool.control()
        result = self._retrying(lambda: self._call(lambda: client.infer(
            name, prepared.inputs, outputs=prepared.outputs, client_timeout=wait_s)))
        return _calls.parse_image(result)

    def _events(self, prepared: Prepared, wait_s: float | None,
                request_id: str | None) -> Iterator[Event]:
        if prepared.unary:
            client = self._pool.control()
            result = self._call(lambda: client.infer(
                prepared.model, prepared.inputs, outputs=prepared.outputs, client_timeout=wait_s))
            yield from prepared.parse(result)
            yield from prepared.finish()
            return
        for result in self._pool.results(prepared, wait_s, request_id):
            yield from prepared.parse(result)
        yield from prepared.finish()

    # --- models ----------------------------------------------------------------------

    def _config(self, model: str, wait_s: float | None) -> dict:
        config = self._configs.get(model)
        if config is None:
            client = self._pool.control()
            config = self._keep_config(model, self._retrying(lambda: self._call(
                lambda: client.get_model_config(model, as_json=True, client_timeout=wait_s))))
        return config

    def _default_model(self, *kinds: str) -> str:
        return self._pick_model(self.list_models(), kinds)  # one index request

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
                delay = self._retry_delay(attempt)
                if delay is None:
                    raise
                time.sleep(delay)
        raise AssertionError("unreachable")

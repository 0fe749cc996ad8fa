"""AsyncOmniClient: the asyncio twin of OmniClient (same calls, same events, same errors).

Runs in the caller's event loop over tritonclient's grpc.aio client (unary
calls, server requests) and, for streams, omni_serve.grpc_stream on a
StreamChannel of its own (both opened with the client, closed with it). One
request per gRPC stream: the request is written, responses are read until the
one flagged `triton_final_response`, and leaving early (an exception, a
timeout, the caller breaking out of `async for`, a cancelled task) cancels
the gRPC call, which makes Triton cancel the request and the stages abort it.
What to send to which model comes from `_calls`, shared with OmniClient.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Self, Unpack

import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
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
from omni_client._tensor import arrays_by_name
from omni_client.errors import OmniClientError, UnavailableError, from_triton
from omni_client.types import ChatResult, Completion, Event, ImageOutput, SpeechResult, TextDelta
from omni_serve.grpc_stream import StreamChannel, StreamError, stream_request, strict_errors_safe

logger = logging.getLogger(__name__)


class AsyncOmniClient(ClientBase):
    """Asyncio client of omni pipelines, LLM and DiT models on Triton over gRPC.

        async with AsyncOmniClient("localhost:8001") as client:
            async for event in client.stream("Hi", modalities=["text", "audio"]):
                ...

    Create it inside the event loop that uses it. Arguments as for
    OmniClient (`timeout` per response, `retries` for calls safe to repeat).

    Raises:
        ValueError: `timeout` is not positive or `retries` is negative.
    """

    def __init__(self, url: str = "localhost:8001", *, timeout: float | None = 60.0,
                 model: str = "llm", retries: int = 2, retry_backoff_s: float = 0.2,
                 verbose: bool = False, strict_stream_errors: bool | None = None) -> None:
        super().__init__(url, timeout=timeout, model=model, retries=retries,
                         retry_backoff_s=retry_backoff_s,
                         strict_stream_errors=strict_stream_errors)
        self._client = grpcaio.InferenceServerClient(url, verbose=verbose)
        self._streams = StreamChannel(url)  # tritonclient's default channel arguments
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channels; running calls fail with an OmniClientError."""
        if not self._closed:
            self._closed = True
            await self._streams.close()
            await self._client.close()

    # --- calls -----------------------------------------------------------------------

    async def is_live(self, *, timeout: Timeout = CLIENT_TIMEOUT) -> bool:
        """Whether the server answers its liveness check (False when unreachable)."""
        wait_s = self._resolve_timeout(timeout)
        try:
            return bool(await self._client.is_server_live(client_timeout=wait_s))
        except InferenceServerException as exc:
            logger.debug("server not live: %s", exc)
            return False

    async def is_ready(self, model: str | None = None, *,
                       timeout: Timeout = CLIENT_TIMEOUT) -> bool:
        """Whether the server is live and `model` (default: `self.model`) is ready."""
        wait_s = self._resolve_timeout(timeout)
        try:
            return bool(await self._client.is_server_live(client_timeout=wait_s)) and bool(
                await self._client.is_model_ready(model or self.model, client_timeout=wait_s))
        except InferenceServerException as exc:
            logger.debug("model=%s not ready: %s", model or self.model, exc)
            return False

    async def generate_stream(self, prompt: str, *,
                              sampling_parameters: Mapping[str, Any] | None = None,
                              max_tokens: int | None = None, temperature: float | None = None,
                              timeout: Timeout = CLIENT_TIMEOUT,
                              request_id: str | None = None) -> AsyncIterator[TextDelta]:
        """Text for `prompt` from `self.model`, a TextDelta per streamed response; see
        OmniClient.generate_stream (same arguments, same errors)."""
        prepared = self._llm_request(prompt, True, sampling_parameters, max_tokens, temperature)
        async for result in self._results(prepared, self._resolve_timeout(timeout), request_id):
            for delta in prepared.parse(result):
                yield delta

    async def generate(self, prompt: str, *,
                       sampling_parameters: Mapping[str, Any] | None = None,
                       max_tokens: int | None = None, temperature: float | None = None,
                       timeout: Timeout = CLIENT_TIMEOUT,
                       request_id: str | None = None) -> Completion:
        """Text for `prompt` in one response; see OmniClient.generate."""
        prepared = self._llm_request(prompt, False, sampling_parameters, max_tokens, temperature)
        deltas = []
        async for result in self._results(prepared, self._resolve_timeout(timeout), request_id):
            deltas.extend(prepared.parse(result))
        return completion(deltas)

    async def list_models(self, *, timeout: Timeout = CLIENT_TIMEOUT) -> list[ModelInfo]:
        """The server's entry models; see OmniClient.list_models (same errors, same retries)."""
        wait_s = self._resolve_timeout(timeout)

        async def index() -> list[ModelInfo]:
            rows = await self._call(lambda: self._client.get_model_repository_index(
                as_json=True, client_timeout=wait_s))
            infos = [_calls.model_info(name, await self._config(name, wait_s))
                     for name in self._ready_models(rows)]
            return [info for info in infos if info is not None]

        return await self._retrying(index)

    async def stream(self, text: str, *, model: str | None = None,
                     timeout: Timeout = CLIENT_TIMEOUT, request_id: str | None = None,
                     **options: Unpack[StreamOptions]) -> AsyncIterator[Event]:
        """Run one request on any entry model, yielding events; see OmniClient.stream.

        Raises what OmniClient.stream raises. To cancel the request the moment you stop
        reading, iterate inside `contextlib.aclosing(client.stream(...))`
        (otherwise it is cancelled when the event loop finalizes the
        abandoned generator).
        """
        wait_s = self._resolve_timeout(timeout)
        name = model or await self._default_model("omni", "llm", "image")
        prepared = _calls.prepare_stream(name, await self._config(name, wait_s), text, **options)
        if prepared.unary:
            result = await self._unary(prepared, wait_s)
            for event in prepared.parse(result):
                yield event
        else:
            async for result in self._results(prepared, wait_s, request_id):
                for event in prepared.parse(result):
                    yield event
        for event in prepared.finish():
            yield event

    async def chat(self, text: str, **kwargs: Any) -> ChatResult:
        """`stream()` to the end, gathered into a ChatResult."""
        return ChatResult.from_events([event async for event in self.stream(text, **kwargs)])

    async def speech(self, text: str, *, model: str | None = None, voice: str | None = None,
                     seed: int | None = None, talker_sampling: Mapping[str, Any] | None = None,
                     stream_audio: bool | None = None, return_codec_ids: bool = False,
                     timeout: Timeout = CLIENT_TIMEOUT) -> SpeechResult:
        """Read `text` aloud; see OmniClient.speech."""
        result = await self.chat(text, model=model or await self._default_model("omni"),
                                 voice=voice, seed=seed, task="speech",
                                 talker_sampling=talker_sampling, stream_audio=stream_audio,
                                 return_codec_ids=return_codec_ids, timeout=timeout)
        return _calls.speech_result(result)

    async def generate_image(self, prompt: str, *, model: str | None = None,
                             timeout: Timeout = CLIENT_TIMEOUT,
                             **options: Unpack[ImageOptions]) -> ImageOutput:
        """One image from a DiT stage; see OmniClient.generate_image (same keywords)."""
        wait_s = self._resolve_timeout(timeout)
        prepared = _calls.prepare_image(model or await self._default_model("image"), prompt,
                                        **options)
        result = await self._retrying(lambda: self._unary(prepared, wait_s))
        return _calls.parse_image(result)

    # --- transport -------------------------------------------------------------------

    async def _config(self, model: str, wait_s: float | None = None) -> dict:
        if model not in self._configs:
            self._keep_config(model, await self._retrying(lambda: self._call(
                lambda: self._client.get_model_config(model, as_json=True,
                                                      client_timeout=wait_s))))
        return self._configs[model]

    async def _default_model(self, *kinds: str) -> str:
        return self._pick_model(await self.list_models(), kinds)  # one index request

    async def _call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        if self._closed:
            raise OmniClientError("AsyncOmniClient is closed")
        try:
            return await fn()
        except InferenceServerException as exc:
            raise from_triton(exc) from exc

    async def _retrying(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        for attempt in range(self.retries + 1):
            try:
                return await fn()
            except UnavailableError:
                delay = self._retry_delay(attempt)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _unary(self, prepared: Prepared, wait_s: float | None) -> Any:
        return await self._call(lambda: self._client.infer(
            prepared.model, prepared.inputs, outputs=prepared.outputs, client_timeout=wait_s))

    async def _strict_errors(self) -> bool:
        """Whether to send the strict-errors header (see OmniClient's strict_stream_errors)."""
        if self._strict is None:
            self._strict = await strict_errors_safe(self._client)
        return bool(self._strict)

    async def _results(self, prepared: Prepared, wait_s: float | None,
                       request_id: str | None) -> AsyncIterator[grpcclient.InferResult]:
        if self._closed:
            raise OmniClientError("AsyncOmniClient is closed")
        request_id = request_id or uuid.uuid4().hex
        strict = await self._strict_errors()
        try:
            async for result in stream_request(self._streams.stub, prepared.model,
                                               arrays_by_name(prepared.inputs),
                                               [o.name() for o in prepared.outputs],
                                               request_id=request_id, timeout_s=wait_s,
                                               strict=strict):
                yield result
        except TimeoutError:
            raise self._timed_out(prepared.model, wait_s, request_id) from None
        except StreamError as exc:
            status = None if exc.code is None else f"StatusCode.{exc.code}"
            cause = InferenceServerException(msg=exc.message, status=status)
            raise from_triton(cause) from exc

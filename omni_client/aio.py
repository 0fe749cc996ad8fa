"""AsyncOmniClient: the asyncio twin of OmniClient (same calls, same events, same errors).

Runs in the caller's event loop over tritonclient's grpc.aio client. One
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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Self

import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from omni_client import _calls
from omni_client._calls import ModelInfo, Prepared
from omni_client.errors import OmniClientError, RequestTimeoutError, UnavailableError, from_triton
from omni_client.media import AudioInput, ImageInput
from omni_client.types import ChatResult, Event, ImageOutput, SpeechResult
from omni_serve.grpc_stream import StreamError, stream_request, strict_errors_safe

logger = logging.getLogger(__name__)

def _check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return timeout


class AsyncOmniClient:
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
        self.url = url
        self._strict = strict_stream_errors
        self.model = model
        self.timeout = _check_timeout(timeout)
        self.retries = _calls.check_retries(retries)
        self.retry_backoff_s = retry_backoff_s
        self._client = grpcaio.InferenceServerClient(url, verbose=verbose)
        self._configs: dict[str, dict] = {}
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; running calls fail with an OmniClientError."""
        if not self._closed:
            self._closed = True
            await self._client.close()

    # --- calls -----------------------------------------------------------------------

    async def is_live(self) -> bool:
        """Whether the server answers its liveness check (False when unreachable)."""
        try:
            return bool(await self._client.is_server_live())
        except InferenceServerException as exc:
            logger.debug("server not live: %s", exc)
            return False

    async def is_ready(self, model: str | None = None) -> bool:
        """Whether the server is live and `model` (default: `self.model`) is ready."""
        try:
            return bool(await self._client.is_server_live()) and bool(
                await self._client.is_model_ready(model or self.model))
        except InferenceServerException as exc:
            logger.debug("model=%s not ready: %s", model or self.model, exc)
            return False

    async def list_models(self) -> list[ModelInfo]:
        """The server's entry models; see OmniClient.list_models (same errors, same retries)."""
        async def index() -> list[ModelInfo]:
            rows = await self._call(lambda: self._client.get_model_repository_index(as_json=True))
            models = []
            for row in rows.get("models", []):
                if row.get("state") == "READY":
                    info = _calls.model_info(row["name"], await self._config(row["name"]))
                    if info is not None:
                        models.append(info)
            return models

        return await self._retrying(index)

    async def stream(self, text: str, *, model: str | None = None, image: ImageInput | None = None,
                     audio: AudioInput | None = None, audio_sample_rate: int | None = None,
                     modalities: Sequence[str] | None = None,
                     sampling_parameters: Mapping[str, Any] | None = None,
                     max_tokens: int | None = None, temperature: float | None = None,
                     speaker: str | None = None, seed: int | None = None, task: str | None = None,
                     session_id: str | None = None,
                     history: Sequence[Mapping[str, str]] | None = None,
                     talker_sampling: Mapping[str, Any] | None = None,
                     stream_audio: bool | None = None, return_codec_ids: bool = False,
                     inputs: Mapping[str, Any] | None = None, timeout: float | None = -1.0,
                     request_id: str | None = None) -> AsyncIterator[Event]:
        """Run one request on any entry model, yielding events; see OmniClient.stream.

        `timeout` -1 (the default) means the client's timeout. Raises what
        OmniClient.stream raises. To cancel the request the moment you stop
        reading, iterate inside `contextlib.aclosing(client.stream(...))`
        (otherwise it is cancelled when the event loop finalizes the
        abandoned generator).
        """
        wait_s = self.timeout if timeout == -1.0 else _check_timeout(timeout)
        name = model or await self._default_model("omni", "llm", "image")
        prepared = _calls.prepare_stream(
            name, await self._config(name), text, image=image, audio=audio,
            audio_sample_rate=audio_sample_rate, modalities=modalities,
            sampling_parameters=sampling_parameters, max_tokens=max_tokens,
            temperature=temperature, speaker=speaker, seed=seed, task=task,
            session_id=session_id, history=history, talker_sampling=talker_sampling,
            stream_audio=stream_audio, return_codec_ids=return_codec_ids, inputs=inputs)
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
                     timeout: float | None = -1.0) -> SpeechResult:
        """Read `text` aloud; see OmniClient.speech."""
        result = await self.chat(text, model=model or await self._default_model("omni"),
                                 speaker=voice, seed=seed, task="speech",
                                 talker_sampling=talker_sampling, stream_audio=stream_audio,
                                 return_codec_ids=return_codec_ids, timeout=timeout)
        return _calls.speech_result(result)

    async def generate_image(self, prompt: str, *, model: str | None = None, **fields: Any
                             ) -> ImageOutput:
        """One image from a DiT stage; see OmniClient.generate_image (same keywords)."""
        timeout = fields.pop("timeout", -1.0)
        wait_s = self.timeout if timeout == -1.0 else _check_timeout(timeout)
        prepared = _calls.prepare_image(model or await self._default_model("image"), prompt,
                                        **fields)
        result = await self._retrying(lambda: self._unary(prepared, wait_s))
        return _calls.parse_image(result)

    # --- transport -------------------------------------------------------------------

    async def _config(self, model: str) -> dict:
        if model not in self._configs:
            config = await self._retrying(lambda: self._call(
                lambda: self._client.get_model_config(model, as_json=True)))
            self._configs[model] = config.get("config", config)
        return self._configs[model]

    async def _default_model(self, *kinds: str) -> str:
        models = await self.list_models()  # one index request, whatever the kinds
        for kind in kinds:
            for info in models:
                if info.kind == kind and not info.internal:
                    return info.name
        return self.model

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
                if attempt == self.retries:
                    raise
                await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
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
            async for result in stream_request(self._client, prepared.model, prepared.inputs,
                                               prepared.outputs, request_id=request_id,
                                               timeout_s=wait_s, strict=strict):
                yield result
        except TimeoutError:
            raise RequestTimeoutError(f"no response from model {prepared.model!r} within "
                                      f"{wait_s}s (request id {request_id})") from None
        except StreamError as exc:
            status = None if exc.code is None else f"StatusCode.{exc.code}"
            cause = InferenceServerException(msg=exc.message, status=status)
            raise from_triton(cause) from exc

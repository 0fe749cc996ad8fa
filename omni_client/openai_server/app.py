"""omni-openai: an OpenAI-compatible HTTP server in front of a running tritonserver.

Runs as its own process (FastAPI + uvicorn) and talks to Triton over gRPC
through omni_client's AsyncOmniClient: requests are validated here
(protocol.py), run as omni_client calls, and answered in OpenAI's shapes.
Model names are the server's entry models (GET /v1/models). The web demo
(static/) is served at `/`.

    omni-openai --triton-url localhost:8001 --host 127.0.0.1 --port 9000
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from omni_client import AsyncOmniClient, ModelInfo
from omni_client.errors import (
    BadRequestError,
    CancelledError,
    OmniClientError,
    RequestTimeoutError,
    UnavailableError,
)
from omni_client.media import encode_audio
from omni_client.openai_server import protocol as p
from omni_client.types import AudioChunk, CodecIds, Event, Final, TextDelta, Usage

log = logging.getLogger("omni_openai")

STATIC_DIR = Path(__file__).parent / "static"
_MODELS_TTL_S = 5.0


def _status_of(exc: OmniClientError) -> tuple[int, str]:
    if isinstance(exc, BadRequestError):
        return 400, "invalid_request_error"
    if isinstance(exc, UnavailableError):
        return 503, "service_unavailable"
    if isinstance(exc, RequestTimeoutError):
        return 504, "timeout"
    if isinstance(exc, CancelledError):
        return 499, "cancelled"
    return 500, "server_error"


def _as_openai_error(exc: OmniClientError) -> p.OpenAIError:
    status, type_ = _status_of(exc)
    return p.OpenAIError(status, exc.message, type_=type_)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _usage(usage: Usage | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def _pcm16(samples: np.ndarray) -> bytes:
    return encode_audio(samples, 24000, "pcm")  # the rate is not used for raw PCM


def _streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown" (0xFFFFFFFF), for a streamed body."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", unknown))


class Frontend:
    """The state of one omni-openai process: its Triton client and its metrics."""

    def __init__(self, triton_url: str, *, timeout_s: float | None):
        self.triton_url = triton_url
        self.timeout_s = timeout_s
        self.client: AsyncOmniClient | None = None
        self._models: tuple[float, list[ModelInfo]] = (0.0, [])
        self.registry = CollectorRegistry()
        self.requests = Counter("omni_openai_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("omni_openai_request_seconds",
                                 "Time to the response head (streams: to the first event)",
                                 ["endpoint"], registry=self.registry,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

    async def start(self) -> None:
        self.client = AsyncOmniClient(self.triton_url, timeout=self.timeout_s)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def models(self) -> list[ModelInfo]:
        stamp, models = self._models
        if time.monotonic() - stamp > _MODELS_TTL_S:
            models = [m for m in await self.client.list_models() if not m.internal]
            self._models = (time.monotonic(), models)
        return models

    async def model(self, name: str | None, kinds: Sequence[str], param: str = "model"
                    ) -> ModelInfo:
        models = await self.models()
        if name is None:
            for info in models:
                if info.kind in kinds:
                    return info
            raise p.OpenAIError(400, f"the server has no model for this endpoint "
                                     f"(kinds {list(kinds)})", param=param)
        for info in models:
            if info.name == name:
                if info.kind not in kinds:
                    fitting = [m.name for m in models if m.kind in kinds]
                    raise p.OpenAIError(400, f"model {name!r} is a {info.kind} model; this "
                                             f"endpoint takes {fitting}", param=param)
                return info
        raise p.OpenAIError(404, f"the model {name!r} does not exist; available: "
                                 f"{[m.name for m in models]}", param=param,
                            code="model_not_found")


async def _first_and_rest(events: AsyncIterator[Event]) -> tuple[list[Event], AsyncIterator[Event]]:
    """Wait for the first event (so early errors become HTTP errors), keep the rest lazy."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        return [], events
    return [first], events


class _Completion:
    """One chat completion being answered (shared by the streamed and whole forms)."""

    def __init__(self, body: p.ChatRequest, audio: bool):
        self.body = body
        self.audio = audio
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.audio_id = f"audio_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.body.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def delta(self, event: Event) -> dict[str, Any] | None:
        if isinstance(event, TextDelta):
            if not event.text:
                return None
            if self.audio:
                return {"audio": {"id": self.audio_id, "transcript": event.text}}
            return {"content": event.text}
        if isinstance(event, AudioChunk) and self.audio:
            return {"audio": {"id": self.audio_id,
                              "data": base64.b64encode(_pcm16(event.samples)).decode()}}
        if isinstance(event, CodecIds) and self.audio and event.ids:
            return {"audio": {"id": self.audio_id, "codec_ids": list(event.ids)}}
        return None

    def whole(self, events: list[Event]) -> dict[str, Any]:
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        final = next((e for e in events if isinstance(e, Final)), Final(None))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.audio:
            chunks = [e for e in events if isinstance(e, AudioChunk)]
            samples = (np.concatenate([c.samples for c in chunks]) if chunks
                       else np.zeros(0, np.float32))
            rate = chunks[0].sample_rate if chunks else 24000
            fmt = self.body.audio.format
            data = (_pcm16(samples) if fmt == "pcm16" else encode_audio(samples, rate, fmt))
            message["content"] = None  # OpenAI: with audio out, the text is the transcript
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(data).decode(),
                                "expires_at": self.created + 3600, "transcript": text}
            if self.body.return_codec_ids:  # extension
                message["audio"]["codec_ids"] = [i for e in events if isinstance(e, CodecIds)
                                                 for i in e.ids]
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.body.model,
                "choices": [{"index": 0, "message": message,
                             "finish_reason": p.finish_reason(final.finish_reason)}],
                "usage": _usage(final.usage)}


def create_app(triton_url: str, *, timeout_s: float | None = 120.0) -> FastAPI:
    """The FastAPI app serving the OpenAI API for the Triton server at `triton_url` (gRPC)."""
    front = Frontend(triton_url, timeout_s=timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await front.start()
        try:
            yield
        finally:
            await front.stop()

    app = FastAPI(title="omni-openai", lifespan=lifespan,
                  description="OpenAI-compatible API over omni pipelines served by Triton")
    app.state.front = front

    @app.exception_handler(p.OpenAIError)
    async def _openai_error(request: Request, exc: p.OpenAIError):
        front.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(OmniClientError)
    async def _client_error(request: Request, exc: OmniClientError):
        return await _openai_error(request, _as_openai_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            message = f"unrecognized request argument supplied: {param}"
        elif first.get("type") == "json_invalid":
            message = "the body is not valid JSON"
        elif param:
            message = f"{param}: {message}"
        return await _openai_error(request, p.OpenAIError(400, message, param=param))

    # --- plain endpoints -------------------------------------------------------------

    @app.get("/health")
    async def health():
        if await _triton_live(front):
            return {"status": "ok", "triton_url": triton_url}
        raise p.OpenAIError(503, f"Triton at {triton_url} is not reachable", type_="service_unavailable")

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(front.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        models = await front.models()
        front.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "omni-triton",
             "kind": m.kind, "backend": m.backend} for m in models]}

    # --- chat ------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatRequest):
        started = time.perf_counter()
        audio = body.wants_audio()
        info = await front.model(body.model, ("omni", "llm"))
        if info.kind == "omni":
            turn = p.user_turn(body.messages)
            inputs = _omni_context(body)
            events = front.client.stream(
                turn.text, model=info.name, image=turn.image, audio=turn.audio,
                modalities=["text", "audio"] if audio else ["text"],
                sampling_parameters=body.sampling_parameters(),
                speaker=body.audio.voice if audio else None, seed=body.seed,
                **_talker_options(body, audio), **inputs)
        else:
            if audio:
                raise p.OpenAIError(400, f"model {info.name!r} produces text only; use an omni "
                                         "pipeline for audio", param="modalities")
            events = front.client.stream(p.chatml_prompt(body.messages), model=info.name,
                                         sampling_parameters=body.sampling_parameters())
        completion = _Completion(body, audio)
        first, rest = await _first_and_rest(events)
        front.latency.labels("/v1/chat/completions").observe(time.perf_counter() - started)
        front.requests.labels("/v1/chat/completions", "200").inc()
        if not body.stream:
            return completion.whole(first + [e async for e in rest])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chat_stream(completion, first, rest, include_usage),
                                 media_type="text/event-stream")

    # --- images ----------------------------------------------------------------------

    @app.post("/v1/images/generations")
    async def images(body: p.ImageRequest):
        if body.response_format != "b64_json":
            raise p.OpenAIError(400, "response_format must be 'b64_json' (the server keeps no "
                                     "files to link to)", param="response_format")
        info = await front.model(body.model, ("image",))
        width, height = body.dimensions()
        seeds = [None if body.seed is None else body.seed + i for i in range(body.n)]
        images = await asyncio.gather(*(
            front.client.generate_image(body.prompt, model=info.name, width=width, height=height,
                                        steps=body.num_inference_steps, seed=seed,
                                        negative_prompt=body.negative_prompt)
            for seed in seeds))
        front.requests.labels("/v1/images/generations", "200").inc()
        return {"created": int(time.time()),
                "data": [{"b64_json": base64.b64encode(img.png).decode()} for img in images]}

    # --- speech ----------------------------------------------------------------------

    @app.post("/v1/audio/speech")
    async def speech(body: p.SpeechRequest):
        fmt = body.checked_format()
        info = await front.model(body.model, ("omni",))
        events = front.client.stream(body.input, model=info.name, task="speech",
                                     speaker=body.voice, seed=body.seed,
                                     talker_sampling=body.talker_sampling_parameters,
                                     stream_audio=body.stream_audio)
        first, rest = await _first_and_rest(events)
        front.requests.labels("/v1/audio/speech", "200").inc()
        media = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}[fmt]
        if fmt == "flac":  # FLAC needs every sample before it can be written
            chunks = [e for e in first + [e async for e in rest] if isinstance(e, AudioChunk)]
            if not chunks:
                raise p.OpenAIError(500, "the pipeline sent no audio", type_="server_error")
            samples = np.concatenate([c.samples for c in chunks])
            return Response(encode_audio(samples, chunks[0].sample_rate, "flac"), media_type=media)
        return StreamingResponse(_speech_stream(first, rest, fmt), media_type=media)

    # --- web demo --------------------------------------------------------------------

    if STATIC_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

        @app.get("/", include_in_schema=False)
        async def index():
            return FileResponse(STATIC_DIR / "index.html")

    return app


async def _triton_live(front: Frontend) -> bool:
    return await front.client.is_live()


def _omni_context(body: p.ChatRequest) -> dict[str, Any]:
    """The omni inputs beyond the last user turn: earlier turns and the session id (`user`)."""
    turns = p.history(body.messages, allow_system=False)
    return {"history": turns or None, "session_id": body.user}


def _talker_options(body: p.ChatRequest, audio: bool) -> dict[str, Any]:
    """The speech extensions of a chat request (sent only when it asks for audio)."""
    if not audio:
        return {}
    return {"talker_sampling": body.talker_sampling_parameters,
            "stream_audio": body.stream_audio, "return_codec_ids": body.return_codec_ids}


async def _chat_stream(completion: _Completion, first: list[Event], rest: AsyncIterator[Event],
                       include_usage: bool) -> AsyncIterator[bytes]:
    yield _sse(completion.chunk({"role": "assistant", "content": None if completion.audio else ""}))
    final: Final | None = None
    try:
        async for event in _chain(first, rest):
            if isinstance(event, Final):
                final = event
                continue
            delta = completion.delta(event)
            if delta is not None:
                yield _sse(completion.chunk(delta))
    except OmniClientError as exc:  # mid-stream: the status line is gone, say it in the stream
        yield _sse(_as_openai_error(exc).body())
        yield _sse("[DONE]")
        return
    reason = p.finish_reason(final.finish_reason if final else None)
    yield _sse(completion.chunk({}, reason))
    if include_usage:
        chunk = completion.chunk({}, None)
        chunk["choices"] = []
        chunk["usage"] = _usage(final.usage if final else None)
        yield _sse(chunk)
    yield _sse("[DONE]")


async def _speech_stream(first: list[Event], rest: AsyncIterator[Event],
                         fmt: str) -> AsyncIterator[bytes]:
    header_sent = False
    async for event in _chain(first, rest):
        if isinstance(event, AudioChunk):
            if fmt == "wav" and not header_sent:
                yield _streaming_wav_header(event.sample_rate)
                header_sent = True
            yield _pcm16(event.samples)


async def _chain(first: list[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    for event in first:
        yield event
    async for event in rest:
        yield event


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-openai", description=__doc__.splitlines()[0])
    parser.add_argument("--triton-url", default="localhost:8001",
                        help="Triton gRPC endpoint HOST:PORT (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for each Triton response (default: %(default)s)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    import uvicorn  # noqa: PLC0415

    uvicorn.run(create_app(args.triton_url, timeout_s=args.timeout), host=args.host,
                port=args.port, log_level=args.log_level)
    return 0

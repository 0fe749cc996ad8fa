"""omni-openai: an OpenAI-compatible HTTP server in front of a running tritonserver.

Runs as its own process (FastAPI + uvicorn) and talks to Triton over gRPC
through omni_client's AsyncOmniClient: requests are validated here
(protocol.py), run as omni_client calls, and answered in OpenAI's shapes
(responses.py).
Model names are the server's entry models (GET /v1/models). The web demo
(static/) is served at `/`.

    omni-openai --triton-url localhost:8001 --host 127.0.0.1 --port 9000
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from omni_client import AsyncOmniClient, ModelInfo
from omni_client.errors import OmniClientError
from omni_client.media import encode_audio
from omni_client.openai_server import media_urls
from omni_client.openai_server import protocol as p
from omni_client.openai_server import realtime as rt
from omni_client.openai_server.responses import (
    ChatCompletion,
    as_openai_error,
    chat_stream,
    speech_stream,
)
from omni_client.types import AudioChunk, Event
from omni_serve.metrics_table import OpenAIMetrics

log = logging.getLogger("omni_openai")

STATIC_DIR = Path(__file__).parent / "static"
_MODELS_TTL_S = 5.0


class Frontend:
    """The state of one omni-openai process: its Triton client and its metrics."""

    def __init__(self, triton_url: str, *, timeout_s: float | None):
        self.triton_url = triton_url
        self.timeout_s = timeout_s
        self.client: AsyncOmniClient | None = None
        self._models: tuple[float, list[ModelInfo]] = (0.0, [])
        self.registry = CollectorRegistry()
        requests, latency = OpenAIMetrics.REQUESTS, OpenAIMetrics.REQUEST_SECONDS
        # prometheus_client adds the counter's _total itself
        self.requests = Counter(requests.name.removesuffix("_total"), requests.help,
                                list(requests.labels), registry=self.registry)
        self.latency = Histogram(latency.name, latency.help, list(latency.labels),
                                 registry=self.registry, buckets=latency.buckets)
        self.realtime = rt.RealtimeMetrics(self.registry)

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


def create_app(triton_url: str, *, timeout_s: float | None = 120.0,
               realtime: rt.RealtimeSettings | None = None,
               media: media_urls.MediaURLSettings | None = None) -> FastAPI:
    """The FastAPI app serving the OpenAI API for the Triton server at `triton_url` (gRPC).

    `media`: which video URLs besides data: URLs it reads (default: none)."""
    front = Frontend(triton_url, timeout_s=timeout_s)
    media = media or media_urls.MediaURLSettings()
    hub = rt.RealtimeHub(realtime or rt.RealtimeSettings(), front.realtime)

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
        return await _openai_error(request, as_openai_error(exc))

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
            if turn.video_url is not None:
                turn.video = await media_urls.read_media_url(turn.video_url, turn.video_param,
                                                             media)
            inputs = _omni_context(body)
            events = front.client.stream(
                turn.text, model=info.name, image=turn.image, audio=turn.audio,
                video=turn.video, use_audio_in_video=body.use_audio_in_video(),
                modalities=["text", "audio"] if audio else ["text"],
                sampling_parameters=body.sampling_parameters(),
                voice=body.audio.voice if audio else None, seed=body.seed,
                **_talker_options(body, audio), **inputs)
        else:
            if audio:
                raise p.OpenAIError(400, f"model {info.name!r} produces text only; use an omni "
                                         "pipeline for audio", param="modalities")
            turn = p.user_turn(body.messages)
            if turn.has_media or body.use_audio_in_video():
                raise p.OpenAIError(400, "this model reads text only; send images, audio and "
                                         "video to an omni pipeline", param="messages")
            # the chat, rendered by the model's chat template in the llm stage
            events = front.client.stream(turn.text, model=info.name,
                                         history=p.history(body.messages, allow_system=True),
                                         sampling_parameters=body.sampling_parameters())
        completion = ChatCompletion(body, audio)
        first, rest = await _first_and_rest(events)
        front.latency.labels("/v1/chat/completions").observe(time.perf_counter() - started)
        front.requests.labels("/v1/chat/completions", "200").inc()
        if not body.stream:
            return completion.whole(first + [e async for e in rest])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(chat_stream(completion, first, rest, include_usage),
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
                                     voice=body.voice, seed=body.seed,
                                     talker_sampling=body.talker_sampling_parameters,
                                     stream_audio=body.stream_audio)
        first, rest = await _first_and_rest(events)
        front.requests.labels("/v1/audio/speech", "200").inc()
        media = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}[fmt]
        if body.sent_whole():  # a file whose header has its length needs every sample first
            chunks = [e for e in first + [e async for e in rest] if isinstance(e, AudioChunk)]
            if not chunks:
                raise p.OpenAIError(500, "the pipeline sent no audio", type_="server_error")
            samples = np.concatenate([c.samples for c in chunks])
            return Response(encode_audio(samples, chunks[0].sample_rate, fmt), media_type=media)
        return StreamingResponse(speech_stream(first, rest, fmt), media_type=media)

    # --- realtime (WebSocket) ----------------------------------------------------------

    @app.websocket("/v1/realtime")
    async def realtime_session(websocket: WebSocket, model: str | None = None):
        await rt.serve(websocket, hub, front, model)

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
    turns = p.history(body.messages, allow_system=False, audio=True)
    return {"history": turns or None, "session_id": body.user}


def _talker_options(body: p.ChatRequest, audio: bool) -> dict[str, Any]:
    """The speech extensions of a chat request (sent only when it asks for audio)."""
    if not audio:
        return {}
    return {"talker_sampling": body.talker_sampling_parameters,
            "stream_audio": body.stream_audio, "return_codec_ids": body.return_codec_ids}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-openai", description=__doc__.splitlines()[0])
    parser.add_argument("--triton-url", default="localhost:8001",
                        help="Triton gRPC endpoint HOST:PORT (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for each Triton response (default: %(default)s)")
    parser.add_argument("--log-level", default="info")
    rt.add_arguments(parser)
    media_urls.add_arguments(parser)
    args = parser.parse_args(argv)
    import uvicorn

    try:
        media = media_urls.MediaURLSettings.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    app = create_app(args.triton_url, timeout_s=args.timeout,
                     realtime=rt.RealtimeSettings.from_args(args), media=media)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0

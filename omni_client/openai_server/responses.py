"""OpenAI response bodies of omni-openai: chat completions, their SSE chunks, streamed speech.

Runs in the omni-openai process. Turns omni_client events (TextDelta,
AudioChunk, CodecIds, Final) into OpenAI's JSON objects: a whole
`chat.completion`, or `chat.completion.chunk`s as server-sent events; streamed
speech as PCM16 (behind an open-ended WAV header for "wav"). Every audio byte
comes from omni_client.media's encoder (16-bit PCM WAV).
"""
from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from omni_client.errors import (
    BadRequestError,
    CancelledError,
    OmniClientError,
    RequestTimeoutError,
    UnavailableError,
)
from omni_client.media import encode_audio, streaming_wav_header
from omni_client.openai_server import protocol as p
from omni_client.types import AudioChunk, CodecIds, Event, Final, TextDelta, Usage


def status_of(exc: OmniClientError) -> tuple[int, str]:
    if isinstance(exc, BadRequestError):
        return 400, "invalid_request_error"
    if isinstance(exc, UnavailableError):
        return 503, "service_unavailable"
    if isinstance(exc, RequestTimeoutError):
        return 504, "timeout"
    if isinstance(exc, CancelledError):
        return 499, "cancelled"
    return 500, "server_error"


def as_openai_error(exc: OmniClientError) -> p.OpenAIError:
    status, type_ = status_of(exc)
    return p.OpenAIError(status, exc.message, type_=type_)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage_of(usage: Usage | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def pcm16(samples: np.ndarray) -> bytes:
    return encode_audio(samples, 24000, "pcm")  # the rate is not used for raw PCM


class ChatCompletion:
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
                              "data": base64.b64encode(pcm16(event.samples)).decode()}}
        if isinstance(event, CodecIds) and self.audio and event.frames:
            return {"audio": {"id": self.audio_id, "codec_ids": event.frames}}
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
            data = (pcm16(samples) if fmt == "pcm16" else encode_audio(samples, rate, fmt))
            message["content"] = None  # OpenAI: with audio out, the text is the transcript
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(data).decode(),
                                "expires_at": self.created + 3600, "transcript": text}
            if self.body.return_codec_ids:  # extension
                message["audio"]["codec_ids"] = [f for e in events if isinstance(e, CodecIds)
                                                 for f in e.frames]
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.body.model,
                "choices": [{"index": 0, "message": message,
                             "finish_reason": p.finish_reason(final.finish_reason)}],
                "usage": usage_of(final.usage)}


async def chat_stream(completion: ChatCompletion, first: list[Event], rest: AsyncIterator[Event],
                       include_usage: bool) -> AsyncIterator[bytes]:
    yield sse(completion.chunk({"role": "assistant", "content": None if completion.audio else ""}))
    final: Final | None = None
    try:
        async for event in chain(first, rest):
            if isinstance(event, Final):
                final = event
                continue
            delta = completion.delta(event)
            if delta is not None:
                yield sse(completion.chunk(delta))
    except OmniClientError as exc:  # mid-stream: the status line is gone, say it in the stream
        yield sse(as_openai_error(exc).body())
        yield sse("[DONE]")
        return
    reason = p.finish_reason(final.finish_reason if final else None)
    yield sse(completion.chunk({}, reason))
    if include_usage:
        chunk = completion.chunk({}, None)
        chunk["choices"] = []
        chunk["usage"] = usage_of(final.usage if final else None)
        yield sse(chunk)
    yield sse("[DONE]")


async def speech_stream(first: list[Event], rest: AsyncIterator[Event],
                         fmt: str) -> AsyncIterator[bytes]:
    header_sent = False
    async for event in chain(first, rest):
        if isinstance(event, AudioChunk):
            if fmt == "wav" and not header_sent:
                yield streaming_wav_header(event.sample_rate)
                header_sent = True
            yield pcm16(event.samples)


async def chain(first: list[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    for event in first:
        yield event
    async for event in rest:
        yield event

"""One realtime response: the pipeline's stream as OpenAI's response events.

Runs in the omni-openai process, as its own asyncio task. The stream (one
AsyncOmniClient call on the whole conversation) is read inside `aclosing`, so
cancelling the task closes the gRPC stream and Triton aborts every stage of the
request. Events go out through `emit`, which only queues (no await between an
event's making and its sending), so a cancel never cuts one in half; once
cancelled, the response only closes its item, part and itself. The assistant
item keeps the text that was sent.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Literal, Protocol

from omni_client.errors import OmniClientError
from omni_client.openai_server.realtime import server_events as ev
from omni_client.openai_server.realtime.audio import output_pcm16
from omni_client.openai_server.realtime.config import PCM, ResponseOptions
from omni_client.openai_server.realtime.conversation import Conversation, Item
from omni_client.openai_server.responses import status_of
from omni_client.types import AudioChunk, Event, Final, TextDelta, Usage

log = logging.getLogger(__name__)

Status = Literal["completed", "cancelled", "incomplete", "failed"]
CancelReason = Literal["turn_detected", "client_cancelled"]


class Hooks(Protocol):
    """What a response reports to the session's metrics."""

    def first_audio(self, seconds: float) -> None: ...

    def turn(self, status: str) -> None: ...


class ResponseRun:
    """A response being made; `start()` runs it, `cancel()` stops it."""

    def __init__(self, options: ResponseOptions, conversation: Conversation,
                 stream: Callable[[], AsyncIterator[Event]], emit: Callable[[dict], None],
                 hooks: Hooks, *, turn_end: float, conversation_id: str):
        self.options = options
        self.id = ev.new_id("resp")
        self.item = Item("assistant", status="in_progress", spoken=options.modality == "audio")
        self._conversation = conversation
        self._stream = stream
        self._emit = emit
        self._hooks = hooks
        self._turn_end = turn_end
        self._conversation_id = conversation_id
        self._text: list[str] = []
        self._audio_sent = False
        self._previous: str | None = None
        self.cancel_reason: CancelReason | None = None
        self.task: asyncio.Task | None = None

    # --- control -----------------------------------------------------------------------

    def start(self) -> asyncio.Task:
        self.task = asyncio.create_task(self._run(), name=self.id)
        return self.task

    async def cancel(self, reason: CancelReason) -> None:
        """Stop the response (its stages are aborted) and wait until it is closed."""
        if self.task is None or self.task.done():
            return
        self.cancel_reason = reason
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    # --- run ---------------------------------------------------------------------------

    async def _run(self) -> None:
        self._open()
        usage: Usage | None = None
        status: Status = "completed"
        try:
            async with aclosing(self._stream()) as events:
                async for event in events:
                    if isinstance(event, Final):
                        usage = event.usage
                        status = "incomplete" if event.finish_reason == "length" else "completed"
                    else:
                        self._forward(event)
        except asyncio.CancelledError:
            self._close("cancelled", usage, {"type": "cancelled", "reason": self.cancel_reason})
            return
        except OmniClientError as exc:
            log.info("realtime response %s failed: %s", self.id, exc.message)
            self._fail(status_of(exc)[1], exc.message, usage)
            return
        except Exception:  # a bug here must still end the response for the client
            log.exception("realtime response %s failed", self.id)
            self._fail("server_error", "the server failed while answering", usage)
            return
        details = {"type": "incomplete", "reason": "max_output_tokens"} \
            if status == "incomplete" else None
        self._close(status, usage, details)

    def _fail(self, type_: str, message: str, usage: Usage | None) -> None:
        self._emit(ev.event("error", error={"type": type_, "code": None, "message": message,
                                            "param": None, "event_id": None}))
        self._close("failed", usage, {"type": "failed", "error": {
            "type": type_, "code": None, "message": message}})

    def _open(self) -> None:
        self._emit(ev.response_created(self.openai("in_progress", None, None)))
        self._previous = self._conversation.add(self.item)
        self._emit(ev.output_item_added(self.id, self.item.openai()))
        self._emit(ev.item_added(self.item.openai(), self._previous))
        self._emit(ev.content_part_added(self.id, self.item.id, self._part()))

    def _forward(self, event: Event) -> None:
        if isinstance(event, TextDelta) and event.text:
            self._text.append(event.text)
            make = ev.transcript_delta if self.item.spoken else ev.text_delta
            self._emit(make(self.id, self.item.id, event.text))
        elif isinstance(event, AudioChunk) and self.item.spoken and event.samples.size:
            if not self._audio_sent:
                self._audio_sent = True
                self._hooks.first_audio(time.perf_counter() - self._turn_end)
            pcm = output_pcm16(event.samples, event.sample_rate)
            self._emit(ev.audio_delta(self.id, self.item.id, base64.b64encode(pcm).decode()))

    def _close(self, status: Status, usage: Usage | None, details: dict | None) -> None:
        text = "".join(self._text)
        if self.item.spoken:
            self._emit(ev.audio_done(self.id, self.item.id))
            self._emit(ev.transcript_done(self.id, self.item.id, text))
        else:
            self._emit(ev.text_done(self.id, self.item.id, text))
        self.item.parts = [("text", text)]
        self.item.status = "completed" if status == "completed" else "incomplete"
        self._emit(ev.content_part_done(self.id, self.item.id, self._part()))
        self._emit(ev.output_item_done(self.id, self.item.openai()))
        self._emit(ev.item_done(self.item.openai(), self._previous))
        self._emit(ev.response_done(self.openai(status, details, usage)))
        self._hooks.turn(status)

    # --- shapes --------------------------------------------------------------------------

    def _part(self) -> dict[str, Any]:
        text = "".join(self._text)
        return {"type": "audio", "transcript": text} if self.item.spoken \
            else {"type": "text", "text": text}

    def openai(self, status: str, details: dict | None, usage: Usage | None) -> dict[str, Any]:
        """The response as OpenAI's `response` object."""
        done = status != "in_progress"
        return {
            "id": self.id, "object": "realtime.response", "status": status,
            "status_details": details, "conversation_id": self._conversation_id,
            "output": [self.item.openai()] if done else [],
            "output_modalities": [self.options.modality],
            "audio": {"output": {"format": PCM, "voice": self.options.voice}},
            "max_output_tokens": self.options.max_tokens or "inf",
            "metadata": self.options.metadata,
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens},
        }

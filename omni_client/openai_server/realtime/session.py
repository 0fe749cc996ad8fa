"""One realtime session: client events in, server events out, one response at a time.

Runs in the omni-openai process, in the WebSocket's task (endpoint.py). `handle`
takes one client message; every server event goes through `emit` (a queue the
endpoint drains to the socket). A bad event is answered with an `error` event
naming the field and the offending event's id, and the session goes on.
`cancel_response` stops the running response (its stages are aborted, its
item keeps what was sent): `response.cancel`, a closed socket and barge-in
(server VAD's speech start during a response) call it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from omni_client.openai_server.realtime import client_events as ce
from omni_client.openai_server.realtime import server_events as ev
from omni_client.openai_server.realtime.audio import (
    WIRE_RATE,
    AudioDecodeError,
    decode_pcm16,
    duration_ms,
)
from omni_client.openai_server.realtime.client_events import RealtimeError
from omni_client.openai_server.realtime.config import SessionConfig
from omni_client.openai_server.realtime.conversation import Conversation, Item, item_from_client
from omni_client.openai_server.realtime.metrics import SessionMetrics
from omni_client.openai_server.realtime.response import CancelReason, ResponseRun
from omni_client.openai_server.realtime.settings import RealtimeSettings
from omni_client.types import Event

log = logging.getLogger(__name__)

# (text, keyword options of AsyncOmniClient.stream) -> the events of one call
StreamCall = Callable[..., AsyncIterator[Event]]
BYTES_PER_MS = WIRE_RATE * 2 // 1000


class RealtimeSession:
    """The state of one realtime connection.

    Args:
        config: the session's starting configuration (its model).
        stream: AsyncOmniClient.stream (or a stand-in with its signature).
        emit: queues one server event for the socket.
    """

    def __init__(self, config: SessionConfig, stream: StreamCall, emit: Callable[[dict], None],
                 settings: RealtimeSettings, metrics: SessionMetrics):
        self.config = config
        self.conversation = Conversation()
        self.conversation_id = ev.new_id("conv")
        self._stream = stream
        self._emit = emit
        self._settings = settings
        self._metrics = metrics
        self._buffer = bytearray()
        self._buffer_start_ms = 0  # where the buffer starts in the session's input audio
        self._committed_at: tuple[str, float] | None = None  # (item id, when)
        self.response: ResponseRun | None = None
        self._vad: Any = None
        self._vad_origin_ms = 0
        self._speech_item: str | None = None

    def open(self) -> None:
        self._emit(ev.session_created(self.config.openai()))

    @property
    def busy(self) -> bool:
        """Whether a response is running."""
        return self.response is not None and not self.response.task.done()

    async def handle(self, message: str | bytes) -> None:
        """Act on one client message."""
        event_id = None
        try:
            event = ce.parse(message)
            event_id = event.event_id
            await self._dispatch(event)
        except RealtimeError as exc:
            exc.event_id = exc.event_id or event_id
            self._emit(ev.error(exc))

    async def _dispatch(self, event: ce.ClientEvent) -> None:
        if isinstance(event, ce.SessionUpdate):
            self._update(event.session)
        elif isinstance(event, ce.BufferAppend):
            await self._append(event.audio)
        elif isinstance(event, ce.BufferCommit):
            self._commit()
        elif isinstance(event, ce.BufferClear):
            self._clear()
        elif isinstance(event, ce.ItemCreate):
            self._create_item(event)
        elif isinstance(event, ce.ResponseCreate):
            self._respond(event.response)
        elif isinstance(event, ce.ResponseCancel):
            await self._cancel(event.response_id)

    # --- session -----------------------------------------------------------------------

    def _update(self, patch: ce.SessionPatch) -> None:
        config = self.config.updated(patch)
        if config.turn_detection != self.config.turn_detection:
            self._vad = _server_vad(config.turn_detection)
            # the VAD's clock starts now; ours at the session's first audio
            self._vad_origin_ms = self._buffer_start_ms + duration_ms(bytes(self._buffer))
            self._speech_item = None
        self.config = config
        self._emit(ev.session_updated(config.openai()))

    # --- input audio buffer --------------------------------------------------------------

    async def _append(self, data: str) -> None:
        try:
            pcm = decode_pcm16(data)
        except AudioDecodeError as exc:
            raise RealtimeError(str(exc), param="audio", code="invalid_value") from None
        limit = self._settings.max_buffer_bytes
        if len(self._buffer) + len(pcm) > limit:
            raise RealtimeError(f"the input audio buffer would hold {len(self._buffer) + len(pcm)} "
                                f"bytes; at most {limit} are allowed (--realtime-max-buffer-bytes)"
                                "; commit or clear it", param="audio",
                                code="input_audio_buffer_full")
        self._buffer += pcm
        if self._vad is not None:
            for vad_event in self._vad.feed(pcm):
                await self._on_vad(vad_event)

    def _commit(self, upto: int | None = None) -> None:
        pcm = bytes(self._buffer if upto is None else self._buffer[:upto])
        if not pcm:
            raise RealtimeError("the input audio buffer is empty: append audio before committing",
                                param="input_audio_buffer", code="input_audio_buffer_commit_empty")
        item = Item("user", [("audio", pcm)], id=self._speech_item or ev.new_id("item"))
        self._speech_item = None
        self._drop_buffer(len(pcm))
        previous = self.conversation.add(item)
        self._committed_at = (item.id, time.perf_counter())
        self._emit(ev.buffer_committed(item.id, previous))
        self._emit(ev.item_added(item.openai(), previous))
        self._emit(ev.item_done(item.openai(), previous))

    def _clear(self) -> None:
        self._drop_buffer(len(self._buffer))
        if self._vad is not None:
            self._vad.reset()
        self._speech_item = None
        self._emit(ev.buffer_cleared())

    def _drop_buffer(self, n: int) -> None:
        self._buffer_start_ms += duration_ms(bytes(self._buffer[:n]))
        del self._buffer[:n]

    # --- server VAD ----------------------------------------------------------------------

    async def _on_vad(self, vad_event: Any) -> None:
        detection = self.config.turn_detection or {}
        at_ms = self._vad_origin_ms + vad_event.audio_ms  # in the session's input audio
        in_buffer = min(len(self._buffer), max(0, at_ms - self._buffer_start_ms) * BYTES_PER_MS)
        if vad_event.kind == "speech_started":
            self._drop_buffer(in_buffer)  # the buffer starts with the speech's prefix padding
            self._speech_item = ev.new_id("item")
            self._emit(ev.speech_started(self._speech_item, at_ms))
            if detection.get("interrupt_response", True):
                await self.cancel_response("turn_detected")
        elif vad_event.kind == "speech_stopped" and self._speech_item is not None:
            self._emit(ev.speech_stopped(self._speech_item, at_ms))
            self._commit(in_buffer or None)
            if detection.get("create_response", True) and not self.busy:
                self._respond(None)

    # --- conversation ------------------------------------------------------------------

    def _create_item(self, event: ce.ItemCreate) -> None:
        if event.item.role == "system" and not self.config.system_turn:
            raise RealtimeError(f"model {self.config.model!r} sets its own system prompt (in its "
                                "pipeline spec); add user and assistant items only",
                                param="item.role", code="invalid_value")
        item = item_from_client(event.item, self._settings.max_buffer_bytes)
        previous = self.conversation.add(item, event.previous_item_id)
        self._emit(ev.item_added(item.openai(), previous))
        self._emit(ev.item_done(item.openai(), previous))

    # --- responses -----------------------------------------------------------------------

    def _respond(self, patch: ce.ResponsePatch | None) -> None:
        if self.busy:
            raise RealtimeError(f"response {self.response.id} is running: wait for its "
                                "response.done or cancel it", param="response",
                                code="conversation_already_has_active_response")
        options = self.config.response_options(patch)
        turn = self.conversation.turn(audio_prompt=self._settings.audio_prompt,
                                      system=options.instructions or None,
                                      max_audio=self._settings.max_audio_turns,
                                      truncate=self.config.truncation == "auto")
        last = self.conversation.items[-1].id
        committed = self._committed_at
        turn_end = committed[1] if committed and committed[0] == last else time.perf_counter()
        kwargs: dict[str, Any] = {"model": self.config.model, "history": turn.history or None,
                                  "sampling_parameters": self.config.sampling(options) or None}
        if self.config.audio_out:  # an omni pipeline
            speak = options.modality == "audio"
            kwargs.update(audio=turn.audio_wav, modalities=["text", "audio"] if speak else ["text"],
                          voice=options.voice if speak else None, seed=self.config.seed,
                          session_id=self.config.id,
                          talker_sampling=self.config.talker_sampling if speak else None)
        elif turn.has_audio:
            raise RealtimeError(f"model {self.config.model!r} reads text only",
                                param="input_audio", code="invalid_value")
        self.response = ResponseRun(options, self.conversation,
                                    lambda: self._stream(turn.text, **kwargs), self._emit,
                                    self._metrics, turn_end=turn_end,
                                    conversation_id=self.conversation_id)
        self.response.start()

    async def _cancel(self, response_id: str | None) -> None:
        if not self.busy:
            raise RealtimeError("no response is running", param="response_id",
                                code="response_cancel_not_active")
        if response_id is not None and response_id != self.response.id:
            raise RealtimeError(f"response {response_id!r} is not the running one "
                                f"({self.response.id})", param="response_id",
                                code="invalid_value")
        await self.cancel_response("client_cancelled")

    async def cancel_response(self, reason: CancelReason = "turn_detected") -> bool:
        """Cancel the running response, if any; True when one was cancelled."""
        if not self.busy:
            return False
        await self.response.cancel(reason)
        self._metrics.interruption(reason)
        return True

    async def close(self) -> None:
        """The socket is gone: cancel whatever runs."""
        if self.busy:
            await self.response.cancel("client_cancelled")
            self._metrics.interruption("disconnected")


def _server_vad(detection: dict[str, Any] | None) -> Any:
    """The VAD of a server_vad turn detection (None: turn detection off).

    Raises:
        RealtimeError: this server has no VAD.
    """
    if detection is None:
        return None
    try:
        from omni_client.openai_server.realtime.vad import ServerVad
    except ImportError as exc:
        raise RealtimeError(f"server_vad is not available on this server ({exc}); set "
                            "turn_detection to null and commit the audio buffer",
                            param="session.audio.input.turn_detection",
                            code="invalid_value") from None
    return ServerVad(threshold=detection["threshold"],
                     prefix_padding_ms=detection["prefix_padding_ms"],
                     silence_duration_ms=detection["silence_duration_ms"])

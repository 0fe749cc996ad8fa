"""The `/v1/realtime` WebSocket: one session per socket, its limits, its writer.

Runs in the omni-openai process, one task per socket (FastAPI's WebSocket). The
socket is accepted, refused with an `error` event and closed when the server
holds --realtime-max-sessions already or the model is not one it serves, else
a RealtimeSession reads its messages until the client leaves, the session has
been idle for --realtime-idle-timeout-s (no client event, no response running)
or open for --realtime-max-session-s. One writer task sends the session's
events in order; leaving cancels the running response.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect

from omni_client.errors import OmniClientError
from omni_client.openai_server import protocol as p
from omni_client.openai_server.realtime import server_events as ev
from omni_client.openai_server.realtime.client_events import RealtimeError
from omni_client.openai_server.realtime.config import SessionConfig
from omni_client.openai_server.realtime.metrics import RealtimeMetrics
from omni_client.openai_server.realtime.session import RealtimeSession
from omni_client.openai_server.realtime.settings import RealtimeSettings
from omni_client.openai_server.responses import as_openai_error

log = logging.getLogger(__name__)

# RFC 6455 close codes
NORMAL, POLICY, TRY_AGAIN_LATER = 1000, 1008, 1013


class Frontend(Protocol):
    """What a session needs of omni-openai's Frontend."""

    client: Any

    async def model(self, name: str | None, kinds: tuple[str, ...], param: str = ...) -> Any: ...


class RealtimeHub:
    """The realtime side of one omni-openai process: its settings, metrics and sessions."""

    def __init__(self, settings: RealtimeSettings, metrics: RealtimeMetrics):
        self.settings = settings
        self.metrics = metrics
        self.open = 0


async def serve(websocket: WebSocket, hub: RealtimeHub, front: Frontend, model: str | None) -> None:
    """Serve one realtime connection to its end."""
    await websocket.accept()
    queue: asyncio.Queue[dict | None] = asyncio.Queue()
    writer = asyncio.create_task(_write(websocket, queue))
    if hub.open >= hub.settings.max_sessions:
        queue.put_nowait(ev.error(RealtimeError(
            f"the server holds {hub.settings.max_sessions} realtime sessions, its limit "
            "(--realtime-max-sessions); try again later", code="session_limit_reached")))
        await _close(websocket, queue, writer, TRY_AGAIN_LATER, "too many sessions")
        return
    try:
        info = await front.model(model, ("omni", "llm"))
    except (p.OpenAIError, OmniClientError) as exc:
        error = exc if isinstance(exc, p.OpenAIError) else as_openai_error(exc)
        queue.put_nowait(ev.error(RealtimeError(error.message, param=error.param,
                                                code=error.code, type_=error.type)))
        await _close(websocket, queue, writer, POLICY, "no such model")
        return
    hub.open += 1
    metrics = hub.metrics.of(info.name)
    metrics.opened()
    config = SessionConfig.create(info.name, audio_out=info.kind == "omni",
                                  system_turn=info.kind == "llm")
    session = RealtimeSession(config, front.client.stream, queue.put_nowait, hub.settings,
                              metrics)
    try:
        session.open()
        reason = await _read(websocket, session, hub.settings, queue)
        if reason is not None:
            await _close(websocket, queue, writer, NORMAL, reason)
    finally:
        await session.close()
        writer.cancel()
        hub.open -= 1
        metrics.closed()


async def _read(websocket: WebSocket, session: RealtimeSession, settings: RealtimeSettings,
                queue: asyncio.Queue) -> str | None:
    """Hand each message to the session; returns why the server ends the session (None:
    the client left)."""
    opened = last = time.monotonic()
    while True:
        now = time.monotonic()
        left = opened + settings.max_session_s - now
        idle_left = last + settings.idle_timeout_s - now
        try:
            message = await asyncio.wait_for(websocket.receive(), max(0.0, min(left, idle_left)))
        except TimeoutError:
            now = time.monotonic()
            if now >= opened + settings.max_session_s:
                queue.put_nowait(ev.error(RealtimeError(
                    f"the session reached its {settings.max_session_s:g} s limit "
                    "(--realtime-max-session-s)", code="session_expired")))
                return "session expired"
            if session.busy:
                last = now  # a running response is not idleness
                continue
            if now >= last + settings.idle_timeout_s:
                queue.put_nowait(ev.error(RealtimeError(
                    f"no client event for {settings.idle_timeout_s:g} s "
                    "(--realtime-idle-timeout-s)", code="idle_timeout")))
                return "idle"
            continue
        if message["type"] == "websocket.disconnect":
            return None
        last = time.monotonic()
        await session.handle(message.get("text") if message.get("text") is not None
                             else message.get("bytes") or b"")


async def _write(websocket: WebSocket, queue: asyncio.Queue) -> None:
    """Send the queued events in order; None ends the writer."""
    while (event := await queue.get()) is not None:
        try:
            await websocket.send_text(json.dumps(event, separators=(",", ":")))
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            log.debug("realtime socket gone: %s", exc)
            return


async def _close(websocket: WebSocket, queue: asyncio.Queue, writer: asyncio.Task, code: int,
                 reason: str) -> None:
    """Send what is queued, then close the socket."""
    queue.put_nowait(None)
    await writer
    with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
        await websocket.close(code, reason)

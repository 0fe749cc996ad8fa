"""The server events of a realtime session, as OpenAI's types define them.

Runs in the omni-openai process, with no I/O: each function returns one event
as a JSON-ready dict with a fresh `event_id` (the openai package's
`RealtimeServerEvent` models validate every one in the tests).
"""
from __future__ import annotations

import uuid
from typing import Any

from omni_client.openai_server.realtime.client_events import RealtimeError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def event(type_: str, **fields: Any) -> dict[str, Any]:
    return {"type": type_, "event_id": new_id("event"), **fields}


def error(exc: RealtimeError) -> dict[str, Any]:
    return event("error", error=exc.body())


# --- session and input buffer ------------------------------------------------------

def session_created(session: dict[str, Any]) -> dict[str, Any]:
    return event("session.created", session=session)


def session_updated(session: dict[str, Any]) -> dict[str, Any]:
    return event("session.updated", session=session)


def buffer_committed(item_id: str, previous_item_id: str | None) -> dict[str, Any]:
    return event("input_audio_buffer.committed", item_id=item_id,
                 previous_item_id=previous_item_id)


def buffer_cleared() -> dict[str, Any]:
    return event("input_audio_buffer.cleared")


def speech_started(item_id: str, audio_start_ms: int) -> dict[str, Any]:
    return event("input_audio_buffer.speech_started", item_id=item_id,
                 audio_start_ms=audio_start_ms)


def speech_stopped(item_id: str, audio_end_ms: int) -> dict[str, Any]:
    return event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=audio_end_ms)


# --- conversation ----------------------------------------------------------------------

def item_added(item: dict[str, Any], previous_item_id: str | None) -> dict[str, Any]:
    return event("conversation.item.added", item=item, previous_item_id=previous_item_id)


def item_done(item: dict[str, Any], previous_item_id: str | None) -> dict[str, Any]:
    return event("conversation.item.done", item=item, previous_item_id=previous_item_id)


# --- responses ---------------------------------------------------------------------------

def response_created(response: dict[str, Any]) -> dict[str, Any]:
    return event("response.created", response=response)


def response_done(response: dict[str, Any]) -> dict[str, Any]:
    return event("response.done", response=response)


def output_item_added(response_id: str, item: dict[str, Any]) -> dict[str, Any]:
    return event("response.output_item.added", response_id=response_id, output_index=0,
                 item=item)


def output_item_done(response_id: str, item: dict[str, Any]) -> dict[str, Any]:
    return event("response.output_item.done", response_id=response_id, output_index=0,
                 item=item)


def _part_event(type_: str, response_id: str, item_id: str, **fields: Any) -> dict[str, Any]:
    return event(type_, response_id=response_id, item_id=item_id, output_index=0,
                 content_index=0, **fields)


def content_part_added(response_id: str, item_id: str, part: dict[str, Any]) -> dict[str, Any]:
    return _part_event("response.content_part.added", response_id, item_id, part=part)


def content_part_done(response_id: str, item_id: str, part: dict[str, Any]) -> dict[str, Any]:
    return _part_event("response.content_part.done", response_id, item_id, part=part)


def audio_delta(response_id: str, item_id: str, b64: str) -> dict[str, Any]:
    return _part_event("response.output_audio.delta", response_id, item_id, delta=b64)


def audio_done(response_id: str, item_id: str) -> dict[str, Any]:
    return _part_event("response.output_audio.done", response_id, item_id)


def transcript_delta(response_id: str, item_id: str, text: str) -> dict[str, Any]:
    return _part_event("response.output_audio_transcript.delta", response_id, item_id,
                       delta=text)


def transcript_done(response_id: str, item_id: str, transcript: str) -> dict[str, Any]:
    return _part_event("response.output_audio_transcript.done", response_id, item_id,
                       transcript=transcript)


def text_delta(response_id: str, item_id: str, text: str) -> dict[str, Any]:
    return _part_event("response.output_text.delta", response_id, item_id, delta=text)


def text_done(response_id: str, item_id: str, text: str) -> dict[str, Any]:
    return _part_event("response.output_text.done", response_id, item_id, text=text)

"""The client events of a realtime session, parsed and checked.

Runs in the omni-openai process, with no I/O. `parse` turns one WebSocket text
message into a pydantic model of the events we serve; anything else (bad JSON,
an unknown or unsupported type, a field of the wrong shape or value) raises
RealtimeError naming the field, which the session answers with an `error`
event and goes on. Fields OpenAI defines that change nothing here are taken
as long as they ask for the default (e.g. `tools: []`).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class RealtimeError(Exception):
    """An error answered as the `error` server event (OpenAI's `RealtimeError`)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", event_id: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.type = message, param, code, type_
        self.event_id = event_id

    def body(self) -> dict[str, Any]:
        return {"type": self.type, "code": self.code, "message": self.message,
                "param": self.param, "event_id": self.event_id}


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- session configuration -----------------------------------------------------------

class AudioFormat(_Event):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: int | None = None


class TurnDetection(_Event):
    type: Literal["server_vad", "semantic_vad"]
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    prefix_padding_ms: int | None = Field(default=None, ge=0)
    silence_duration_ms: int | None = Field(default=None, ge=0)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None


class AudioInputConfig(_Event):
    format: AudioFormat | None = None
    turn_detection: TurnDetection | None = None
    transcription: None = None  # no input transcription model
    noise_reduction: None = None


class AudioOutputConfig(_Event):
    format: AudioFormat | None = None
    voice: str | None = None
    speed: float | None = None


class AudioConfig(_Event):
    input: AudioInputConfig | None = None
    output: AudioOutputConfig | None = None


Modalities = list[Literal["text", "audio"]]


class SessionPatch(_Event):
    """`session.update`'s session: the fields given change, the rest stay."""

    type: Literal["realtime"] | None = None
    model: str | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    audio: AudioConfig | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    tracing: Literal["auto"] | dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # extensions: the seed of every response (thinker, talker and audio decoder), the
    # thinker's temperature (0: greedy) and the talker's sampling fields (what
    # /v1/chat/completions takes under these names)
    seed: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    talker_sampling_parameters: dict[str, Any] | None = None


# --- conversation items ----------------------------------------------------------------

class ContentIn(_Event):
    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text"]
    text: str | None = None
    audio: str | None = None  # base64 PCM16 24 kHz
    transcript: str | None = None


class ItemIn(_Event):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[ContentIn] = Field(min_length=1)
    id: str | None = Field(default=None, max_length=64)
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


# --- responses ---------------------------------------------------------------------------

class ResponseAudioOutput(_Event):
    format: AudioFormat | None = None
    voice: str | None = None


class ResponseAudio(_Event):
    output: ResponseAudioOutput | None = None


class ResponsePatch(_Event):
    """`response.create`'s response: overrides of the session for this response."""

    conversation: Literal["auto"] | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    audio: ResponseAudio | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["auto", "none"] | None = None


# --- the events ------------------------------------------------------------------------

class SessionUpdate(_Event):
    type: Literal["session.update"]
    event_id: str | None = None
    session: SessionPatch


class BufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    event_id: str | None = None
    audio: str


class BufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]
    event_id: str | None = None


class BufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]
    event_id: str | None = None


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    event_id: str | None = None
    previous_item_id: str | None = None
    item: ItemIn


class ResponseCreate(_Event):
    type: Literal["response.create"]
    event_id: str | None = None
    response: ResponsePatch | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    event_id: str | None = None
    response_id: str | None = None


ClientEvent = Annotated[SessionUpdate | BufferAppend | BufferCommit | BufferClear | ItemCreate
                        | ResponseCreate | ResponseCancel, Field(discriminator="type")]
_ADAPTER: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
SERVED = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
          "input_audio_buffer.clear", "conversation.item.create", "response.create",
          "response.cancel")
# OpenAI client events this server does not serve (an error names them)
NOT_SERVED = ("conversation.item.retrieve", "conversation.item.truncate",
              "conversation.item.delete", "output_audio_buffer.clear")


def parse(message: str | bytes) -> ClientEvent:
    """One client event from a WebSocket message.

    Raises:
        RealtimeError: not a JSON object, an unknown or unsupported `type`, or
            a field that does not validate (`param` names it, `event_id` is
            the event's when it has one).
    """
    try:
        data = json.loads(message)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RealtimeError(f"the message is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RealtimeError("a client event is a JSON object with a `type`", param="type")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    if kind in NOT_SERVED:
        raise RealtimeError(f"{kind} is not supported by this server; events served: "
                            f"{', '.join(SERVED)}", param="type", code="unsupported_event",
                            event_id=event_id)
    if kind not in SERVED:
        raise RealtimeError(f"unknown event type {kind!r}; events served: {', '.join(SERVED)}",
                            param="type", code="invalid_value", event_id=event_id)
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise _invalid(exc, event_id) from None


def _invalid(exc: ValidationError, event_id: str | None) -> RealtimeError:
    first = exc.errors()[0]
    # the discriminator's tag is the first element of the location
    loc = [str(x) for x in first.get("loc", ())][1:]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return RealtimeError(f"unknown parameter {param}", param=param, code="unknown_parameter",
                             event_id=event_id)
    return RealtimeError(f"{param}: {first.get('msg', 'invalid value')}", param=param,
                         code="invalid_value", event_id=event_id)

"""A realtime session's configuration: `session.update` applied, `response.create` overrides.

Runs in the omni-openai process, with no I/O. What can be set is what the omni
pipeline can do: one output modality (["audio"]: speech and its transcript,
["text"]: text only), PCM16 at 24 kHz in and out, a voice (the pipeline maps
OpenAI's voice names, as /v1/chat/completions does), turn detection off or
server VAD, and instructions where the model takes a system turn (an omni
pipeline sets its own system prompt in its spec). Anything else is a
RealtimeError naming the field; a refused update changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from omni_client.openai_server.realtime.audio import WIRE_RATE
from omni_client.openai_server.realtime.client_events import (
    AudioFormat,
    RealtimeError,
    ResponsePatch,
    SessionPatch,
    TurnDetection,
)
from omni_client.openai_server.realtime.server_events import new_id

Modality = Literal["text", "audio"]
PCM = {"type": "audio/pcm", "rate": WIRE_RATE}
# OpenAI's server_vad defaults
VAD_DEFAULTS = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                "create_response": True, "interrupt_response": True}


@dataclass(frozen=True)
class ResponseOptions:
    """What one response asks of the pipeline."""

    modality: Modality
    voice: str | None
    instructions: str
    max_tokens: int | None
    metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class SessionConfig:
    """The session as the client configured it.

    Attributes:
        model: the entry model (the connection's `?model=`).
        audio_out: the model speaks (an omni pipeline); else text only.
        system_turn: the model takes instructions as a system turn.
    """

    model: str
    audio_out: bool
    system_turn: bool
    id: str = field(default_factory=lambda: new_id("sess"))
    instructions: str = ""
    modality: Modality = "audio"
    voice: str | None = None
    turn_detection: dict[str, Any] | None = None
    max_output_tokens: int | Literal["inf"] = "inf"
    seed: int | None = None
    temperature: float | None = None
    talker_sampling: dict[str, Any] | None = None
    # "auto": past the audio-turn limit a response leaves out the oldest turns (Conversation)
    truncation: Literal["auto", "disabled"] = "auto"

    @classmethod
    def create(cls, model: str, *, audio_out: bool, system_turn: bool) -> SessionConfig:
        return cls(model, audio_out, system_turn, modality="audio" if audio_out else "text")

    def updated(self, patch: SessionPatch) -> SessionConfig:
        """This configuration with `patch` applied.

        Raises:
            RealtimeError: a field this server cannot honour (`param` names it).
        """
        changes: dict[str, Any] = {}
        if patch.model is not None and patch.model != self.model:
            raise RealtimeError(f"the session's model is {self.model!r} (the connection's "
                                "?model=); it cannot change", param="session.model",
                                code="invalid_value")
        if patch.instructions is not None:
            changes["instructions"] = self._instructions(patch.instructions,
                                                         "session.instructions")
        if patch.output_modalities is not None:
            changes["modality"] = self._modality(patch.output_modalities,
                                                 "session.output_modalities")
        if patch.max_output_tokens is not None:
            changes["max_output_tokens"] = _max_tokens(patch.max_output_tokens,
                                                       "session.max_output_tokens")
        _no_tools(patch.tools, "session.tools")
        if patch.truncation is not None:
            changes["truncation"] = patch.truncation
        if patch.audio is not None:
            changes.update(self._audio(patch))
        for name in ("seed", "temperature", "talker_sampling_parameters"):
            if name in patch.model_fields_set:
                changes["talker_sampling" if name.startswith("talker") else name] = \
                    getattr(patch, name)
        return replace(self, **changes)

    def _audio(self, patch: SessionPatch) -> dict[str, Any]:
        changes: dict[str, Any] = {}
        audio_in, audio_out = patch.audio.input, patch.audio.output
        if audio_in is not None:
            _pcm24k(audio_in.format, "session.audio.input.format")
            if "turn_detection" in audio_in.model_fields_set:
                changes["turn_detection"] = _turn_detection(audio_in.turn_detection)
        if audio_out is not None:
            _pcm24k(audio_out.format, "session.audio.output.format")
            if audio_out.speed not in (None, 1.0):
                raise RealtimeError(f"speed must be 1.0 (the audio stage has no time stretch), "
                                    f"got {audio_out.speed}", param="session.audio.output.speed",
                                    code="invalid_value")
            if audio_out.voice is not None:
                changes["voice"] = audio_out.voice
        return changes

    def _instructions(self, text: str, param: str) -> str:
        if text and not self.system_turn:
            raise RealtimeError(f"model {self.model!r} sets its own system prompt (in its "
                                "pipeline spec); instructions cannot be set", param=param,
                                code="invalid_value")
        return text

    def _modality(self, modalities: list[str], param: str) -> Modality:
        if len(modalities) != 1:
            raise RealtimeError(f"output_modalities is ['audio'] (speech and its transcript) or "
                                f"['text'], got {modalities}", param=param, code="invalid_value")
        if modalities[0] == "audio" and not self.audio_out:
            raise RealtimeError(f"model {self.model!r} produces text only", param=param,
                                code="invalid_value")
        return modalities[0]

    def response_options(self, patch: ResponsePatch | None) -> ResponseOptions:
        """The options of one response: the session's, overridden by `patch`.

        Raises:
            RealtimeError: an override this server cannot honour.
        """
        patch = patch or ResponsePatch()
        modality = (self.modality if patch.output_modalities is None
                    else self._modality(patch.output_modalities, "response.output_modalities"))
        instructions = (self.instructions if patch.instructions is None
                        else self._instructions(patch.instructions, "response.instructions"))
        limit = (self.max_output_tokens if patch.max_output_tokens is None
                 else _max_tokens(patch.max_output_tokens, "response.max_output_tokens"))
        _no_tools(patch.tools, "response.tools")
        voice = self.voice
        if patch.audio is not None and patch.audio.output is not None:
            _pcm24k(patch.audio.output.format, "response.audio.output.format")
            voice = patch.audio.output.voice or voice
        return ResponseOptions(modality, voice, instructions,
                               None if limit == "inf" else limit, patch.metadata)

    def sampling(self, options: ResponseOptions) -> dict[str, Any]:
        """The thinker's sampling fields of a response."""
        fields = {"max_tokens": options.max_tokens, "seed": self.seed,
                  "temperature": self.temperature}
        return {k: v for k, v in fields.items() if v is not None}

    def openai(self) -> dict[str, Any]:
        """The session as OpenAI's `session` object."""
        return {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model,
            "output_modalities": [self.modality], "instructions": self.instructions,
            "audio": {"input": {"format": PCM, "transcription": None, "noise_reduction": None,
                                "turn_detection": self.turn_detection},
                      "output": {"format": PCM, "voice": self.voice, "speed": 1.0}},
            "max_output_tokens": self.max_output_tokens, "tools": [], "tool_choice": "auto",
            "tracing": None, "truncation": self.truncation,
        }


def _pcm24k(fmt: AudioFormat | None, param: str) -> None:
    if fmt is None:
        return
    if fmt.type != "audio/pcm" or fmt.rate not in (None, WIRE_RATE):
        got = fmt.type + ("" if fmt.rate is None else f" at {fmt.rate} Hz")
        raise RealtimeError(f"the only audio format is audio/pcm at {WIRE_RATE} Hz (PCM16), "
                            f"got {got}", param=param, code="invalid_value")


def _turn_detection(detection: TurnDetection | None) -> dict[str, Any] | None:
    if detection is None:
        return None
    param = "session.audio.input.turn_detection"
    if detection.type != "server_vad":
        raise RealtimeError(f"turn_detection is null or server_vad, got {detection.type!r}",
                            param=f"{param}.type", code="invalid_value")
    if detection.idle_timeout_ms is not None or detection.eagerness is not None:
        name = "idle_timeout_ms" if detection.idle_timeout_ms is not None else "eagerness"
        raise RealtimeError(f"{name} is not supported", param=f"{param}.{name}",
                            code="invalid_value")
    given = detection.model_dump(exclude_none=True, exclude={"idle_timeout_ms", "eagerness"})
    return {**VAD_DEFAULTS, **given}


def _max_tokens(value: int | str, param: str) -> int | Literal["inf"]:
    if value != "inf" and (not isinstance(value, int) or not 1 <= value <= 4096):
        raise RealtimeError(f"max_output_tokens is an integer in [1, 4096] or 'inf', got {value!r}",
                            param=param, code="invalid_value")
    return value


def _no_tools(tools: list[Any] | None, param: str) -> None:
    if tools:
        raise RealtimeError("tools are not supported by this server", param=param,
                            code="invalid_value")

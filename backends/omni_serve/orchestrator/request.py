"""Requests of the omni entry model (runs in the orchestrator's stub, and in tests).

`parse_request` validates one request's tensors against the pipeline's
config before any stage runs; every problem is a RequestError naming the
input and what is allowed.
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_serve.contract import OMNI
from omni_serve.errors import RequestError
from omni_serve.fields import ChatRules, boolean, integer, json_chat, number, scalar, text
from omni_serve.orchestrator.config import OrchestratorConfig

HISTORY_ROLES = ("user", "assistant")
HISTORY_RULES = ChatRules(
    shape='a JSON array of {"role": "user"|"assistant", "content": "..." or [parts]} objects',
    roles=HISTORY_ROLES, keys=("role", "content"), media_parts=("audio",))
MAX_SESSION_ID_CHARS = 256

# talker_sampling_parameters: each key's kind, its allowed range (low, low
# inclusive, high) and how the range reads in an error. Temperature 0 is greedy;
# top_k 0 or -1 is no top-k. The talker's seed is the request's `seed` input.
TALKER_SAMPLING_KEYS: dict[str, tuple[type, float, bool, float, str]] = {
    "temperature": (float, 0.0, True, 2.0, "a number in [0, 2] (0: greedy)"),
    "top_k": (int, -1, True, 2**31 - 1, "an integer: 0 or -1 (no top-k), or at least 1"),
    "top_p": (float, 0.0, False, 1.0, "a number in (0, 1]"),
    "repetition_penalty": (float, 0.0, False, 2.0, "a number in (0, 2]"),
    "max_tokens": (int, 1, True, 32768, "an integer in [1, 32768]"),
    # codes before the talker may stop (vLLM's min_tokens: stop ids are held back until then)
    "min_tokens": (int, 0, True, 32768, "an integer in [0, 32768]"),
}


@dataclass(frozen=True)
class Turn:
    """One earlier message of the conversation (`history`)."""

    role: str  # "user" or "assistant"
    # the text, or the parts in order: ("text", str) or ("audio", a sound file's bytes)
    content: str | tuple[tuple[str, str | bytes], ...]

    @property
    def audio(self) -> tuple[bytes, ...]:
        """The turn's sound files, in order."""
        if isinstance(self.content, str):
            return ()
        return tuple(value for kind, value in self.content if kind == "audio")


@dataclass
class OmniRequest:
    request_id: str
    text: str
    modalities: tuple[str, ...] = ("text",)
    image: bytes | None = None
    audio: bytes | None = None
    video: bytes | None = None  # a video file: its frames, and its sound per use_audio_in_video
    # hear the video's soundtrack (None: the checkpoint processor's default)
    use_audio_in_video: bool | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    voice: str | None = None
    seed: int | None = None
    task: str = "chat"
    # routes the request to its session's thinker engine (None: the least busy)
    session_id: str | None = None
    # earlier turns, rendered before `text` in the chat template
    history: tuple[Turn, ...] = ()
    # the talker's sampling fields this request sets (keys of
    # TALKER_SAMPLING_KEYS), to merge over OrchestratorConfig.talker_sampling
    talker_sampling: dict[str, Any] = field(default_factory=dict)
    # audio in chunks as it is made (False: the whole utterance in one chunk)
    stream_audio: bool = True
    # also send the talker's codec ids (CodecIds events)
    return_codec_ids: bool = False
    # add the request's timeline to the final metrics
    return_timeline: bool = False

    @property
    def audio_clips(self) -> list[bytes]:
        """Every sound file of the conversation in prompt order: history's, then `audio`."""
        clips = [clip for turn in self.history for clip in turn.audio]
        return clips + ([self.audio] if self.audio is not None else [])

    @property
    def wants_audio(self) -> bool:
        """Whether this request produces speech (task "speech", or "audio" in modalities)."""
        return self.task == "speech" or "audio" in self.modalities


def _media(tensors: dict[str, np.ndarray | None], name: str, cfg: OrchestratorConfig,
           role: str | None) -> bytes | None:
    value = scalar(tensors, name)
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("latin-1")
    data = bytes(value)
    if not data:
        raise RequestError(name, "is empty; send the file's bytes")
    limit, setting = ((cfg.video_limits.max_video_bytes, "max_video_bytes") if name == OMNI.VIDEO
                      else (cfg.max_media_bytes, "max_media_bytes"))
    if len(data) > limit:
        raise RequestError(name, f"is {len(data)} bytes; at most {limit} are allowed ({setting})")
    if role is None and name not in cfg.raw_media:  # else its thinker takes the file
        if name == OMNI.VIDEO:
            raise RequestError(name, f"this pipeline's thinker ({cfg.family}) takes no video")
        raise RequestError(name, f"this pipeline has no {name} encoder stage")
    return data


def _modalities(tensors: dict[str, np.ndarray | None], cfg: OrchestratorConfig) -> tuple[str, ...]:
    arr = tensors.get(OMNI.MODALITIES)
    if arr is None:
        return ("text",)
    items = [text(OMNI.MODALITIES, v) for v in np.asarray(arr).reshape(-1)]
    if len(items) == 1 and items[0].lstrip().startswith("["):  # one JSON array
        try:
            items = json.loads(items[0])
        except json.JSONDecodeError as e:
            raise RequestError(OMNI.MODALITIES, f"invalid JSON ({e.msg})") from e
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise RequestError(OMNI.MODALITIES, "must be a list of strings")
    allowed = cfg.output_modalities
    wanted: list[str] = []
    for item in items:
        name = item.strip().lower()
        if name == "audio" and name not in allowed:
            raise RequestError(OMNI.MODALITIES, f"'audio' needs a talker and an audio_decoder "
                                                f"stage, which this pipeline has not (its "
                                                f"checkpoint lacks the talker or the codec "
                                                f"decoder); it offers {list(allowed)}")
        if name not in allowed:
            raise RequestError(OMNI.MODALITIES, f"unknown or unavailable modality {item!r}; "
                                                f"this pipeline offers {list(allowed)}")
        if name not in wanted:
            wanted.append(name)
    if not wanted:
        raise RequestError(OMNI.MODALITIES, f"must name at least one of {list(allowed)}")
    if "text" not in wanted:  # text is always produced (speech and images derive from it)
        wanted.insert(0, "text")
    return tuple(wanted)


def _task(tensors: dict[str, np.ndarray | None], cfg: OrchestratorConfig) -> str:
    value = text(OMNI.TASK, scalar(tensors, OMNI.TASK))
    task = (value or "chat").strip().lower()
    if task not in OMNI.TASKS:
        raise RequestError(OMNI.TASK, f"unknown task {value!r}; allowed: {list(OMNI.TASKS)}")
    if task == "speech" and not cfg.stages.talker:
        raise RequestError(OMNI.TASK, "this pipeline has no talker to read text aloud")
    return task


def _session_id(tensors: dict[str, np.ndarray | None]) -> str | None:
    value = text(OMNI.SESSION_ID, scalar(tensors, OMNI.SESSION_ID))
    if value is None or not value.strip():  # empty: no session
        return None
    if len(value) > MAX_SESSION_ID_CHARS:
        raise RequestError(OMNI.SESSION_ID, f"is {len(value)} characters; at most "
                                            f"{MAX_SESSION_ID_CHARS} are allowed")
    return value


def _history(tensors: dict[str, np.ndarray | None], cfg: OrchestratorConfig) -> tuple[Turn, ...]:
    chat = json_chat(OMNI.HISTORY, scalar(tensors, OMNI.HISTORY), HISTORY_RULES)
    turns = []
    for i, message in enumerate(chat or ()):
        content = message["content"]
        if not isinstance(content, str):
            content = tuple(_history_part(f"{OMNI.HISTORY}[{i}].content[{j}]", message["role"],
                                          part, cfg) for j, part in enumerate(content))
        turns.append(Turn(message["role"], content))
    clips = sum(len(turn.audio) for turn in turns)
    if clips > cfg.max_audio_items:
        raise RequestError(OMNI.HISTORY, f"carries {clips} audio parts; at most "
                                         f"{cfg.max_audio_items} audio items per request "
                                         "(max_audio_items)")
    return tuple(turns)


def _history_part(where: str, role: str, part: dict[str, Any], cfg: OrchestratorConfig
                  ) -> tuple[str, str | bytes]:
    """("text", str) or ("audio", the file's bytes) of one checked history content part."""
    if part["type"] == "text":
        return "text", part["text"]
    where = f"{where}.audio"
    if role != "user":
        raise RequestError(where, "only a user turn may carry audio (an assistant turn is "
                                  "its text)")
    value = part.get("audio")
    if not isinstance(value, str) or not value:
        raise RequestError(where, "must be the base64 of a sound file (WAV, FLAC, MP3, ...)")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(where, "is not valid base64 (the sound file's bytes)") from None
    if not data:
        raise RequestError(where, "is empty; send the sound file's bytes as base64")
    if len(data) > cfg.max_media_bytes:
        raise RequestError(where, f"is {len(data)} bytes; at most {cfg.max_media_bytes} are "
                                  "allowed (max_media_bytes)")
    if not cfg.stages.audio_encoder and OMNI.AUDIO not in cfg.raw_media:
        raise RequestError(where, f"this pipeline has no {OMNI.AUDIO} encoder stage")
    return "audio", data


def _talker_sampling(tensors: dict[str, np.ndarray | None]) -> dict[str, Any]:
    name = OMNI.TALKER_SAMPLING_PARAMETERS
    raw = text(name, scalar(tensors, name))
    if raw is None or not raw.strip():
        return {}
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestError(name, f"invalid JSON ({e.msg})") from e
    if not isinstance(fields, dict):
        raise RequestError(name, f"must be a JSON object with keys among "
                                 f"{', '.join(TALKER_SAMPLING_KEYS)}")
    out: dict[str, Any] = {}
    for key, value in fields.items():
        where = f"{name}.{key}"
        if key == "seed":
            raise RequestError(where, f"not taken here: send the request's {OMNI.SEED} input "
                                      "(it seeds the talker and the audio decoder)")
        if key not in TALKER_SAMPLING_KEYS:
            raise RequestError(where, f"unknown key; allowed: {', '.join(TALKER_SAMPLING_KEYS)}")
        out[key] = _in_range(where, value, *TALKER_SAMPLING_KEYS[key])
    return out


def _in_range(where: str, value: Any, kind: type, low: float, low_inclusive: bool,
              high: float, allowed: str) -> int | float:
    try:
        parsed = integer(where, value) if kind is int else number(where, value)
    except RequestError:
        parsed = None
    if parsed is None:
        raise RequestError(where, f"must be {allowed}, got {json.dumps(value)}"[:200])
    above_low = parsed >= low if low_inclusive else parsed > low
    if not (above_low and parsed <= high):
        raise RequestError(where, f"must be {allowed}, got {value!r}")
    return parsed


def _voice(tensors: dict[str, np.ndarray | None], cfg: OrchestratorConfig) -> str | None:
    name = text(OMNI.VOICE, scalar(tensors, OMNI.VOICE))
    if name is None or not name.strip():  # empty: the audio stage's default voice
        return None
    voice = cfg.voice(name)
    if voice is None:
        aliases = ", ".join(f"{alias} -> {target}" for alias, target in cfg.voice_map.items())
        raise RequestError(OMNI.VOICE, f"unknown voice {name!r}; voices: "
                                       f"{', '.join(cfg.voices or ())}; voice aliases "
                                       f"(case-insensitive): {aliases or 'none'}")
    return voice


def parse_request(request_id: str, tensors: dict[str, np.ndarray | None],
                  cfg: OrchestratorConfig) -> OmniRequest:
    prompt = text(OMNI.TEXT_INPUT, scalar(tensors, OMNI.TEXT_INPUT)) or ""
    if not prompt.strip():
        prompt = ""  # a chat turn may be media alone (checked below)
    raw = text(OMNI.SAMPLING_PARAMETERS, scalar(tensors, OMNI.SAMPLING_PARAMETERS))
    sampling: dict[str, Any] = {}
    if raw:
        try:
            sampling = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RequestError(OMNI.SAMPLING_PARAMETERS, f"invalid JSON ({e.msg})") from e
        if not isinstance(sampling, dict):
            raise RequestError(OMNI.SAMPLING_PARAMETERS, "must be a JSON object")
        if sampling.get("n", 1) != 1:  # one reply is spoken and streamed per request
            raise RequestError(f"{OMNI.SAMPLING_PARAMETERS}.n",
                               f"must be 1: the omni model answers with one reply; "
                               f"got {sampling['n']!r}")
    task = _task(tensors, cfg)
    history = _history(tensors, cfg)
    if history and task != "chat":
        raise RequestError(OMNI.HISTORY, f"is only used by task chat (task {task} reads "
                                         "text_input aloud)")
    stream_audio = boolean(OMNI.STREAM_AUDIO, scalar(tensors, OMNI.STREAM_AUDIO))
    req = OmniRequest(
        request_id=request_id,
        text=prompt,
        modalities=_modalities(tensors, cfg),
        image=_media(tensors, OMNI.IMAGE, cfg, cfg.stages.image_encoder),
        audio=_media(tensors, OMNI.AUDIO, cfg, cfg.stages.audio_encoder),
        video=_media(tensors, OMNI.VIDEO, cfg, None),
        use_audio_in_video=boolean(OMNI.USE_AUDIO_IN_VIDEO,
                                   scalar(tensors, OMNI.USE_AUDIO_IN_VIDEO)),
        sampling=sampling,
        voice=_voice(tensors, cfg),
        seed=integer(OMNI.SEED, scalar(tensors, OMNI.SEED)),
        task=task,
        session_id=_session_id(tensors),
        history=history,
        talker_sampling=_talker_sampling(tensors),
        stream_audio=True if stream_audio is None else stream_audio,
        return_codec_ids=bool(boolean(OMNI.RETURN_CODEC_IDS,
                                      scalar(tensors, OMNI.RETURN_CODEC_IDS))),
        return_timeline=bool(boolean(OMNI.RETURN_TIMELINE, scalar(tensors, OMNI.RETURN_TIMELINE))),
    )
    if not req.text and (req.task != "chat" or (req.image, req.audio, req.video) == (None,) * 3):
        raise RequestError(OMNI.TEXT_INPUT, "is required and must not be empty (a chat turn "
                                            f"may be media alone: {OMNI.IMAGE}, {OMNI.AUDIO} "
                                            f"or {OMNI.VIDEO})")
    if len(req.audio_clips) > cfg.max_audio_items:
        raise RequestError(OMNI.AUDIO, f"is audio item {len(req.audio_clips)} of this request "
                                       f"(with {OMNI.HISTORY}'s); at most {cfg.max_audio_items} "
                                       "are allowed (max_audio_items)")
    if req.use_audio_in_video and req.video is None:
        raise RequestError(OMNI.USE_AUDIO_IN_VIDEO, f"needs a {OMNI.VIDEO}: it hears the clip's "
                                                    "soundtrack")
    if req.use_audio_in_video and req.audio is not None:
        raise RequestError(OMNI.USE_AUDIO_IN_VIDEO, f"cannot be combined with {OMNI.AUDIO}: "
                                                    "the thinker hears one sound, the clip's")
    # Talker sampling and stream_audio only shape speech: without it they are
    # checked, then unused. Codec ids are an output, so asking for them needs speech.
    if req.return_codec_ids and not req.wants_audio:
        raise RequestError(OMNI.MODALITIES, f"{OMNI.RETURN_CODEC_IDS} needs speech output: add "
                                            f"'audio' to {OMNI.MODALITIES} (or use task speech)")
    return req

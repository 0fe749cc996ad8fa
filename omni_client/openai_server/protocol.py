"""OpenAI request bodies, validated, and how they map onto omni calls.

Runs in the omni-openai process, with no I/O. The models accept what the
official `openai` package sends for the three endpoints; everything else is
an error (a 400 naming the parameter), so a typo never silently changes a
request. A few extensions are marked as such.
"""
from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- chat ----------------------------------------------------------------------------

class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Body):
    data: str  # base64
    format: Literal["wav", "mp3", "flac", "ogg"]


class AudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoURL(_Body):
    url: str


class VideoPart(_Body):
    """vLLM's OpenAI server's video content part (not in OpenAI's own API)."""

    type: Literal["video_url"]
    video_url: VideoURL


Part = TextPart | ImagePart | AudioPart | VideoPart


class AudioRef(_Body):
    id: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None
    name: str | None = None
    audio: AudioRef | None = None  # a previous assistant audio reply (its transcript is not kept)


class AudioOutput(_Body):
    voice: str
    format: Literal["wav", "flac", "pcm16", "mp3", "opus", "aac"] = "wav"


class StreamOptions(_Body):
    include_usage: bool = False


VLLM_SAMPLING_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                            "stop_token_ids", "skip_special_tokens",
                            "include_stop_str_in_output")


class ChatRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutput | None = None
    user: str | None = None
    # vLLM's OpenAI server's sampling extensions (what benchmark clients such as AIPerf
    # send with --extra-inputs): passed to the thinker's SamplingParams as they are
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # extensions (speech only): the talker's sampling fields (the orchestrator
    # checks keys and ranges), the whole utterance as one audio chunk
    # (stream_audio false), and the talker's codec ids in `audio.codec_ids`
    talker_sampling_parameters: dict[str, Any] | None = None
    stream_audio: bool | None = None
    return_codec_ids: bool = False
    # vLLM's OpenAI server's per-request processor options: use_audio_in_video
    mm_processor_kwargs: dict[str, Any] | None = None

    def use_audio_in_video(self) -> bool | None:
        """`mm_processor_kwargs.use_audio_in_video` (None: not sent); other keys are a 400."""
        kwargs = self.mm_processor_kwargs or {}
        for key in kwargs:
            if key != "use_audio_in_video":
                raise OpenAIError(400, f"unsupported processor option {key!r}; this server "
                                       "takes use_audio_in_video",
                                  param=f"mm_processor_kwargs.{key}")
        value = kwargs.get("use_audio_in_video")
        if value is not None and not isinstance(value, bool):
            raise OpenAIError(400, f"must be true or false, got {value!r}",
                              param="mm_processor_kwargs.use_audio_in_video")
        return value

    def sampling_parameters(self) -> dict[str, Any]:
        """vLLM SamplingParams fields of this request."""
        out: dict[str, Any] = {}
        max_tokens = self.max_completion_tokens or self.max_tokens
        for key, value in (("max_tokens", max_tokens), ("temperature", self.temperature),
                           ("top_p", self.top_p), ("presence_penalty", self.presence_penalty),
                           ("frequency_penalty", self.frequency_penalty), ("seed", self.seed),
                           *((k, getattr(self, k)) for k in VLLM_SAMPLING_EXTENSIONS)):
            if value is not None:
                out[key] = value
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return out

    def wants_audio(self) -> bool:
        modalities = self.modalities or ["text"]
        if "audio" in modalities and self.audio is None:
            raise OpenAIError(400, "modalities includes 'audio': give audio.voice and audio.format",
                              param="audio")
        if self.n != 1:
            raise OpenAIError(400, f"n must be 1 (one choice per completion), got {self.n}",
                              param="n")
        if "audio" not in modalities:
            if self.return_codec_ids:
                raise OpenAIError(400, "return_codec_ids needs speech: set modalities to "
                                       "['text', 'audio'] with audio.voice", param="return_codec_ids")
            return False
        fmt = self.audio.format
        if self.stream and fmt != "pcm16":
            raise OpenAIError(400, f"streamed audio must be audio.format 'pcm16', got {fmt!r}",
                              param="audio.format")
        if fmt not in ("wav", "flac", "pcm16"):
            raise OpenAIError(400, f"audio.format {fmt!r} is not supported; allowed: "
                                   "'wav', 'flac', 'pcm16'", param="audio.format")
        return True


class UserTurn(BaseModel):
    """The last user message, split into what the omni tensors carry."""

    text: str
    image: bytes | None = None
    audio: bytes | None = None
    video: bytes | None = None  # a data: URL's bytes
    video_url: str | None = None  # else the URL to read (media_urls.py), named by video_param
    video_param: str | None = None

    @property
    def has_media(self) -> bool:
        return any(v is not None for v in (self.image, self.audio, self.video, self.video_url))


def _data_url(url: str, param: str) -> bytes:
    match = re.fullmatch(r"data:([\w.+-]+/[\w.+-]+)?(;[\w-]+=[\w.-]+)*;base64,(.*)", url, re.S)
    if match is None:
        raise OpenAIError(400, "only data: URLs with base64 content are supported (the server "
                               "fetches nothing)", param=param)
    return _b64(match.group(3), param)


def _b64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise OpenAIError(400, f"invalid base64 ({exc})", param=param) from None


def _video(turn: UserTurn, url: str, param: str) -> None:
    """A video part's data: URL decoded into `turn.video`; any other URL kept for the
    server to read as its flags allow (`turn.video_url`)."""
    if url[:5].lower() != "data:":
        turn.video_url, turn.video_param = url, param
        return
    spec, comma, data = url[5:].partition(",")
    if not comma or spec.rpartition(";")[2].lower() != "base64":
        raise OpenAIError(400, "a data: URL must be base64 (data:video/mp4;base64,...)",
                          param=param)
    turn.video = _b64(data, param)
    if not turn.video:
        raise OpenAIError(400, "the data: URL holds no bytes", param=param)


def _content_of(message: Message, index: int, audio: bool) -> str | list[dict[str, str]]:
    """An earlier message's text, or with `audio` a user message's input_audio and text
    parts in order (the omni entry model's history parts)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts: list[dict[str, str]] = []
    for j, part in enumerate(message.content):
        param = f"messages[{index}].content[{j}]"
        if isinstance(part, TextPart):
            if parts and parts[-1]["type"] == "text":
                parts[-1]["text"] += part.text
            else:
                parts.append({"type": "text", "text": part.text})
        elif audio and isinstance(part, AudioPart) and message.role == "user":
            data = _b64(part.input_audio.data, f"{param}.input_audio.data")
            if not data:
                raise OpenAIError(400, "the audio holds no bytes", param=f"{param}.input_audio.data")
            parts.append({"type": "audio", "audio": base64.b64encode(data).decode("ascii")})
        elif audio:
            raise OpenAIError(400, f"an earlier message carries text parts and, a user's, "
                                   f"input_audio parts; only the last may carry {part.type}",
                              param=param)
        else:
            raise OpenAIError(400, f"only the last user message may carry {part.type} parts",
                              param=param)
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def user_turn(messages: list[Message]) -> UserTurn:
    """The last message (a user's), with its media decoded.

    A video part's data: URL is decoded here; another URL is left for the server to read
    (`video_url`, media_urls.py).

    Raises:
        OpenAIError: the last message is not a user's, or has two images, two audio
            parts or two videos, or an image or audio is not inline base64.
    """
    index = len(messages) - 1
    last = messages[index]
    if last.role != "user":
        raise OpenAIError(400, f"the last message must be the user's, got role {last.role!r}",
                          param=f"messages[{index}].role")
    if isinstance(last.content, str) or last.content is None:
        return UserTurn(text=last.content or "")
    turn = UserTurn(text="")
    texts = []
    for j, part in enumerate(last.content):
        param = f"messages[{index}].content[{j}]"
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, ImagePart):
            if turn.image is not None:
                raise OpenAIError(400, "at most one image per message", param=param)
            turn.image = _data_url(part.image_url.url, f"{param}.image_url.url")
        elif isinstance(part, VideoPart):
            if turn.video is not None or turn.video_url is not None:
                raise OpenAIError(400, "at most one video per message", param=param)
            _video(turn, part.video_url.url, f"{param}.video_url.url")
        else:
            if turn.audio is not None:
                raise OpenAIError(400, "at most one audio part per message", param=param)
            turn.audio = _b64(part.input_audio.data, f"{param}.input_audio.data")
    turn.text = "".join(texts)
    return turn


def history(messages: list[Message], *, allow_system: bool,
            audio: bool = False) -> list[dict[str, Any]]:
    """The turns before the last, as [{"role", "content"}]: text, or with `audio` (an omni
    model) a user turn's input_audio parts as audio parts beside its text."""
    turns = []
    for i, message in enumerate(messages[:-1]):
        role = "system" if message.role == "developer" else message.role
        if role == "system" and not allow_system:
            raise OpenAIError(400, "this pipeline sets its own system prompt (in its spec); "
                                   "send user and assistant messages only",
                              param=f"messages[{i}].role")
        turns.append({"role": role, "content": _content_of(message, i, audio)})
    return turns


def finish_reason(reason: str | None) -> str:
    """vLLM's finish reason as OpenAI's ("stop", "length")."""
    return "length" if reason == "length" else "stop"


# --- images ----------------------------------------------------------------------

class ImageRequest(_Body):
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=8)
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    quality: str | None = None
    style: str | None = None
    user: str | None = None
    # extensions
    seed: int | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    negative_prompt: str | None = None

    @field_validator("size")
    @classmethod
    def _size(cls, size: str | None) -> str | None:
        if size is not None and size != "auto" and not re.fullmatch(r"[1-9]\d*x[1-9]\d*", size):
            raise ValueError(f"size must be 'WIDTHxHEIGHT' (e.g. '64x64') or 'auto', got {size!r}")
        return size

    def dimensions(self) -> tuple[int | None, int | None]:
        if self.size in (None, "auto"):
            return None, None
        width, height = self.size.split("x")
        return int(width), int(height)


# --- speech ----------------------------------------------------------------------

class SpeechRequest(_Body):
    model: str
    input: str = Field(min_length=1, max_length=4096)
    voice: str
    response_format: Literal["wav", "pcm", "flac", "mp3", "opus", "aac"] = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] | None = None
    # extensions: seed; the talker's sampling fields; stream_audio false makes
    # the whole utterance at once (the body still streams, in one piece)
    seed: int | None = None
    talker_sampling_parameters: dict[str, Any] | None = None
    stream_audio: bool | None = None

    def checked_format(self) -> str:
        if self.response_format not in ("wav", "pcm", "flac"):
            raise OpenAIError(400, f"response_format {self.response_format!r} is not supported; "
                                   "allowed: 'wav', 'pcm', 'flac'", param="response_format")
        if self.speed != 1.0:
            raise OpenAIError(400, f"speed must be 1.0 (the audio stage has no time stretch), "
                                   f"got {self.speed}", param="speed")
        if self.instructions:
            raise OpenAIError(400, "instructions are not supported by this speech pipeline",
                              param="instructions")
        if self.stream_format == "sse":
            raise OpenAIError(400, "stream_format 'sse' is not supported; the audio bytes are "
                                   "streamed as they are made", param="stream_format")
        return self.response_format

    def sent_whole(self) -> bool:
        """Whether the body is one file made once every sample is there, its real length in
        its header: FLAC always, WAV unless `stream_format: "audio"` asks for it streamed
        (then behind an open-ended header, as OpenAI streams WAV). PCM has no header and
        always streams."""
        return self.response_format == "flac" or (
            self.response_format == "wav" and self.stream_format != "audio")

"""Result types returned by omni_client calls (plain values, no tritonclient objects)."""
from __future__ import annotations

import io
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from omni_client.media import write_audio


@dataclass(frozen=True)
class TextDelta:
    """One streamed response of the LLM stage.

    Attributes:
        text: the text generated since the previous delta (may be empty).
        finish_reason: why generation stopped ("stop", "length", ...); None
            until the sequence finishes.
        num_input_tokens: prompt length in tokens, when the server reports it.
        num_output_tokens: the output tokens this response adds, when the server
            reports it (vllm_backend's semantics: a stream's counts add up).
    """

    text: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None


@dataclass(frozen=True)
class Completion:
    """The whole result of a non-streaming generation.

    Attributes:
        text: the generated text (the prompt excluded).
        finish_reason: why generation stopped ("stop", "length", ...), if reported.
        num_input_tokens: prompt length in tokens, if reported.
        num_output_tokens: number of generated tokens, if reported.
    """

    text: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None


@dataclass(frozen=True)
class Usage:
    """Token counts of one request (OpenAI's `usage`).

    Attributes:
        prompt_tokens: tokens of the prompt the LLM read (media rows included).
        completion_tokens: tokens the LLM generated.
    """

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, eq=False)
class AudioChunk:
    """The next piece of the spoken reply.

    Attributes:
        samples: mono float32 PCM in [-1, 1].
        sample_rate: samples per second.
    """

    samples: np.ndarray
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return self.samples.size / self.sample_rate


@dataclass(frozen=True)
class ImageOutput:
    """A generated image.

    Attributes:
        png: the PNG file's bytes.
    """

    png: bytes

    def to_pil(self) -> Image.Image:
        """The image as a PIL image (decoded now)."""
        image = Image.open(io.BytesIO(self.png))
        image.load()
        return image


@dataclass(frozen=True)
class CodecIds:
    """The talker's next codec ids (asked for with `return_codec_ids=True`).

    Attributes:
        frames: the codes as the audio decoder reads them, one list of `groups`
            codes (one per codebook: 1 for Qwen2.5-Omni) per frame, in order; the
            frames of a reply are the concatenation of its CodecIds events.
    """

    frames: list[list[int]]


@dataclass(frozen=True)
class Final:
    """The last event of every stream.

    Attributes:
        finish_reason: why the LLM stopped ("stop", "length", ...); None when
            the pipeline has no LLM (image generation).
        usage: token counts, when the pipeline has an LLM.
        metrics: the server's per-request timings (omni pipelines: time to
            first token/audio, seconds per stage, ...); empty otherwise.
    """

    finish_reason: str | None
    usage: Usage | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)


Event = TextDelta | AudioChunk | ImageOutput | CodecIds | Final
"""What `OmniClient.stream()` yields: text deltas, audio chunks, images and
(when asked for) codec ids as they arrive, then one Final."""


@dataclass(eq=False)
class ChatResult:
    """Everything one chat request produced (`OmniClient.chat`).

    Attributes:
        text: the whole reply.
        audio: the spoken reply (mono float32), or None when not asked for.
        sample_rate: of `audio`.
        images: generated images (PNG bytes), in order.
        codec_ids: the talker's codec ids of the spoken reply, [frames][groups]
            (empty unless asked for with `return_codec_ids=True`).
        finish_reason, usage, metrics: as in the stream's Final event.
    """

    text: str
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    images: list[bytes] = field(default_factory=list)
    codec_ids: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> ChatResult:
        text: list[str] = []
        chunks: list[np.ndarray] = []
        result = cls(text="")
        for event in events:
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, AudioChunk):
                chunks.append(event.samples)
                result.sample_rate = event.sample_rate
            elif isinstance(event, ImageOutput):
                result.images.append(event.png)
            elif isinstance(event, CodecIds):
                result.codec_ids.extend(event.frames)
            elif isinstance(event, Final):
                result.finish_reason, result.usage = event.finish_reason, event.usage
                result.metrics = event.metrics
        result.text = "".join(text)
        if chunks:
            result.audio = np.concatenate(chunks).astype(np.float32, copy=False)
        return result

    def save_audio(self, path: str | os.PathLike[str]) -> None:
        """Write the spoken reply to `path`, format from the suffix: .wav (16-bit PCM),
        .flac, .ogg or .pcm (raw 16-bit little-endian).

        Raises:
            ValueError: the reply has no audio.
            BadRequestError: the suffix is none of those.
        """
        if self.audio is None or self.sample_rate is None:
            raise ValueError("this reply has no audio (ask for modalities=['text', 'audio'])")
        write_audio(path, self.audio, self.sample_rate)


@dataclass(frozen=True, eq=False)
class SpeechResult(AudioChunk):
    """Text read aloud (`OmniClient.speech`): all of its audio as one chunk.

    Attributes:
        codec_ids: the talker's codec ids, [frames][groups] (empty unless
            `return_codec_ids=True`).
    """

    codec_ids: list[list[int]] = field(default_factory=list)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the audio to `path`, format from the suffix: .wav (16-bit PCM), .flac,
        .ogg or .pcm (raw 16-bit little-endian).

        Raises:
            BadRequestError: the suffix is none of those.
        """
        write_audio(path, self.samples, self.sample_rate)

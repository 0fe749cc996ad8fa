"""Media in and out of omni_client calls: what callers pass, what the wire carries.

Runs in the caller's process. Inputs may be a path, the file's bytes, a PIL
image, or numpy audio with its sample rate (a video: a path or the container
file's bytes); they are sent as file bytes
(the server decodes and checks them). Audio out is written by one encoder,
`encode_audio`: 16-bit PCM WAV (what Python's `wave` module and every player
read, and what OpenAI sends), FLAC, Ogg Vorbis, or raw 16-bit little-endian PCM;
`streaming_wav_header` opens a WAV whose length is not known yet.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from PIL import Image

from omni_client.errors import BadRequestError

ImageInput = str | os.PathLike | bytes | bytearray | memoryview | Image.Image
"""A path, the file's bytes (PNG, JPEG, WebP, ...) or a PIL image."""
AudioInput = str | os.PathLike | bytes | bytearray | memoryview | np.ndarray | tuple
"""A path, the file's bytes (WAV, FLAC, OGG), or mono samples as a numpy array
(give `sample_rate`) or an `(array, sample_rate)` pair."""

VideoInput = str | os.PathLike | bytes | bytearray | memoryview
"""A path or the container file's bytes (MP4, MOV, MKV, WebM, AVI, ...)."""

AUDIO_FORMATS = ("wav", "flac", "ogg", "pcm")
"""Formats `encode_audio` writes; "pcm" is raw little-endian 16-bit mono."""

# soundfile's container and sample encoding of each format: one quantizer (libsndfile's)
# for all of them, so a streamed WAV's PCM chunks are the samples of the whole file
_SOUNDFILE = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS"),
              "pcm": ("RAW", "PCM_16")}


def _read(path: str | os.PathLike, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise BadRequestError(f"{field}: cannot read {os.fspath(path)!r}: {exc.strerror}") from exc


def _raw(value: Any) -> bytes | None:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return None


def image_bytes(image: ImageInput, *, field: str = "image") -> bytes:
    """The bytes to send for an image input.

    Raises:
        BadRequestError: unreadable path, empty data or an unsupported type.
    """
    data = _raw(image)
    if data is None:
        if isinstance(image, Image.Image):
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            data = buf.getvalue()
        elif isinstance(image, str | os.PathLike):
            data = _read(image, field)
        else:
            raise BadRequestError(f"{field}: expected a path, bytes or a PIL image, "
                                  f"got {type(image).__name__}")
    if not data:
        raise BadRequestError(f"{field}: is empty")
    return data


def video_bytes(video: VideoInput, *, field: str = "video") -> bytes:
    """The bytes to send for a video input: the container file as it is (the server
    decodes it, samples its frames and checks its limits).

    Raises:
        BadRequestError: unreadable path, empty data or an unsupported type.
    """
    data = _raw(video)
    if data is None:
        if not isinstance(video, str | os.PathLike):
            raise BadRequestError(f"{field}: expected a path or the video file's bytes, "
                                  f"got {type(video).__name__}")
        data = _read(video, field)
    if not data:
        raise BadRequestError(f"{field}: is empty")
    return data


def audio_bytes(audio: AudioInput, *, sample_rate: int | None = None, field: str = "audio") -> bytes:
    """The bytes to send for an audio input (numpy samples become a float WAV file).

    Raises:
        BadRequestError: unreadable path, empty data, samples without a
            sample rate, or an unsupported type.
    """
    if isinstance(audio, tuple):
        if len(audio) != 2:
            raise BadRequestError(f"{field}: a tuple must be (samples, sample_rate)")
        audio, sample_rate = audio
    data = _raw(audio)
    if data is None:
        if isinstance(audio, np.ndarray):
            if sample_rate is None:
                raise BadRequestError(f"{field}: numpy samples need their sample_rate")
            # 32-bit float WAV: the samples reach the server's audio encoder exactly
            data = _encode(audio, sample_rate, "WAV", "FLOAT", field)
        elif isinstance(audio, str | os.PathLike):
            data = _read(audio, field)
        else:
            raise BadRequestError(f"{field}: expected a path, bytes, a numpy array or "
                                  f"(samples, sample_rate), got {type(audio).__name__}")
    if not data:
        raise BadRequestError(f"{field}: is empty")
    return data


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str, *, field: str = "audio") -> bytes:
    """Encode mono float samples in [-1, 1] (clipped) as `fmt`, one of AUDIO_FORMATS.

    WAV and FLAC are 16-bit PCM files whose headers carry their real length, Ogg
    is Vorbis, "pcm" raw signed 16-bit little-endian (the WAV's data, no header).

    Raises:
        BadRequestError: unknown format, bad sample rate or not 1-D samples.
    """
    if fmt not in AUDIO_FORMATS:
        raise BadRequestError(f"{field}: unknown audio format {fmt!r}; allowed: {list(AUDIO_FORMATS)}")
    return _encode(samples, sample_rate, *_SOUNDFILE[fmt], field)


def _encode(samples: np.ndarray, sample_rate: int, container: str, subtype: str,
            field: str) -> bytes:
    samples = np.asarray(samples)
    if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.number):
        raise BadRequestError(f"{field}: samples must be a 1-D numeric array, got shape "
                              f"{samples.shape} of {samples.dtype}")
    if not isinstance(sample_rate, int | np.integer) or sample_rate <= 0:
        raise BadRequestError(f"{field}: sample_rate must be a positive int, got {sample_rate!r}")
    buf = io.BytesIO()
    sf.write(buf, np.clip(samples.astype(np.float32, copy=False), -1.0, 1.0), int(sample_rate),
             format=container, subtype=subtype, endian="LITTLE" if container == "RAW" else None)
    return buf.getvalue()


def streaming_wav_header(sample_rate: int) -> bytes:
    """The header of a 16-bit mono WAV whose length is not known yet: a streamed body,
    `encode_audio(chunk, rate, "pcm")` for each chunk after it.

    What soundfile writes for an empty PCM_16 WAV, with the RIFF and data sizes set to
    0xFFFFFFFF ("unknown", as OpenAI's streamed WAV has them); readers take the data
    to the end of the stream.
    """
    header = bytearray(encode_audio(np.zeros(0, np.float32), sample_rate, "wav",
                                    field="sample_rate"))
    data = header.rindex(b"data")  # the last chunk: its size, then the samples
    unknown = b"\xff\xff\xff\xff"
    header[4:8] = header[data + 4:data + 8] = unknown
    return bytes(header)


def audio_format(path: str | os.PathLike, fmt: str | None = None, *, field: str = "path",
                 fmt_option: str | None = None) -> str:
    """The format to write `path` in: `fmt`, else the path's suffix (one of AUDIO_FORMATS).

    `fmt_option` names where the caller could give `fmt` (the CLI's `--format`).

    Raises:
        BadRequestError: `fmt` is not one of AUDIO_FORMATS, or no `fmt` and the
            suffix is not one.
    """
    if fmt is None:
        fmt = Path(path).suffix.lower().lstrip(".")
        if fmt not in AUDIO_FORMATS:
            alternative = f" or {fmt_option}" if fmt_option else ""
            raise BadRequestError(f"{field}: cannot tell the audio format of {os.fspath(path)!r}; "
                                  f"use a {', '.join('.' + f for f in AUDIO_FORMATS)} suffix"
                                  f"{alternative}")
    elif fmt not in AUDIO_FORMATS:
        raise BadRequestError(f"{field}: unknown audio format {fmt!r}; allowed: {list(AUDIO_FORMATS)}")
    return fmt


def write_audio(path: str | os.PathLike, samples: np.ndarray, sample_rate: int,
                fmt: str | None = None, *, field: str = "path") -> None:
    """Write `encode_audio(samples, sample_rate, fmt)` to `path` (`fmt` from its suffix
    when not given)."""
    data = encode_audio(samples, sample_rate, audio_format(path, fmt, field=field), field=field)
    Path(path).write_bytes(data)

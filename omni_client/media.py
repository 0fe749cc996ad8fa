"""Media in and out of omni_client calls: what callers pass, what the wire carries.

Runs in the caller's process. Inputs may be a path, the file's bytes, a PIL
image, or numpy audio with its sample rate; they are sent as file bytes
(the server decodes and checks them). Audio out can be written as WAV, FLAC
or raw 16-bit PCM (what OpenAI's `response_format` offers).
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

AUDIO_FORMATS = ("wav", "flac", "pcm")
"""Formats `encode_audio` writes; "pcm" is raw little-endian 16-bit mono."""


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


def audio_bytes(audio: AudioInput, *, sample_rate: int | None = None, field: str = "audio") -> bytes:
    """The bytes to send for an audio input (numpy samples become a WAV file).

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
            data = encode_audio(audio, sample_rate, "wav", field=field)
        elif isinstance(audio, str | os.PathLike):
            data = _read(audio, field)
        else:
            raise BadRequestError(f"{field}: expected a path, bytes, a numpy array or "
                                  f"(samples, sample_rate), got {type(audio).__name__}")
    if not data:
        raise BadRequestError(f"{field}: is empty")
    return data


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str, *, field: str = "audio") -> bytes:
    """Encode mono float samples in [-1, 1] as `fmt` ("wav", "flac" or "pcm").

    WAV is 32-bit float, FLAC 16-bit, PCM raw signed 16-bit little-endian.

    Raises:
        BadRequestError: unknown format, bad sample rate or not 1-D samples.
    """
    samples = np.asarray(samples)
    if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.number):
        raise BadRequestError(f"{field}: samples must be a 1-D numeric array, got shape "
                              f"{samples.shape} of {samples.dtype}")
    if not isinstance(sample_rate, int | np.integer) or sample_rate <= 0:
        raise BadRequestError(f"{field}: sample_rate must be a positive int, got {sample_rate!r}")
    samples = samples.astype(np.float32, copy=False)
    if fmt == "pcm":
        return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
    if fmt not in AUDIO_FORMATS:
        raise BadRequestError(f"{field}: unknown audio format {fmt!r}; allowed: {list(AUDIO_FORMATS)}")
    buf = io.BytesIO()
    subtype = "FLOAT" if fmt == "wav" else "PCM_16"
    sf.write(buf, np.clip(samples, -1.0, 1.0), int(sample_rate), format=fmt.upper(), subtype=subtype)
    return buf.getvalue()

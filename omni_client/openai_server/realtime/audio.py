"""Audio between the realtime wire (PCM16 at 24 kHz, base64) and the omni pipeline.

Runs in the omni-openai process. Input: the session's PCM16 24 kHz bytes become
a 16 kHz WAV, what the omni entry model's audio encoder reads. Output: the
pipeline's float chunks become PCM16 24 kHz bytes. Resampling is scipy's
polyphase filter; every byte is written by omni_client.media's encoder.
"""
from __future__ import annotations

import base64
import binascii
from math import gcd

import numpy as np
from scipy.signal import resample_poly

from omni_client.media import encode_audio

WIRE_RATE = 24000  # audio/pcm, the only rate of OpenAI's PCM format
ENCODER_RATE = 16000  # what the omni models' audio encoders read


class AudioDecodeError(ValueError):
    """Client audio that is not base64 PCM16."""


def decode_pcm16(data: str) -> bytes:
    """The bytes of a base64 PCM16 string.

    Raises:
        AudioDecodeError: not base64, or an odd number of bytes.
    """
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioDecodeError(f"invalid base64 ({exc})") from None
    if len(raw) % 2:
        raise AudioDecodeError(f"PCM16 audio has an even number of bytes, got {len(raw)}")
    return raw


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Float samples at `rate` as float32 samples at `target`."""
    samples = np.asarray(samples, np.float32)
    if rate == target or samples.size == 0:
        return samples
    g = gcd(rate, target)
    return resample_poly(samples, target // g, rate // g).astype(np.float32)


def input_wav(pcm16: bytes) -> bytes:
    """PCM16 24 kHz bytes as the 16 kHz 16-bit WAV file the pipeline's encoder reads."""
    samples = np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768.0
    return encode_audio(resample(samples, WIRE_RATE, ENCODER_RATE), ENCODER_RATE, "wav")


def output_pcm16(samples: np.ndarray, rate: int) -> bytes:
    """A chunk of the spoken reply as PCM16 24 kHz bytes."""
    return encode_audio(resample(samples, rate, WIRE_RATE), WIRE_RATE, "pcm")


def duration_ms(pcm16: bytes) -> int:
    """Milliseconds of PCM16 24 kHz audio."""
    return len(pcm16) // 2 * 1000 // WIRE_RATE

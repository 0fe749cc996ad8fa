"""Checks of the WAV files clients get, shared by the unit and integration tests: read back
with Python's own `wave` module and with soundfile, samples compared with the float ones."""
from __future__ import annotations

import io
import wave

import numpy as np
import soundfile as sf

STEP = 1 / 32768  # one PCM16 step


def read_wave(data: bytes) -> tuple[np.ndarray, int, int]:
    """Samples (int16), rate and header frame count of a mono 16-bit PCM WAV, as Python's
    `wave` module reads it (it refuses anything but integer PCM)."""
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getcomptype()) == (1, 2, "NONE")
        frames = w.getnframes()
        pcm = np.frombuffer(w.readframes(frames), "<i2")
        return pcm, w.getframerate(), frames


def assert_within_one_step(pcm: np.ndarray, samples: np.ndarray) -> None:
    """16-bit samples `pcm` are the float `samples` (clipped to [-1, 1]) within one step."""
    expected = np.clip(np.asarray(samples, np.float32), -1.0, 1.0)
    assert pcm.shape == expected.shape, (pcm.shape, expected.shape)
    assert np.abs(pcm / 32768.0 - expected).max() <= STEP


def assert_pcm16_wav(data: bytes, samples: np.ndarray, rate: int) -> None:
    """`data` is a 16-bit PCM WAV of the float `samples` at `rate`, its header giving its
    real length, read alike by `wave` and by soundfile."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    pcm, got_rate, frames = read_wave(data)
    assert got_rate == rate and frames == len(samples)  # the header's length is the real one
    assert_within_one_step(pcm, samples)
    info = sf.info(io.BytesIO(data))
    assert (info.format, info.subtype, info.samplerate, info.frames) == (
        "WAV", "PCM_16", rate, len(samples))
    back, _ = sf.read(io.BytesIO(data), dtype="float32")
    assert np.abs(back - np.clip(samples, -1, 1)).max() <= STEP

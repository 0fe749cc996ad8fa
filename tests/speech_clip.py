"""Spoken test audio, synthesised in the test process with espeak-ng (Debian's `espeak-ng`,
installed by tools/setup.sh): real enough that a voice activity detector fires on it (Silero does
not fire on tones), and the same bytes on every run.

`speech(text)` is one utterance as PCM16 mono; `turns([...])` lays utterances out between
silences and says where each one's sound lies (from the clip's own energy envelope), the truth
the VAD tests measure against.
"""
from __future__ import annotations

import io
import shutil
import subprocess
import wave
from dataclasses import dataclass

import numpy as np

ESPEAK = "espeak-ng"
ENVELOPE_MS = 10  # frame of the energy envelope
ENVELOPE_FLOOR = 0.02  # a frame is sound when its RMS reaches 2% of the clip's loudest frame


def speech(text: str, *, rate: int = 24000, voice: str = "en-us", wpm: int = 150) -> np.ndarray:
    """`text` spoken by espeak-ng, int16 mono at `rate` (resampled from espeak's 22.05 kHz with
    soxr). Raises RuntimeError when espeak-ng is missing."""
    import soxr

    if shutil.which(ESPEAK) is None:
        raise RuntimeError(f"{ESPEAK} is not installed (tools/setup.sh installs it from apt)")
    out = subprocess.run([ESPEAK, "-v", voice, "-s", str(wpm), "--stdout", text],
                         check=True, capture_output=True).stdout
    with wave.open(io.BytesIO(out)) as w:
        source_rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    resampled = soxr.resample(pcm.astype(np.float32) / 32768.0, source_rate, rate)
    return (np.clip(resampled, -1.0, 1.0) * 32767).astype(np.int16)


def sound_spans(pcm: np.ndarray, rate: int) -> list[tuple[int, int]]:
    """(start_ms, end_ms) of the runs of envelope frames that carry sound, gaps shorter than
    250 ms (between words) bridged."""
    frame = rate * ENVELOPE_MS // 1000
    frames = len(pcm) // frame
    rms = np.sqrt((pcm[: frames * frame].astype(np.float64).reshape(frames, frame) ** 2).mean(axis=1))
    loud = rms >= ENVELOPE_FLOOR * rms.max()
    spans: list[tuple[int, int]] = []
    for i in np.flatnonzero(loud):
        start, end = int(i) * ENVELOPE_MS, (int(i) + 1) * ENVELOPE_MS
        if spans and start - spans[-1][1] < 250:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


@dataclass(frozen=True)
class Clip:
    pcm: np.ndarray  # int16 mono
    rate: int
    spans: list[tuple[int, int]]  # (start_ms, end_ms) of each utterance's sound

    @property
    def bytes(self) -> bytes:
        return self.pcm.astype("<i2").tobytes()

    def wav(self) -> bytes:
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.rate)
            w.writeframes(self.bytes)
        return buf.getvalue()


def turns(texts: list[str], *, lead_ms: int = 1000, gap_ms: int = 1500, tail_ms: int = 1500,
          rate: int = 24000, noise: float = 0.0, seed: int = 0) -> Clip:
    """The utterances `texts` after `lead_ms` of silence, `gap_ms` apart, `tail_ms` after the
    last; with `noise` > 0, white noise of that RMS (full scale 1) under all of it. Each
    utterance's span is measured on its own samples before mixing, so it is where its sound
    is, not where its espeak-ng padding is."""
    parts = [np.zeros(rate * lead_ms // 1000, np.int16)]
    spans = []
    at = len(parts[0])
    for k, text in enumerate(texts):
        pcm = speech(text, rate=rate)
        (start, end), *rest = sound_spans(pcm, rate)
        end = rest[-1][1] if rest else end
        offset = at * 1000 // rate
        spans.append((offset + start, offset + end))
        parts.append(pcm)
        at += len(pcm)
        pause = np.zeros(rate * (gap_ms if k + 1 < len(texts) else tail_ms) // 1000, np.int16)
        parts.append(pause)
        at += len(pause)
    pcm = np.concatenate(parts)
    if noise > 0:
        hiss = np.random.default_rng(seed).normal(0.0, noise * 32768, len(pcm))
        pcm = np.clip(pcm + hiss, -32768, 32767).astype(np.int16)
    return Clip(pcm, rate, spans)

"""Server VAD for /v1/realtime: OpenAI's `server_vad` turn detection on a PCM16 24 kHz stream.

Runs in the omni-openai process, one `ServerVad` per realtime session. The session's
`input_audio_buffer.append` bytes flow in through `feed()`; they are resampled to 16 kHz (soxr,
streaming), cut into Silero VAD's native 512-sample windows (32 ms) and scored by Silero VAD
(the TorchScript model shipped inside the `silero-vad` wheel). Out come `speech_started` and
`speech_stopped` events with the positions OpenAI reports as `audio_start_ms` / `audio_end_ms`:

- `speech_started`: the first window whose speech probability reaches `threshold`, moved back by
  `prefix_padding_ms` (the audio the model gets includes that much lead-in), never before the
  start of the stream (or the last `reset()`);
- `speech_stopped`: once the probability has stayed below `threshold - 0.15` (Silero's own
  hysteresis) for `silence_duration_ms`, at the point where that silence is complete, so the
  committed audio includes the silence, as OpenAI's does.

Positions are milliseconds of input since the VAD was made; `reset()` forgets buffered audio and
speech state but keeps that clock running. Events depend only on the audio, not on how it was
split into `feed()` calls: input reaches the resampler in fixed blocks.
"""
from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np

INPUT_RATE = 24000
MODEL_RATE = 16000
WINDOW = 512  # Silero VAD's window at 16 kHz
BLOCK = WINDOW * INPUT_RATE // MODEL_RATE  # 768 input samples reach the resampler at a time
HYSTERESIS = 0.15  # speech ends below threshold - 0.15, as Silero's VADIterator


@dataclass(frozen=True)
class VadEvent:
    """A turn boundary; `audio_ms` is its position in the session's input audio stream."""

    kind: Literal["speech_started", "speech_stopped"]
    audio_ms: int


@functools.cache
def _silero_model():
    from silero_vad import load_silero_vad  # imports torch; also sets torch to 1 intra-op thread

    with warnings.catch_warnings():  # torch.jit.load is deprecated in favour of torch.export
        warnings.simplefilter("ignore", DeprecationWarning)
        return load_silero_vad(onnx=False)


def preload() -> None:
    """Load Silero VAD (and torch) now, e.g. at server start: else the first server_vad session
    waits for them (1-4 s here)."""
    _silero_model()


def _check(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")


class ServerVad:
    """Streaming voice activity detection with OpenAI `server_vad` parameters.

    Raises ValueError when a parameter is out of range. Not thread-safe: one per session.
    """

    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300,
                 silence_duration_ms: int = 500):
        _check("threshold", threshold, 0.0, 1.0)
        _check("prefix_padding_ms", prefix_padding_ms, 0, 60_000)
        _check("silence_duration_ms", silence_duration_ms, 0, 60_000)
        self.threshold = float(threshold)
        self.prefix_padding_ms = int(prefix_padding_ms)
        self.silence_duration_ms = int(silence_duration_ms)
        self._model = copy.deepcopy(_silero_model())  # its recurrent state is per stream
        self._fed = 0  # input samples since the VAD was made: the session's clock
        self._odd = b""  # half a PCM16 sample
        self.reset()

    # --- public -----------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop buffered audio and speech state (no event is sent); positions keep counting."""
        import soxr

        self._model.reset_states()
        self._resampler = soxr.ResampleStream(INPUT_RATE, MODEL_RATE, 1, dtype="float32")
        self._origin = self._fed  # input sample where the resampled stream starts
        self._block = np.zeros(0, np.float32)  # < BLOCK input samples
        self._window = np.zeros(0, np.float32)  # < WINDOW resampled samples
        self._windows = 0  # windows scored since the origin
        self._speaking = False
        self._silence_from: int | None = None  # window where the current silence began

    def feed(self, pcm16_24k: bytes) -> list[VadEvent]:
        """Take little-endian PCM16 mono 24 kHz audio (any length, even a byte); return the
        events it completes, in order."""
        data = self._odd + bytes(pcm16_24k)
        whole = len(data) - len(data) % 2
        self._odd = data[whole:]
        samples = np.frombuffer(data[:whole], "<i2").astype(np.float32) / 32768.0
        self._fed += len(samples)
        self._block = np.concatenate([self._block, samples])
        full = len(self._block) - len(self._block) % BLOCK
        if not full:
            return []
        resampled = self._resampler.resample_chunk(self._block[:full])
        self._block = self._block[full:]
        self._window = np.concatenate([self._window, resampled])
        events: list[VadEvent] = []
        while len(self._window) >= WINDOW:
            window, self._window = self._window[:WINDOW], self._window[WINDOW:]
            event = self._step(self._probability(window))
            if event is not None:
                events.append(event)
        return events

    # --- detection ----------------------------------------------------------------------------

    def _probability(self, window: np.ndarray) -> float:
        import torch

        with torch.inference_mode():
            return float(self._model(torch.from_numpy(window), MODEL_RATE).item())

    def _step(self, prob: float) -> VadEvent | None:
        index = self._windows
        self._windows += 1
        if prob >= self.threshold:
            self._silence_from = None
            if not self._speaking:
                self._speaking = True
                start = max(self._ms(index) - self.prefix_padding_ms, self._ms(0))
                return VadEvent("speech_started", start)
            return None
        if not self._speaking or prob >= self.threshold - HYSTERESIS:
            return None
        if self._silence_from is None:
            self._silence_from = index
        if self._ms(index + 1) - self._ms(self._silence_from) < self.silence_duration_ms:
            return None
        self._speaking, self._silence_from = False, None
        return VadEvent("speech_stopped", self._ms(index + 1))

    def _ms(self, window: int) -> int:
        """Stream position (ms) of the start of window `window` since the origin."""
        return round(self._origin * 1000 / INPUT_RATE + window * WINDOW * 1000 / MODEL_RATE)

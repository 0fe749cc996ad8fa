"""Qwen2.5-Omni's speech feed: how the orchestrator drives its talker and Token2Wav.

Runs in the orchestrator's event loop. The thinker keeps its rows (input
embedding + last hidden state) in a /dev/shm file it hands over; once its
reply has 2 tokens (the talker's prefill reads reply token 0 fed back), one
talker request names that file with the thinker's prompt ids and media grids
(families/rows_feed.py, which Qwen3-Omni shares).
The talker emits one code a step (`[frames, 1]`); Token2Wav takes a chunk's
frames (`[frames, 1]`) with its left and right context counts.
"""
from __future__ import annotations

import numpy as np

from omni_serve.contract import AUDIO
from omni_serve.families import DecoderChunk
from omni_serve.families.rows_feed import ThinkerRowsFeed


class Qwen25OmniSpeech(ThinkerRowsFeed):
    codec_groups = 1  # one code a frame

    def decoder_inputs(self, chunk: DecoderChunk, seed: int,
                       voice: str | None) -> dict[str, np.ndarray]:
        inputs = {**self.chunk_inputs(chunk), AUDIO.SEED: np.array([[seed]], dtype=np.int64)}
        if voice:
            inputs[AUDIO.VOICE] = np.array([[voice.encode()]], dtype=np.object_)
        return inputs

"""Qwen3-Omni's speech feed: how the orchestrator drives its talker and Code2Wav.

Runs in the orchestrator's event loop. The thinker keeps its rows (input
embedding + hidden state after layer `accept_hidden_layer`: its vLLM class,
thinker.py, keeps that layer) in a /dev/shm file it hands over; once its
reply has 2 tokens (the talker's prefill reads reply token 0, its first
decode step reply token 1), one talker request names that file with the
thinker's prompt ids, the media grids and the speaker (families/rows_feed.py,
which Qwen2.5-Omni shares). The talker emits
16-code frames (`[frames, 16]`: its code and the code predictor's 15);
Code2Wav takes a chunk's frames with its left context (causal: no right
context, no voice, no noise).
"""
from __future__ import annotations

import numpy as np

from omni_serve.families import DecoderChunk
from omni_serve.families.rows_feed import ThinkerRowsFeed

CODEC_GROUPS = 16  # Qwen3-Omni's talker_config.num_code_groups


class Qwen3OmniSpeech(ThinkerRowsFeed):
    codec_groups = CODEC_GROUPS

    def decoder_inputs(self, chunk: DecoderChunk, seed: int,
                       voice: str | None) -> dict[str, np.ndarray]:
        # Code2Wav has no voices and draws no noise: neither the voice nor the seed goes
        return self.chunk_inputs(chunk)

"""Qwen3-Omni's speech feed: how the orchestrator drives its talker and Code2Wav.

Runs in the orchestrator's event loop. The thinker keeps its rows (input
embedding + hidden state after layer `accept_hidden_layer`: its vLLM class,
thinker.py, keeps that layer) in a /dev/shm file it hands over; once its
reply has 2 tokens (the talker's prefill reads reply token 0, its first
decode step reply token 1), one talker request names that file with the
thinker's prompt ids, the media grids and the speaker. The talker emits
16-code frames (`[frames, 16]`: its code and the code predictor's 15);
Code2Wav takes a chunk's frames with its left context (causal: no right
context, no voice, no noise).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from omni_serve.contract import AUDIO, LLM, TALKER
from omni_serve.families import DecoderChunk, ThinkerReply

CODEC_GROUPS = 16  # Qwen3-Omni's talker_config.num_code_groups


def _text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


class Qwen3OmniSpeech:
    codec_groups = CODEC_GROUPS
    # the thinker inputs that keep its rows for the talker
    thinker_inputs = {
        LLM.RETURN_HIDDEN_STATES: np.array([True]),
        LLM.HIDDEN_STATES_IN_SHM: np.array([True]),
        LLM.RETURN_INPUT_TOKEN_IDS: np.array([True]),
    }
    thinker_outputs = (LLM.HIDDEN_STATES_FILE, LLM.HIDDEN_STATES_ROWS, LLM.INPUT_TOKEN_IDS)
    ready_after_tokens = 2

    def talker_ready(self, reply: ThinkerReply) -> bool:
        return (reply.file is not None and reply.prompt_ids is not None
                and reply.reply_tokens >= self.ready_after_tokens)

    def talker_inputs(self, reply: ThinkerReply, media: Mapping[str, np.ndarray],
                      voice: str | None, sampling: dict[str, Any]) -> dict[str, np.ndarray]:
        inputs = {
            TALKER.THINKER_HIDDEN_STATES_FILE: _text(reply.file),
            TALKER.PROMPT_TOKEN_IDS: np.array(reply.prompt_ids, dtype=np.int64),
            TALKER.SAMPLING_PARAMETERS: _text(json.dumps(sampling)),
        }
        for name in (TALKER.IMAGE_GRID_THW, TALKER.AUDIO_FEATURE_LENGTHS):
            if name in media:
                inputs[name] = media[name]
        if voice:
            inputs[TALKER.VOICE] = _text(voice)
        return inputs

    def decoder_inputs(self, chunk: DecoderChunk, seed: int,
                       voice: str | None) -> dict[str, np.ndarray]:
        # [1, frames, 16]: the batch dimension, then a frame's codes; Code2Wav has no voices
        # and draws no noise, so neither the voice nor the seed goes
        frames = np.asarray(chunk.frames, dtype=np.int64).reshape(1, -1, self.codec_groups)
        return {AUDIO.CODEC_IDS: frames,
                AUDIO.CONTEXT_TOKENS: np.array([[chunk.context]], dtype=np.int32),
                AUDIO.LOOKAHEAD_TOKENS: np.array([[chunk.lookahead]], dtype=np.int32),
                AUDIO.CODE_OFFSET: np.array([[chunk.offset]], dtype=np.int64)}

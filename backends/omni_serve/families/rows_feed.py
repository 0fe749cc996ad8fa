"""The talker handover both Qwen omni families share: the thinker's rows in a /dev/shm file.

Runs in the orchestrator's event loop (a family's SpeechFeed subclasses it). The thinker
keeps one row per position (input embedding | a hidden state; which layer is the
family's thinker class's) in a capture file it hands over (llm/hidden_states.py); once
its reply has `ready_after_tokens` tokens, one talker request names that file with the
thinker's prompt ids, the media grids (the talker's M-RoPE positions), the voice and the
talker's sampling. The decoder side (`codec_groups`, `decoder_inputs`) is the family's.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from omni_serve.contract import AUDIO, LLM, TALKER
from omni_serve.families import DecoderChunk, ThinkerReply


def text_tensor(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


class ThinkerRowsFeed:
    codec_groups: int
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
            TALKER.THINKER_HIDDEN_STATES_FILE: text_tensor(reply.file),
            TALKER.PROMPT_TOKEN_IDS: np.array(reply.prompt_ids, dtype=np.int64),
            TALKER.SAMPLING_PARAMETERS: text_tensor(json.dumps(sampling)),
        }
        for name in (TALKER.IMAGE_GRID_THW, TALKER.AUDIO_FEATURE_LENGTHS,
                     TALKER.VIDEO_GRID_THW, TALKER.VIDEO_SECOND_PER_GRID,
                     TALKER.USE_AUDIO_IN_VIDEO):
            if name in media:
                inputs[name] = media[name]
        if voice:
            inputs[TALKER.VOICE] = text_tensor(voice)
        return inputs

    def chunk_inputs(self, chunk: DecoderChunk) -> dict[str, np.ndarray]:
        """A decoder chunk's codes `[1, frames, codec_groups]` and where it sits."""
        frames = np.asarray(chunk.frames, dtype=np.int64).reshape(1, -1, self.codec_groups)
        return {AUDIO.CODEC_IDS: frames,
                AUDIO.CONTEXT_TOKENS: np.array([[chunk.context]], dtype=np.int32),
                AUDIO.LOOKAHEAD_TOKENS: np.array([[chunk.lookahead]], dtype=np.int32),
                AUDIO.CODE_OFFSET: np.array([[chunk.offset]], dtype=np.int64)}

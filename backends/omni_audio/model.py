"""Triton adapter of the audio generator (`backend: "omni_audio"`), loaded by the Python stub.

Thin by design: Triton's dynamic batcher hands execute() a list of chunk
requests (codec codes [frames, groups], context counts, voice, seed); each is
parsed on its own (a bad one gets its own INVALID_ARG response), the good ones
run through AudioRunner (equal-length chunks share one call of the checkpoint
family's codec decoder) and each gets its waveform (`audio_chunk` [1, n]
float32) and `sample_rate` [1, 1].
"""
from __future__ import annotations

import logging

import numpy as np

from omni_serve.adapter import StageModel
from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.request import parse_request
from omni_serve.audio.runner import AudioRunner
from omni_serve.batched_adapter import BatchedExecute
from omni_serve.contract import AUDIO, AUDIO_CONTRACT
from omni_serve.metrics_table import AudioMetrics
from omni_serve.tritonio import (
    Metrics,
    make_response,
    read_inputs,
    stage_config,
)

log = logging.getLogger("omni_audio")


class TritonPythonModel(StageModel):
    CONTRACT = AUDIO_CONTRACT

    def initialize(self, args):
        self.set_up(args)
        self.cfg = stage_config(args, AudioStageConfig)
        self.runner = AudioRunner(self.cfg)
        self._rate = np.array([[self.runner.sample_rate]], dtype=np.int32)
        self._metrics = m = Metrics({"model": self.model_name})  # families must outlive metrics
        self._seconds = m.counter(AudioMetrics.GENERATED_SECONDS)
        self._execute = BatchedExecute(
            m, AudioMetrics,
            parse=lambda r: parse_request(read_inputs(r, AUDIO_CONTRACT), self.runner.limits),
            run=lambda items: self.runner.run(items), respond=self._response)

    def execute(self, requests):
        return self._execute(requests)
    def _response(self, request, item, pcm: np.ndarray):
        self._seconds.increment(pcm.size / self.runner.sample_rate)
        return make_response({AUDIO.AUDIO_CHUNK: pcm[np.newaxis], AUDIO.SAMPLE_RATE: self._rate})

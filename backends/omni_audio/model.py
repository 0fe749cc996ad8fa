"""Triton adapter of the audio generator (`backend: "omni_audio"`), loaded by the Python stub.

Thin by design: Triton's dynamic batcher hands execute() a list of chunk
requests (codec tokens, left-context count, voice, seed); each is parsed on
its own (a bad one gets its own INVALID_ARG response), the good ones run
through AudioRunner (equal-length chunks share one Token2Wav call) and each
gets its waveform (`audio_chunk` [1, n] float32) and `sample_rate` [1, 1].
"""
from __future__ import annotations

import logging
import time

import numpy as np

from omni_serve import stubs
from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.request import parse_request
from omni_serve.audio.runner import AudioRunner
from omni_serve.contract import AUDIO, AUDIO_CONTRACT
from omni_serve.tritonio import (
    Metrics,
    apply_stage_env,
    make_response,
    parse_each,
    pb,
    read_inputs,
    stage_config,
    triton_error,
)

log = logging.getLogger("omni_audio")

_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


class TritonPythonModel:
    def initialize(self, args):
        apply_stage_env(args)
        stubs.register(args)  # the orchestrator learns from it when this stub dies
        self.model_name = args["model_name"]
        self.cfg = stage_config(args, AudioStageConfig)
        self.runner = AudioRunner(self.cfg)
        self._rate = np.array([[self.runner.sample_rate]], dtype=np.int32)
        self._metrics = m = Metrics({"model": self.model_name})  # families must outlive metrics
        self._batch = m.histogram("omni_audio_batch_size", "Requests per execute() call", _BATCH_BUCKETS)
        self._seconds = m.counter("omni_audio_seconds_generated_total", "Seconds of audio returned")
        self._busy = m.counter("omni_audio_compute_seconds_total",
                               "Seconds spent in Token2Wav calls (real-time factor = compute / generated)")

    def execute(self, requests):
        self._batch.observe(len(requests))
        parsed = parse_each(requests, lambda r: parse_request(read_inputs(r, AUDIO_CONTRACT),
                                                              self.runner.limits))
        good = [p for p in parsed if not isinstance(p, Exception)]
        t0 = time.perf_counter()
        results = iter(self.runner.run(good)) if good else iter(())
        self._busy.increment(time.perf_counter() - t0)
        responses = []
        for item in parsed:
            result = item if isinstance(item, Exception) else next(results)
            if isinstance(result, Exception):
                responses.append(pb().InferenceResponse(error=triton_error(result)))
                continue
            self._seconds.increment(result.size / self.runner.sample_rate)
            responses.append(make_response({AUDIO.AUDIO_CHUNK: result[np.newaxis],
                                            AUDIO.SAMPLE_RATE: self._rate}))
        return responses

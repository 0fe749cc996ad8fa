"""Triton adapter of the diffusion generator (`backend: "omni_dit"`), loaded by the Python stub.

Thin by design: Triton's dynamic batcher hands execute() a list of requests;
each is parsed on its own (a bad one gets its own INVALID_ARG response), the
good ones run through DitRunner (grouped into batched pipeline calls) and
each gets its PNG (and, when requested, the raw HxWx3 array).
"""
from __future__ import annotations

import logging

import numpy as np

from omni_serve.adapter import StageModel
from omni_serve.batched_adapter import BatchedExecute
from omni_serve.contract import DIT, DIT_CONTRACT
from omni_serve.dit.config import DitStageConfig
from omni_serve.dit.request import parse_request
from omni_serve.dit.runner import DitRunner, encode_png
from omni_serve.metrics_table import DitMetrics
from omni_serve.tritonio import (
    Metrics,
    pb,
    read_inputs,
    stage_config,
)

log = logging.getLogger("omni_dit")


class TritonPythonModel(StageModel):
    CONTRACT = DIT_CONTRACT

    def initialize(self, args):
        self.set_up(args)
        self.cfg = stage_config(args, DitStageConfig)
        self.runner = DitRunner(self.cfg)
        self._metrics = m = Metrics({"model": self.model_name})  # families must outlive metrics
        self._execute = BatchedExecute(
            m, DitMetrics,
            parse=lambda r: parse_request(read_inputs(r, DIT_CONTRACT), self.cfg),
            run=self._run, respond=self._response)
        self._images = m.counter(DitMetrics.IMAGES)
        self._steps = m.counter(DitMetrics.DENOISING_STEPS)
        self._cache_lookups = m.counter(DitMetrics.CACHE_LOOKUPS)
        self._cache_hits = m.counter(DitMetrics.CACHE_HITS)
        self._cache_seen = dict(self.runner.cache_stats)

    def execute(self, requests):
        return self._execute(requests)
    def _run(self, items):
        results = self.runner.run(items)
        stats = dict(self.runner.cache_stats)
        self._cache_lookups.increment(stats["lookups"] - self._cache_seen["lookups"])
        self._cache_hits.increment(stats["hits"] - self._cache_seen["hits"])
        self._cache_seen = stats
        return results

    def _response(self, request, item, image: np.ndarray):
        self._images.increment(1)
        self._steps.increment(item.num_inference_steps)
        pb_utils = pb()
        wanted = set(request.requested_output_names() or (DIT.IMAGE, DIT.IMAGE_RAW))
        tensors = []
        if DIT.IMAGE in wanted:
            tensors.append(pb_utils.Tensor(DIT.IMAGE,
                                           np.array([[encode_png(image)]], dtype=np.object_)))
        if DIT.IMAGE_RAW in wanted:
            tensors.append(pb_utils.Tensor(DIT.IMAGE_RAW, image[np.newaxis]))
        return pb_utils.InferenceResponse(output_tensors=tensors)

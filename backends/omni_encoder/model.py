"""Triton adapter of a modality encoder (`backend: "omni_encoder"`), loaded by the Python stub.

Thin by design: Triton's dynamic batcher hands execute() a list of requests,
one media item each; the items run through EncoderRunner (decoded one by one,
images encoded in one tower forward) and each request gets, for an image, its
embedding rows (`[1, tokens, hidden]`) and patch grid, for audio its log-mel
features (`[1, mel bins, frames]`). A bad item gets its own INVALID_ARG
response; its batch-mates are served.
"""
from __future__ import annotations

import logging

import numpy as np

from omni_serve.adapter import StageModel
from omni_serve.batched_adapter import BatchedExecute
from omni_serve.contract import ENCODER, ENCODER_CONTRACT
from omni_serve.encoder.config import EncoderStageConfig
from omni_serve.encoder.runner import EncoderOutput, EncoderRunner
from omni_serve.errors import RequestError
from omni_serve.metrics_table import EncoderMetrics
from omni_serve.tritonio import (
    Metrics,
    pb,
    read_inputs,
    stage_config,
)

log = logging.getLogger("omni_encoder")


def _media(request) -> bytes:
    media = read_inputs(request, ENCODER_CONTRACT)[ENCODER.MEDIA]
    if media is None or media.size != 1:
        raise RequestError(ENCODER.MEDIA, "send exactly one encoded media item")
    item = media.reshape(-1)[0]
    return item.encode() if isinstance(item, str) else bytes(item)


class TritonPythonModel(StageModel):
    CONTRACT = ENCODER_CONTRACT

    def initialize(self, args):
        self.set_up(args)
        self.cfg = stage_config(args, EncoderStageConfig)
        self.runner = EncoderRunner(self.cfg)
        labels = {"model": self.model_name, "modality": self.cfg.modality}
        self._metrics = m = Metrics(labels)  # families must outlive metrics
        self._items = m.counter(EncoderMetrics.ITEMS)
        self._tokens = m.counter(EncoderMetrics.TOKENS)
        self._execute = BatchedExecute(
            m, EncoderMetrics,
            parse=_media, run=lambda items: self.runner.run(items), respond=self._response)

    def execute(self, requests):
        return self._execute(requests)
    def _response(self, request, media: bytes, out: EncoderOutput):
        self._items.increment(1)
        self._tokens.increment(out.tokens)
        pb_utils = pb()
        wanted = set(request.requested_output_names()
                     or (ENCODER.EMBEDDINGS, ENCODER.GRID_THW, ENCODER.FEATURES))
        tensors = []
        for name, value in ((ENCODER.EMBEDDINGS, out.embeddings), (ENCODER.GRID_THW, out.grid_thw),
                            (ENCODER.FEATURES, out.features)):
            if name in wanted and value is not None:
                tensors.append(pb_utils.Tensor(name, value[np.newaxis]))
        return pb_utils.InferenceResponse(output_tensors=tensors)

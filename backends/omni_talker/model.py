"""Triton adapter of the talker (`backend: "omni_talker"`), loaded by the Python stub.

Thin by design: omni_serve.engine_adapter runs the vLLM-hosted stage's Triton
side; here only which stage (omni_serve.talker.stage.TalkerStage), how a
request is parsed and how codec codes become a decoupled response.
"""
from __future__ import annotations

import numpy as np

from omni_serve.contract import TALKER, TALKER_CONTRACT
from omni_serve.engine_adapter import EngineStageModel
from omni_serve.talker.request import merge_outputs, parse_request
from omni_serve.talker.stage import TalkerStage
from omni_serve.tritonio import make_response


class TritonPythonModel(EngineStageModel):
    CONTRACT = TALKER_CONTRACT

    def make_stage(self, engine_args, metrics):
        return TalkerStage(engine_args, metrics=metrics, name=self.model_name)

    def parse(self, request_id, tensors, parameters):
        return parse_request(request_id, tensors, parameters)

    def response(self, request, outputs):
        out = merge_outputs(outputs)
        tensors = {TALKER.CODEC_IDS: np.ascontiguousarray(out.codes, dtype=np.int64)}
        if out.final:
            tensors[TALKER.FINISH_REASON] = np.array([(out.finish_reason or "").encode()],
                                                     dtype=np.object_)
        return make_response(tensors), out.final

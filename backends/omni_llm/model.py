"""Triton adapter of the LLM core (`backend: "omni_llm"`), loaded by the Python stub.

Thin by design: omni_serve.engine_adapter runs the vLLM-hosted stage's Triton
side; here only which stage (omni_serve.llm.stage.LLMStage), how a request is
parsed and how an LLMOutput becomes a decoupled response.
"""
from __future__ import annotations

import numpy as np

from omni_serve.contract import LLM, LLM_CONTRACT
from omni_serve.engine_adapter import EngineStageModel
from omni_serve.llm.request import LLMOutput, LLMRequest, merge_outputs, parse_request
from omni_serve.llm.stage import LLMStage
from omni_serve.tritonio import make_response


def _response(req: LLMRequest, out: LLMOutput):
    tensors = {LLM.TEXT_OUTPUT: np.array([out.text.encode("utf-8")], dtype=np.object_)}
    if req.return_finish_reason:
        tensors[LLM.FINISH_REASON] = np.array([(out.finish_reason or "").encode()],
                                              dtype=np.object_)
    if req.return_num_input_tokens:
        tensors[LLM.NUM_INPUT_TOKENS] = np.array([out.num_input_tokens], dtype=np.uint32)
    if req.return_num_output_tokens:
        tensors[LLM.NUM_OUTPUT_TOKENS] = np.array([out.num_output_tokens], dtype=np.uint32)
    if req.return_token_ids:
        tensors[LLM.TOKEN_IDS] = np.array(out.token_ids, dtype=np.int64)
    if req.return_input_token_ids and out.input_token_ids is not None:
        tensors[LLM.INPUT_TOKEN_IDS] = np.array(out.input_token_ids, dtype=np.int64)
    if out.hidden_span is not None:
        tensors[LLM.HIDDEN_STATES_FILE] = np.array([out.hidden_file.encode()], dtype=np.object_)
        tensors[LLM.HIDDEN_STATES_ROWS] = np.array(out.hidden_span, dtype=np.int64)
    if req.return_hidden_states and out.hidden is not None:
        width = out.hidden.shape[1] // 2
        tensors[LLM.INPUT_EMBEDS] = np.ascontiguousarray(out.hidden[:, :width])
        tensors[LLM.HIDDEN_STATES] = np.ascontiguousarray(out.hidden[:, width:])
    return make_response(tensors)


class TritonPythonModel(EngineStageModel):
    CONTRACT = LLM_CONTRACT

    def make_stage(self, engine_args, metrics):
        return LLMStage(engine_args, metrics=metrics, name=self.model_name)

    def parse(self, request_id, tensors, parameters):
        return parse_request(request_id, tensors, parameters)

    def response(self, request, outputs):
        return _response(request, merge_outputs(outputs)), outputs[-1].final

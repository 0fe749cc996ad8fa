"""Triton adapter of the LLM core (`backend: "omni_llm"`), loaded by the Python stub.

Thin by design: omni_serve.engine_adapter runs the vLLM-hosted stage's Triton
side; here only which stage (omni_serve.llm.stage.LLMStage, with the model's LoRA
adapters and, with REPORT_CUSTOM_METRICS, vllm_backend's vllm:* metrics), how a
request is parsed and how an LLMOutput becomes a decoupled response.
"""
from __future__ import annotations

import json

import numpy as np

from omni_serve.contract import LLM, LLM_CONTRACT, REPORT_CUSTOM_METRICS
from omni_serve.engine_adapter import EngineStageModel, VllmBackendReporter, config_flag
from omni_serve.llm import logprobs
from omni_serve.llm.lora import LoraTable
from omni_serve.llm.metrics import vllm_backend_stat_logger
from omni_serve.llm.request import LLMOutput, LLMRequest, merge_outputs, parse_request
from omni_serve.llm.stage import LLMStage
from omni_serve.tritonio import make_response


def _texts(values) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def _response(req: LLMRequest, out: LLMOutput):
    seqs = out.sequences or (out,)  # per-sequence tensors are n wide, as vllm_backend's
    if out.embedding is not None:  # vllm_backend's embedding response
        tensors = {LLM.TEXT_OUTPUT: _texts([json.dumps(out.embedding)])}
    else:
        tensors = {LLM.TEXT_OUTPUT: _texts(s.text for s in seqs)}
        if req.return_finish_reason:  # "None" until the last, as vllm_backend sends it
            tensors[LLM.FINISH_REASON] = _texts(str(s.finish_reason) for s in seqs)
        if req.return_cumulative_logprob:  # NaN where vLLM computed none
            tensors[LLM.CUMULATIVE_LOGPROB] = np.array(
                [np.nan if s.cumulative_logprob is None else s.cumulative_logprob for s in seqs],
                dtype=np.float32)
        if req.return_logprobs:
            tensors[LLM.LOGPROBS] = _texts(logprobs.to_json(s.logprobs) for s in seqs)
    if req.return_num_input_tokens:
        tensors[LLM.NUM_INPUT_TOKENS] = np.array([out.num_input_tokens], dtype=np.uint32)
    if req.return_num_output_tokens:
        tensors[LLM.NUM_OUTPUT_TOKENS] = np.array([s.num_output_tokens for s in seqs],
                                                  dtype=np.uint32)
    if req.return_token_ids:
        tensors[LLM.TOKEN_IDS] = np.array(out.token_ids, dtype=np.int64)
    if req.return_input_token_ids and out.input_token_ids is not None:
        tensors[LLM.INPUT_TOKEN_IDS] = np.array(out.input_token_ids, dtype=np.int64)
    if out.hidden_span is not None:
        tensors[LLM.HIDDEN_STATES_FILE] = _texts([out.hidden_file])
        tensors[LLM.HIDDEN_STATES_ROWS] = np.array(out.hidden_span, dtype=np.int64)
    if req.return_hidden_states and out.hidden is not None:
        width = out.hidden.shape[1] // 2
        tensors[LLM.INPUT_EMBEDS] = np.ascontiguousarray(out.hidden[:, :width])
        tensors[LLM.HIDDEN_STATES] = np.ascontiguousarray(out.hidden[:, width:])
    return make_response(tensors)


class TritonPythonModel(EngineStageModel):
    CONTRACT = LLM_CONTRACT
    vllm_metrics: VllmBackendReporter | None = None

    def make_stage(self, engine_args, metrics):
        loggers = []
        # vllm_backend reports them only when the engine keeps its stats (disable_log_stats
        # left off in model.json)
        if config_flag(self.model_config, REPORT_CUSTOM_METRICS) and not engine_args.get(
                "disable_log_stats", False):
            self.vllm_metrics = VllmBackendReporter(self.model_name, self.model_version)
            loggers.append(vllm_backend_stat_logger(self.vllm_metrics.report,
                                                    self.vllm_metrics.configure))
        return LLMStage(engine_args, metrics=metrics, name=self.model_name,
                        loras=LoraTable.load(engine_args, self.engine_args_dir),
                        stat_loggers=loggers)

    def parse(self, request_id, tensors, parameters):
        return parse_request(request_id, tensors, parameters)

    def response(self, request, outputs):
        return _response(request, merge_outputs(outputs)), outputs[-1].final

    def finalize(self):
        super().finalize()
        if self.vllm_metrics is not None:
            self.vllm_metrics.close()

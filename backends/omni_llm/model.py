"""Triton adapter of the LLM core (`backend: "omni_llm"`), loaded by the Python stub.

Thin by design: reads the per-stage engine.json, starts an LLMStage, turns
each Triton request into an LLMRequest and each LLMOutput into a decoupled
response. The logic lives in omni_serve.llm (unit-tested without Triton).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time

import numpy as np

from omni_serve.adapter import StageModel
from omni_serve.contract import ENGINE_ARGS_FILE, LLM, LLM_CONTRACT
from omni_serve.errors import StageUnavailableError
from omni_serve.llm.request import LLMOutput, LLMRequest, merge_outputs, parse_request
from omni_serve.llm.stage import LLMStage
from omni_serve.processes import exit_with_parent
from omni_serve.tritonio import (
    Metrics,
    Outbox,
    make_response,
    pb,
    read_inputs,
    request_parameters,
)

log = logging.getLogger("omni_llm")

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class _TritonMetrics:
    """StageMetrics on Triton's /metrics endpoint."""

    def __init__(self, model_name: str):
        m = Metrics({"model": model_name})
        self._m = m
        self._ttft = m.histogram("omni_llm_time_to_first_token_seconds",
                                 "Time from request arrival to the first generated token",
                                 _LATENCY_BUCKETS)
        self._tpot = m.histogram("omni_llm_time_per_output_token_seconds",
                                 "Per request: decode time / (output tokens - 1)", _LATENCY_BUCKETS)
        self._prompt = m.counter("omni_llm_prompt_tokens_total", "Prompt tokens processed")
        self._gen = m.counter("omni_llm_generation_tokens_total", "Tokens generated")
        self._queue = m.histogram("omni_llm_queue_time_seconds",
                                  "Per finished request: time in vLLM's waiting queue, queued to "
                                  "first scheduled", _LATENCY_BUCKETS)
        self._running = m.gauge("omni_llm_engine_running_requests",
                                "Requests the vLLM scheduler is running")
        self._waiting = m.gauge("omni_llm_engine_waiting_requests",
                                "Requests waiting in the vLLM scheduler")
        self._in_flight = m.gauge("omni_llm_requests_in_flight",
                                  "Requests the stage holds: submitted, their last output not yet "
                                  "handed to the response sender (exact, unlike the engine gauges)")
        # hit rate = hits / queries (vLLM's vllm:prefix_cache_queries / _hits)
        self._cache_queries = m.counter("omni_llm_prefix_cache_queries_total",
                                        "Prompt tokens looked up in vLLM's prefix cache")
        self._cache_hits = m.counter("omni_llm_prefix_cache_hits_total",
                                     "Prompt tokens found in vLLM's prefix cache (not recomputed)")

    def time_to_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def time_per_output_token(self, seconds: float) -> None:
        self._tpot.observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        self._prompt.increment(prompt)
        self._gen.increment(generated)

    def scheduler(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)

    def prefix_cache(self, queries: int, hits: int) -> None:
        self._cache_queries.increment(queries)
        self._cache_hits.increment(hits)

    def in_flight(self, requests: int) -> None:
        self._in_flight.set(requests)

    def queue_time(self, seconds: float) -> None:
        self._queue.observe(seconds)


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


def _abort_ack(found: bool):
    return make_response({LLM.FINISH_REASON: np.array([b"abort" if found else b"not_found"],
                                                      dtype=np.object_)})


class TritonPythonModel(StageModel):
    CONTRACT = LLM_CONTRACT

    def initialize(self, args):
        self.set_up(args)
        # Three busy Python threads share the stub's GIL (Triton's execute, the
        # engine loop, the sender); a 0.5 ms switch interval instead of 5 ms
        # measured 1.8x the streamed tokens/s at concurrency 32 (tiny model).
        sys.setswitchinterval(float(os.environ.get("OMNI_GIL_SWITCH_INTERVAL_S", "0.0005")))
        path = os.path.join(args["model_repository"], ENGINE_ARGS_FILE)
        with open(path) as f:
            engine_args = json.load(f)
        self._ids = itertools.count()
        self.stage = LLMStage(engine_args, metrics=_TritonMetrics(self.model_name),
                              name=self.model_name)
        self.stage.on_dead = self.take_out_of_service
        self.stage.start()
        if self.stage.warmup_report:
            pb().Logger.log_info(f"{self.model_name}: {self.stage.warmup_report}")
        exit_with_parent(lambda: self.stage.shutdown(timeout=5))

    def execute(self, requests):
        for request in requests:
            arrival = time.perf_counter()
            response_sender = request.get_response_sender()
            client_id = request.request_id() or ""
            request_id = f"{self.model_name}-{next(self._ids)}-{client_id}"
            params = request_parameters(request)
            if LLM.ABORT_PARAMETER in params:  # a control request: abort, answer at once
                found = self.stage.abort_client(str(params[LLM.ABORT_PARAMETER]))
                Outbox(self.sender, response_sender,
                       merge=lambda items: (_abort_ack(items[0]), True)).send(found)
                continue
            if not self.stage.healthy():  # its engine died: UNAVAILABLE, whatever it asks
                self.sender.send_error(response_sender, StageUnavailableError(self.stage.dead))
                continue
            try:
                req = parse_request(request_id, read_inputs(request, LLM_CONTRACT), params)
            except Exception as e:
                self.sender.send_error(response_sender, e)
                continue
            outbox = Outbox(self.sender, response_sender,
                            merge=lambda outs, req=req: (_response(req, merge_outputs(outs)),
                                                         outs[-1].final),
                            on_cancel=lambda rid=request_id: self.stage.abort(rid))
            self.stage.submit(req, outbox, arrival, client_id=client_id or None)
        return None

    def is_model_ready(self) -> bool:
        """Readiness, on Triton releases whose Python backend asks the model (2.51 never
        does): not ready once the engine has died."""
        return self.stage.healthy()

    def finalize(self):
        self.stage.shutdown()
        self.sender.close()

"""The Triton side of a vLLM-hosted stage (omni_llm, omni_talker): runs in the Triton stub.

`EngineStageModel` is the base of those backends' TritonPythonModel: it reads
the stage's engine.json, starts the stage (which owns an llm/engine_host.py
EngineHost), and per request answers the in-band abort, UNAVAILABLE once the
engine died, the request's parse error, or submits it with an Outbox that
merges what the sender has not sent yet. A subclass says which stage class,
how to parse a request and how to build a response. `EngineMetrics` are the
host's per-request figures on Triton's /metrics endpoint.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from typing import Any

import numpy as np

from omni_serve import env
from omni_serve.adapter import StageModel
from omni_serve.contract import ENGINE_ARGS_FILE, LLM
from omni_serve.errors import StageUnavailableError
from omni_serve.metrics_table import LlmMetrics
from omni_serve.processes import exit_with_parent
from omni_serve.tritonio import Metrics, Outbox, make_response, pb, read_inputs, request_parameters


class EngineMetrics:
    """StageMetrics on Triton's /metrics endpoint (metrics_table.LlmMetrics, label model)."""

    def __init__(self, model_name: str):
        m = Metrics({"model": model_name})
        self._m = m
        self._ttft = m.histogram(LlmMetrics.TIME_TO_FIRST_TOKEN)
        self._tpot = m.histogram(LlmMetrics.TIME_PER_OUTPUT_TOKEN)
        self._prompt = m.counter(LlmMetrics.PROMPT_TOKENS)
        self._gen = m.counter(LlmMetrics.GENERATION_TOKENS)
        self._queue = m.histogram(LlmMetrics.QUEUE_TIME)
        self._running = m.gauge(LlmMetrics.ENGINE_RUNNING)
        self._waiting = m.gauge(LlmMetrics.ENGINE_WAITING)
        self._in_flight = m.gauge(LlmMetrics.REQUESTS_IN_FLIGHT)
        self._cache_queries = m.counter(LlmMetrics.PREFIX_CACHE_QUERIES)
        self._cache_hits = m.counter(LlmMetrics.PREFIX_CACHE_HITS)

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


def _abort_ack(found: bool):
    return make_response({LLM.FINISH_REASON: np.array([b"abort" if found else b"not_found"],
                                                      dtype=np.object_)})


class EngineStageModel(StageModel):
    """initialize / execute / is_model_ready / finalize of a vLLM-hosted stage."""

    def make_stage(self, engine_args: dict[str, Any], metrics: EngineMetrics) -> Any:
        raise NotImplementedError

    def parse(self, request_id: str, tensors: dict, parameters: dict) -> Any:
        raise NotImplementedError

    def response(self, request: Any, outputs: list) -> tuple[Any, bool]:
        """(Triton response, final) for consecutive outputs of `request` not yet sent."""
        raise NotImplementedError

    def initialize(self, args):
        self.set_up(args)
        # Three busy Python threads share the stub's GIL (Triton's execute, the
        # engine loop, the sender); a 0.5 ms switch interval instead of 5 ms
        # measured 1.8x the streamed tokens/s at concurrency 32 (tiny model).
        sys.setswitchinterval(float(env.GIL_SWITCH_INTERVAL_S.get()))
        path = os.path.join(args["model_repository"], ENGINE_ARGS_FILE)
        with open(path) as f:
            engine_args = json.load(f)
        self._ids = itertools.count()
        self.stage = self.make_stage(engine_args, EngineMetrics(self.model_name))
        self.host = self.stage.host
        self.host.on_dead = self.take_out_of_service
        self.stage.start()
        if self.host.warmup_report:
            pb().Logger.log_info(f"{self.model_name}: {self.host.warmup_report}")
        exit_with_parent(lambda: self.host.shutdown(timeout=5))

    def execute(self, requests):
        for request in requests:
            arrival = time.perf_counter()
            response_sender = request.get_response_sender()
            client_id = request.request_id() or ""
            request_id = f"{self.model_name}-{next(self._ids)}-{client_id}"
            params = request_parameters(request)
            if LLM.ABORT_PARAMETER in params:  # a control request: abort, answer at once
                found = self.host.abort_client(str(params[LLM.ABORT_PARAMETER]))
                Outbox(self.sender, response_sender,
                       merge=lambda items: (_abort_ack(items[0]), True)).send(found)
                continue
            if not self.host.healthy():  # its engine died: UNAVAILABLE, whatever it asks
                self.sender.send_error(response_sender, StageUnavailableError(self.host.dead))
                continue
            try:
                req = self.parse(request_id, read_inputs(request, self.CONTRACT), params)
            except Exception as e:
                self.sender.send_error(response_sender, e)
                continue
            outbox = Outbox(self.sender, response_sender,
                            merge=lambda outs, req=req: self.response(req, outs),
                            on_cancel=lambda rid=request_id: self.host.abort(rid))
            self.host.submit(req, outbox, arrival, client_id=client_id or None)
        return None

    def is_model_ready(self) -> bool:
        """Readiness, on Triton releases whose Python backend asks the model (2.51 never
        does): not ready once the engine has died."""
        return self.host.healthy()

    def finalize(self):
        self.host.shutdown()
        self.sender.close()

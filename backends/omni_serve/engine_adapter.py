"""The Triton side of a vLLM-hosted stage (omni_llm, omni_talker): runs in the Triton stub.

`EngineStageModel` is the base of those backends' TritonPythonModel: it reads
the stage's engine arguments (engine.json, or a vllm_backend repository's
<version>/model.json: llm/engine_args.py), starts the stage (which owns an
llm/engine_host.py EngineHost), and per request answers the in-band abort,
UNAVAILABLE once the engine died, the request's parse error, or submits it with
an Outbox that merges what the sender has not sent yet. A subclass says which
stage class, how to parse a request and how to build a response. `EngineMetrics`
are the host's per-request figures on Triton's /metrics endpoint; with the
config parameter REPORT_CUSTOM_METRICS, `VllmBackendReporter` adds vllm_backend's
vllm:* families, and with ENABLE_VLLM_HEALTH_CHECK each execute() asks vLLM's
check_health() first, as vllm_backend does.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import queue
import sys
import threading
import time
from typing import Any

import numpy as np

from omni_serve import env
from omni_serve.adapter import StageModel
from omni_serve.contract import ENABLE_VLLM_HEALTH_CHECK, LLM
from omni_serve.errors import StageUnavailableError
from omni_serve.llm import engine_args as engine_args_file
from omni_serve.llm.metrics import Samples
from omni_serve.metrics_table import LlmMetrics, VllmBackendMetrics, one_two_five
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
        self._rows_recomputed = m.counter(LlmMetrics.ROWS_RECOMPUTED)

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

    def rows_recomputed(self) -> None:
        self._rows_recomputed.increment(1)

    def in_flight(self, requests: int) -> None:
        self._in_flight.set(requests)

    def queue_time(self, seconds: float) -> None:
        self._queue.observe(seconds)


class VllmBackendReporter:
    """vllm_backend's vllm:* families (metrics_table.VllmBackendMetrics, labels model and
    version), fed by llm/metrics.vllm_backend_stat_logger. The families are created when
    the engine's stat logger is (`configure`, which knows max_model_len); Triton's metric
    calls run on a thread of their own, so the engine loop never waits for them."""

    TOKEN_HISTOGRAMS = (VllmBackendMetrics.REQUEST_PROMPT_TOKENS,
                        VllmBackendMetrics.REQUEST_GENERATION_TOKENS)

    def __init__(self, model_name: str, version: str):
        self._labels = {"model": model_name, "version": str(version)}
        self._metrics: dict[str, Any] = {}
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{model_name}-vllm-metrics",
                                        daemon=True)

    def configure(self, max_model_len: int) -> None:
        if self._metrics:
            return
        m = self._families = Metrics(self._labels)  # held: a family outlives its metrics
        for spec in VllmBackendMetrics.ALL:
            if spec.kind == "counter":
                self._metrics[spec.name] = m.counter(spec)
            else:
                if spec in self.TOKEN_HISTOGRAMS:
                    spec = dataclasses.replace(spec, buckets=one_two_five(max_model_len))
                self._metrics[spec.name] = m.histogram(spec)
        self._thread.start()

    def report(self, samples: Samples) -> None:
        self._q.put(samples)

    def _run(self) -> None:
        while (samples := self._q.get()) is not None:
            for spec, values in samples:
                metric = self._metrics[spec.name]
                if spec.kind == "counter":
                    metric.increment(values[0])
                else:
                    for value in values:
                        metric.observe(value)

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=5)


# vllm_backend's text for a request that finds the engine unhealthy, verbatim
UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"


def config_flag(model_config: dict, name: str) -> bool:
    """A config.pbtxt parameter read as vllm_backend reads it: on when "true" (any case)."""
    value = (model_config.get("parameters") or {}).get(name) or {}
    return str(value.get("string_value", "")).lower() == "true"


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
        self.model_config = json.loads(args["model_config"])
        self.model_version = str(args.get("model_version", "1"))
        engine_args, self.engine_args_dir = engine_args_file.read(args["model_repository"],
                                                                  self.model_version)
        engine_args_file.check_instance_kind(engine_args, args.get("model_instance_kind", ""))
        self.vllm_health_check = config_flag(self.model_config, ENABLE_VLLM_HEALTH_CHECK)
        self._ids = itertools.count()
        self.stage = self.make_stage(engine_args, EngineMetrics(self.model_name))
        self.host = self.stage.host
        self.host.on_dead = self.take_out_of_service
        self.stage.start()
        if self.host.warmup_report:
            pb().Logger.log_info(f"{self.model_name}: {self.host.warmup_report}")
        exit_with_parent(lambda: self.host.shutdown(timeout=5))

    def execute(self, requests):
        if self.vllm_health_check and not self.host.check_health():
            for request in requests:  # vllm_backend's answer, whatever the request asks
                self.sender.send_error(request.get_response_sender(),
                                       StageUnavailableError(UNHEALTHY))
            return None
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

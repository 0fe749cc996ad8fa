"""Triton adapter of the orchestrator (`backend: "omni_orchestrator"`), loaded by the Python stub.

Thin by design: engine.json -> OrchestratorConfig; each request is parsed,
then runs as one task of OmniPipeline on the orchestrator's own event loop,
calling the other stages over Triton gRPC (this server's own endpoint, or
another server's for a remote stage).
Its events go out through the shared
ResponseSender (text deltas, audio chunks and codec ids that pile up are
merged into one response); a client cancel cancels the task, which aborts
every child stream. Per-request timings feed Triton's /metrics.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import threading
import time

import numpy as np

from omni_serve.adapter import StageModel
from omni_serve.contract import OMNI, OMNI_CONTRACT
from omni_serve.metrics_table import STAGE_ROLES, OrchestratorMetrics
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.locality import local_grpc_url, remote_endpoints
from omni_serve.orchestrator.pipeline import (
    AudioChunk,
    CodecIds,
    Final,
    ImageOut,
    OmniPipeline,
    TextDelta,
)
from omni_serve.orchestrator.prompt import ChatPrompt
from omni_serve.orchestrator.request import parse_request
from omni_serve.orchestrator.stage_clients import RoutingStageClient, stage_client
from omni_serve.tritonio import (
    Metrics,
    Outbox,
    make_response,
    read_inputs,
    stage_config,
)

log = logging.getLogger("omni_orchestrator")


def response_tensors(events: list) -> tuple[dict[str, np.ndarray], bool]:
    """The output tensors of one response carrying `events` (in order), and whether it is final.

    Events that piled up are merged: text and codec ids concatenated, audio
    chunks joined, the last image kept; codec ids stay [frames, groups].
    """
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    audio = [e for e in events if isinstance(e, AudioChunk)]
    images = [e for e in events if isinstance(e, ImageOut)]
    codec_ids = [f for e in events if isinstance(e, CodecIds) for f in e.frames]
    final = next((e for e in events if isinstance(e, Final)), None)
    tensors: dict[str, np.ndarray] = {}
    if text:
        tensors[OMNI.TEXT_OUTPUT] = np.array([text.encode("utf-8")], dtype=np.object_)
    if audio:
        tensors[OMNI.AUDIO_CHUNK] = np.concatenate([a.pcm for a in audio]).astype(np.float32)
        tensors[OMNI.SAMPLE_RATE] = np.array([audio[0].sample_rate], dtype=np.int32)
    if images:
        tensors[OMNI.IMAGE_OUTPUT] = np.array([images[-1].png], dtype=np.object_)
    if codec_ids:
        tensors[OMNI.CODEC_IDS] = np.array(codec_ids, dtype=np.int64)
    if final is not None:
        tensors[OMNI.FINISH_REASON] = np.array([final.finish_reason.encode()], dtype=np.object_)
        tensors[OMNI.METRICS] = np.array([json.dumps(final.metrics).encode()], dtype=np.object_)
    return tensors, final is not None


def _response(events: list):
    tensors, final = response_tensors(events)
    return make_response(tensors), final


class _CancelLatch:
    """Cancels a request's task, also when the client cancelled before it started.

    The task cancels itself (attach runs inside it), never its future from
    outside: a task cancelled before its first step would never enter `_run`,
    so the request would get no final response and stay counted in flight.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._cancel = None
        self._cancelled = False

    def set(self) -> None:
        with self._lock:
            self._cancelled = True
            cancel = self._cancel
        if cancel is not None:
            cancel()

    def attach(self, cancel) -> None:
        with self._lock:
            self._cancel = cancel
            cancelled = self._cancelled
        if cancelled:
            cancel()


def _chat_prompt(cfg: OrchestratorConfig) -> ChatPrompt:
    """The thinker's chat template and tokenizer, from the folder the config names."""
    if not cfg.tokenizer:
        raise ValueError("engine_args \"tokenizer\" is required: the thinker's checkpoint "
                         "folder, whose chat template renders its prompts (omni-gen-repo "
                         "writes it)")
    return ChatPrompt.load(cfg.tokenizer)


class TritonPythonModel(StageModel):
    CONTRACT = OMNI_CONTRACT
    WATCHED = False  # the orchestrator calls stages; nothing calls it

    def initialize(self, args):
        self.set_up(args)
        self.cfg = stage_config(args, OrchestratorConfig)
        self._ids = itertools.count()
        # Child request ids name the request a stage is asked to abort in-band: unique
        # across instances and servers that share a stage.
        self._instance_tag = secrets.token_hex(3)
        remote = remote_endpoints(self.cfg)
        self.client = stage_client(self.cfg.triton_url or local_grpc_url(), remote,
                                   call_timeout_s=self.cfg.stage_timeout_s,
                                   retry_after_s=self.cfg.engine_retry_after_s,
                                   watch_stubs=not self.cfg.triton_url)
        log.info("[%s] calling stages over gRPC (remote: %s)", self.model_name, remote or "none")
        self.pipeline = OmniPipeline(self.cfg, self.client, _chat_prompt(self.cfg))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever,
                                        name=f"{self.model_name}-loop", daemon=True)
        self._thread.start()
        self._wait_for_remote_stages()
        self._ready, self._ready_at = True, time.monotonic()
        self._create_metrics()
        self._in_flight_lock = threading.Lock()
        self._in_flight_n = 0

    # --- readiness: the remote stages ----------------------------------------------------
    def _remote_unready(self, timeout_s: float = 60.0) -> dict[str, str]:
        """Each remote stage ready on no server (or replica) of it now, and why."""
        if not isinstance(self.client, RoutingStageClient):
            return {}
        return asyncio.run_coroutine_threadsafe(self.client.remote_unready(),
                                                self.loop).result(timeout=timeout_s)

    def _wait_for_remote_stages(self) -> None:
        """Return once every remote stage is ready somewhere, so that this model, and with
        it the server's readiness, turns ready only then (Triton 2.51 asks a Python model
        nothing after its load); RuntimeError naming those not ready within
        remote_ready_timeout_s."""
        timeout = self.cfg.remote_ready_timeout_s
        if not timeout or not isinstance(self.client, RoutingStageClient):
            return
        deadline = time.monotonic() + timeout
        told = float("-inf")
        while unready := self._remote_unready():
            now = time.monotonic()
            where = "; ".join(f"{model}: {why}" for model, why in unready.items())
            if now >= deadline:
                raise RuntimeError(
                    f"{self.model_name}: remote stages not ready after {timeout:g} s ({where}); "
                    "start their servers, or raise remote_ready_timeout_s (0 loads without "
                    "waiting)")
            if now - told >= 30:
                log.info("[%s] waiting for remote stages: %s", self.model_name, where)
                told = now
            time.sleep(min(1.0, deadline - now))

    def is_model_ready(self) -> bool:
        """Readiness, on releases whose Python backend asks the model (2.51 never does):
        not ready while a remote stage is ready on no server or replica (asked at most
        every 5 s)."""
        now = time.monotonic()
        if now - self._ready_at >= 5.0:
            try:
                self._ready = not self._remote_unready(timeout_s=10.0)
            except Exception as e:
                log.warning("[%s] asking the remote stages: %s", self.model_name, e)
                self._ready = False
            self._ready_at = now
        return self._ready

    def _create_metrics(self) -> None:
        """metrics_table.OrchestratorMetrics, label model."""
        self._metrics = m = Metrics({"model": self.model_name})  # families must outlive metrics
        self._ttft = m.histogram(OrchestratorMetrics.TIME_TO_FIRST_TOKEN)
        self._ttfa = m.histogram(OrchestratorMetrics.TIME_TO_FIRST_AUDIO)
        self._rtf = m.histogram(OrchestratorMetrics.AUDIO_REAL_TIME_FACTOR)
        self._stage = m.histograms(OrchestratorMetrics.STAGE_LATENCY, "stage", STAGE_ROLES)
        self._passed_over = m.counters(OrchestratorMetrics.THINKER_FAILOVERS, "engine",
                                       self.cfg.stages.thinkers)
        self._in_flight = m.gauge(OrchestratorMetrics.REQUESTS_IN_FLIGHT)

    def execute(self, requests):
        for request in requests:
            received = time.perf_counter()  # the request's start in its timings
            response_sender = request.get_response_sender()
            request_id = f"{self.model_name}-{self._instance_tag}-{next(self._ids)}"
            try:
                req = parse_request(request_id, read_inputs(request, OMNI_CONTRACT), self.cfg)
            except Exception as e:
                self.sender.send_error(response_sender, e)
                continue
            # Watched for cancellation from the start (Outbox.__init__): a request
            # must never be watched after its FINAL response went out, because
            # is_cancelled() on a finished request segfaults Triton 2.51's stub.
            cancel = _CancelLatch()
            outbox = Outbox(self.sender, response_sender, merge=_response, on_cancel=cancel.set)
            self._count_in_flight(+1)
            asyncio.run_coroutine_threadsafe(self._run(req, outbox, cancel, received), self.loop)
        return None

    async def _run(self, req, outbox: Outbox, cancel: _CancelLatch,
                   received: float | None = None) -> None:
        task = asyncio.current_task()
        try:
            cancel.attach(lambda: self.loop.call_soon_threadsafe(task.cancel))
            await self.pipeline.run(req, lambda event: self._emit(outbox, event), received)
        except asyncio.CancelledError:
            outbox.send(Final("cancelled", {}))
        except Exception as e:
            log.warning("[%s] request %s failed: %s", self.model_name, req.request_id, e)
            outbox.fail(e)
        finally:
            self._count_in_flight(-1)

    def _count_in_flight(self, delta: int) -> None:
        with self._in_flight_lock:
            self._in_flight_n += delta
            self._in_flight.set(self._in_flight_n)

    def _emit(self, outbox: Outbox, event) -> None:
        if isinstance(event, Final):
            self._observe(event.metrics)
        outbox.send(event)

    def _observe(self, metrics: dict) -> None:
        if metrics.get("time_to_first_token_s") is not None:
            self._ttft.observe(metrics["time_to_first_token_s"])
        if metrics.get("time_to_first_audio_s") is not None:
            self._ttfa.observe(metrics["time_to_first_audio_s"])
        if metrics.get("audio_rtf") is not None:
            self._rtf.observe(metrics["audio_rtf"])
        for role, seconds in metrics.get("stage_seconds", {}).items():
            if role in self._stage:
                self._stage[role].observe(seconds)
        for engine in metrics.get("thinker_passed_over", ()):
            self._passed_over[engine].increment(1)

    def finalize(self):
        for task in asyncio.all_tasks(self.loop):
            self.loop.call_soon_threadsafe(task.cancel)
        # unregisters the shared-memory regions a remote server may still hold
        try:
            asyncio.run_coroutine_threadsafe(self.client.close(), self.loop).result(timeout=10)
        except Exception as e:
            log.warning("[%s] closing the stage clients: %s", self.model_name, e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.sender.close()

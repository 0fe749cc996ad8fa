"""What the LLM stage reports, and the vLLM stat logger that feeds it.

Runs in the omni_llm stub process. LLMStage calls a `StageMetrics` (the
adapter's maps it onto Triton custom metrics; `NullMetrics` drops it) per
request, and vLLM's engine calls the stat logger made by
`stat_logger_factory` once per engine step with its scheduler stats.
`Sink` is where one request's outputs go. With REPORT_CUSTOM_METRICS on, a second
stat logger (`vllm_backend_stat_logger`) feeds Triton vllm_backend's vllm:* families.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from omni_serve.llm.request import LLMOutput
from omni_serve.metrics_table import MetricSpec, VllmBackendMetrics


class Sink(Protocol):
    """Where one request's outputs go (the adapter wraps Triton's response sender)."""

    def send(self, output: LLMOutput) -> None: ...
    def fail(self, error: Exception) -> None: ...


class StageMetrics(Protocol):
    """What the stage reports; the adapter maps it onto Triton custom metrics."""

    def time_to_first_token(self, seconds: float) -> None: ...
    def time_per_output_token(self, seconds: float) -> None: ...
    def tokens(self, prompt: int, generated: int) -> None: ...
    def scheduler(self, running: int, waiting: int) -> None: ...
    def prefix_cache(self, queries: int, hits: int) -> None: ...
    def rows_recomputed(self) -> None: ...
    def in_flight(self, requests: int) -> None: ...
    def queue_time(self, seconds: float) -> None: ...


class NullMetrics(StageMetrics):
    """Reports nothing (the protocol's methods do nothing)."""


NULL_METRICS = NullMetrics()


def stat_logger_factory(metrics: Callable[[], StageMetrics]) -> Callable:
    """A vLLM StatLogger factory forwarding scheduler stats.

    Per engine step: running/waiting requests, and the prefix cache's queried
    and hit prompt tokens of the requests scheduled for the first time in
    that step (what vLLM's own vllm:prefix_cache_queries/_hits count;
    preempted requests coming back are left out, as there); per request that
    finished in the step, its time in the scheduler's waiting queue (first
    QUEUED to first SCHEDULED, vLLM's vllm:request_queue_time_seconds; a
    request that was never scheduled has none). `metrics()` is asked each
    step (the stage's own metrics are muted while it warms up).
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SchedulerStats(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            sink = metrics()
            if scheduler_stats is not None:
                sink.scheduler(scheduler_stats.num_running_reqs,
                               scheduler_stats.num_waiting_reqs)
                cache = getattr(scheduler_stats, "prefix_cache_stats", None)
                if cache is not None and (cache.queries or cache.hits):
                    sink.prefix_cache(cache.queries, cache.hits)
            for finished in getattr(iteration_stats, "finished_requests", None) or ():
                # <= 0: it ended (aborted) before it was scheduled (scheduled_ts 0)
                if finished.queued_time > 0:
                    sink.queue_time(finished.queued_time)

        def log_engine_initialized(self):
            pass

    return _SchedulerStats


# (family, values): a counter's value is its increment, a histogram's are observations
Samples = list[tuple[MetricSpec, list[float]]]


def vllm_backend_samples(iteration_stats) -> Samples:
    """What one engine step adds to vllm_backend's vllm:* families (metrics_table's
    VllmBackendMetrics), read from vLLM's IterationStats as that backend reads them."""
    m = VllmBackendMetrics
    finished = list(getattr(iteration_stats, "finished_requests", None) or ())
    samples: Samples = [
        (m.PROMPT_TOKENS, [iteration_stats.num_prompt_tokens]),
        (m.GENERATION_TOKENS, [iteration_stats.num_generation_tokens]),
        (m.TIME_TO_FIRST_TOKEN, list(iteration_stats.time_to_first_tokens_iter)),
        (m.TIME_PER_OUTPUT_TOKEN, list(iteration_stats.inter_token_latencies_iter)),
        (m.E2E_REQUEST_LATENCY, [f.e2e_latency for f in finished]),
        (m.REQUEST_PROMPT_TOKENS, [f.num_prompt_tokens for f in finished]),
        (m.REQUEST_GENERATION_TOKENS, [f.num_generation_tokens for f in finished]),
        (m.REQUEST_PARAMS_N, list(iteration_stats.n_params_iter)),
    ]
    return [(spec, values) for spec, values in samples
            if values and (spec.kind != "counter" or values[0])]


def vllm_backend_stat_logger(report: Callable[[Samples], None],
                             configure: Callable[[int], None] | None = None) -> Callable:
    """An EngineHost stat-logger maker: given `muted()` (true while the engine warms up),
    a vLLM StatLogger factory that hands each step's vllm_backend samples to `report`
    (called on the engine loop; it must not block). `configure(max_model_len)` runs once
    the engine creates the logger."""

    def make(muted: Callable[[], bool]) -> Callable:
        from vllm.v1.metrics.loggers import StatLoggerBase

        class _VllmBackendStats(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                self.engine_index = engine_index
                if configure is not None:
                    configure(vllm_config.model_config.max_model_len)

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx=0):
                if iteration_stats is None or muted():
                    return
                samples = vllm_backend_samples(iteration_stats)
                if samples:
                    report(samples)

            def log_engine_initialized(self):
                pass

        return _VllmBackendStats

    return make

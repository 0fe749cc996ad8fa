"""Every Prometheus metric the project exports, declared once: one table per stage kind.

Plain data, importable anywhere (no Triton, vLLM or torch). The Triton adapters
create their families from these tables (omni_serve.tritonio.Metrics takes a
`MetricSpec`), omni-openai creates its prometheus_client families from
`OpenAIMetrics`, and the Grafana generator (omni_tools.grafana) and the
docs/metrics.md test read the same tables. A name here is what /metrics shows:
counters end in `_total`. `labels` are all the labels a series carries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

Kind = Literal["counter", "gauge", "histogram"]
KINDS = ("counter", "gauge", "histogram")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")

LLM_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
PIPELINE_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
                            60.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
HTTP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# the orchestrator's stage roles (values of omni_stage_latency_seconds' `stage` label)
STAGE_ROLES = ("thinker", "image_encoder", "audio_encoder", "talker", "audio_decoder",
               "image_generator")


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: its name on /metrics, kind, help text, buckets and labels."""

    name: str
    kind: Kind
    help: str
    buckets: tuple[float, ...] = ()
    labels: tuple[str, ...] = ("model",)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name}: a histogram has buckets, a {self.kind} none")
        if self.name.startswith("omni_") and self.kind == "counter" \
                and not self.name.endswith("_total"):
            raise ValueError(f"{self.name}: our counters' names end in _total")


def _batched(prefix: str, compute_doc: str,
             labels: tuple[str, ...] = ("model",)) -> tuple[MetricSpec, MetricSpec]:
    """omni_serve.batched_adapter.BatchedExecute's two families for a stage."""
    return (MetricSpec(f"{prefix}_batch_size", "histogram", "Requests per execute() call",
                       BATCH_BUCKETS, labels),
            MetricSpec(f"{prefix}_compute_seconds_total", "counter", compute_doc, (), labels))


class MetricTable:
    """A stage kind's metrics: the MetricSpec class attributes, in order, are `ALL`."""

    CREATED_BY: ClassVar[str] = ""  # the backends (or process) that create them
    ALL: ClassVar[tuple[MetricSpec, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.ALL = tuple(v for k, v in vars(cls).items()
                        if isinstance(v, MetricSpec) and k.isupper())


class OrchestratorMetrics(MetricTable):
    CREATED_BY = "omni_orchestrator"
    TIME_TO_FIRST_TOKEN = MetricSpec("omni_time_to_first_token_seconds", "histogram",
                                     "Request arrival to the first text delta",
                                     PIPELINE_LATENCY_BUCKETS)
    TIME_TO_FIRST_AUDIO = MetricSpec("omni_time_to_first_audio_seconds", "histogram",
                                     "Request arrival to the first audio chunk",
                                     PIPELINE_LATENCY_BUCKETS)
    AUDIO_REAL_TIME_FACTOR = MetricSpec("omni_audio_real_time_factor", "histogram",
                                        "Speech generation wall time / seconds of audio",
                                        RTF_BUCKETS)
    STAGE_LATENCY = MetricSpec("omni_stage_latency_seconds", "histogram",
                               "Per request: seconds spent in calls to each stage",
                               PIPELINE_LATENCY_BUCKETS, ("model", "stage"))
    THINKER_FAILOVERS = MetricSpec(
        "omni_thinker_failovers_total", "counter",
        "Requests sent on to another thinker engine because this one was found down",
        (), ("model", "engine"))
    REQUESTS_IN_FLIGHT = MetricSpec(
        "omni_requests_in_flight", "gauge",
        "Requests being served: accepted, their pipeline not yet ended "
        "(0 means no stage call of this model is running or will start)")


class LlmMetrics(MetricTable):
    CREATED_BY = "omni_llm, omni_talker"
    TIME_TO_FIRST_TOKEN = MetricSpec("omni_llm_time_to_first_token_seconds", "histogram",
                                     "Time from request arrival to the first generated token",
                                     LLM_LATENCY_BUCKETS)
    TIME_PER_OUTPUT_TOKEN = MetricSpec("omni_llm_time_per_output_token_seconds", "histogram",
                                       "Per request: decode time / (output tokens - 1)",
                                       LLM_LATENCY_BUCKETS)
    PROMPT_TOKENS = MetricSpec("omni_llm_prompt_tokens_total", "counter",
                               "Prompt tokens processed")
    GENERATION_TOKENS = MetricSpec("omni_llm_generation_tokens_total", "counter",
                                   "Tokens generated")
    QUEUE_TIME = MetricSpec("omni_llm_queue_time_seconds", "histogram",
                            "Per finished request: time in vLLM's waiting queue, queued to "
                            "first scheduled", LLM_LATENCY_BUCKETS)
    ENGINE_RUNNING = MetricSpec("omni_llm_engine_running_requests", "gauge",
                                "Requests the vLLM scheduler is running")
    ENGINE_WAITING = MetricSpec("omni_llm_engine_waiting_requests", "gauge",
                                "Requests waiting in the vLLM scheduler")
    REQUESTS_IN_FLIGHT = MetricSpec(
        "omni_llm_requests_in_flight", "gauge",
        "Requests the stage holds: submitted, their last output not yet "
        "handed to the response sender (exact, unlike the engine gauges)")
    # hit rate = hits / queries (vLLM's vllm:prefix_cache_queries / _hits)
    PREFIX_CACHE_QUERIES = MetricSpec("omni_llm_prefix_cache_queries_total", "counter",
                                      "Prompt tokens looked up in vLLM's prefix cache")
    PREFIX_CACHE_HITS = MetricSpec("omni_llm_prefix_cache_hits_total", "counter",
                                   "Prompt tokens found in vLLM's prefix cache (not recomputed)")
    ROWS_RECOMPUTED = MetricSpec(
        "omni_llm_hidden_rows_recomputed_total", "counter",
        "Requests for hidden states (spoken replies) computed again without the prefix "
        "cache: it held their prefix, the engine no rows for it (OMNI_HIDDEN_ROWS_CACHE_MB)")


class DitMetrics(MetricTable):
    CREATED_BY = "omni_dit"
    BATCH_SIZE, COMPUTE_SECONDS = _batched("omni_dit",
                                           "Seconds spent in pipeline calls")
    IMAGES = MetricSpec("omni_dit_images_total", "counter", "Images generated")
    DENOISING_STEPS = MetricSpec("omni_dit_denoising_steps_total", "counter",
                                 "Denoising steps run (per image)")
    CACHE_LOOKUPS = MetricSpec("omni_dit_cache_lookups_total", "counter",
                               "Transformer forwards run with the step cache on")
    CACHE_HITS = MetricSpec("omni_dit_cache_hits_total", "counter",
                            "Forwards that reused the cached residual (hit rate = hits / lookups)")


class AudioMetrics(MetricTable):
    CREATED_BY = "omni_audio"
    GENERATED_SECONDS = MetricSpec("omni_audio_generated_seconds_total", "counter",
                                   "Seconds of audio returned")
    BATCH_SIZE, COMPUTE_SECONDS = _batched(
        "omni_audio",
        "Seconds spent in Token2Wav calls (real-time factor = compute / generated)")


class EncoderMetrics(MetricTable):
    CREATED_BY = "omni_encoder"
    LABELS = ("model", "modality")
    ITEMS = MetricSpec("omni_encoder_items_total", "counter", "Media items encoded", (), LABELS)
    TOKENS = MetricSpec("omni_encoder_tokens_total", "counter",
                        "Prompt tokens the items stand for", (), LABELS)
    BATCH_SIZE, COMPUTE_SECONDS = _batched(
        "omni_encoder", "Seconds spent decoding, preprocessing and encoding", LABELS)


class OpenAIMetrics(MetricTable):
    """omni-openai's own /metrics (prometheus_client, which adds `_total` to a counter)."""

    CREATED_BY = "omni-openai"
    REQUESTS = MetricSpec("omni_openai_requests_total", "counter",
                          "HTTP requests by endpoint and status", (), ("endpoint", "status"))
    REQUEST_SECONDS = MetricSpec("omni_openai_request_seconds", "histogram",
                                 "Time to the response head (streams: to the first event)",
                                 HTTP_BUCKETS, ("endpoint",))
    REALTIME_SESSIONS = MetricSpec("omni_openai_realtime_sessions", "gauge",
                                   "Realtime (WebSocket) sessions open", (), ("model",))
    REALTIME_TURNS = MetricSpec("omni_openai_realtime_turns_total", "counter",
                                "Realtime responses by how they ended (completed, cancelled, "
                                "incomplete, failed)", (), ("status",))
    REALTIME_INTERRUPTIONS = MetricSpec("omni_openai_realtime_interruptions_total", "counter",
                                        "Realtime responses cancelled while running, by reason "
                                        "(client_cancelled, turn_detected, disconnected)", (),
                                        ("reason",))
    REALTIME_FIRST_AUDIO_SECONDS = MetricSpec(
        "omni_openai_realtime_first_audio_seconds", "histogram",
        "Time from the end of the user's turn (the audio commit, else response.create) to the "
        "response's first audio", HTTP_BUCKETS, ("model",))


class TritonMetrics(MetricTable):
    """Triton's own per-model metrics that the dashboard and docs read (not created here)."""

    CREATED_BY = "tritonserver"
    REQUEST_SUCCESS = MetricSpec("nv_inference_request_success", "counter",
                                 "Successful inference requests", (), ("model", "version"))
    QUEUE_DURATION = MetricSpec("nv_inference_queue_duration_us", "counter",
                                "Cumulative queue time of requests (microseconds)", (),
                                ("model", "version"))

def one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class VllmBackendMetrics(MetricTable):
    """Triton vllm_backend's families, names, help texts, labels and buckets as it creates them,
    for dashboards built on it; created by omni_llm only when its config.pbtxt turns
    REPORT_CUSTOM_METRICS on (and model.json leaves disable_log_stats off). The token-count
    histograms' buckets are 1-2-5 up to the engine's max_model_len (`one_two_five`); the
    ones here stand for them. Not in TABLES: our dashboard charts our own families."""

    CREATED_BY = "omni_llm (REPORT_CUSTOM_METRICS)"
    LABELS = ("model", "version")
    PROMPT_TOKENS = MetricSpec("vllm:prompt_tokens_total", "counter",
                               "Number of prefill tokens processed.", (), LABELS)
    GENERATION_TOKENS = MetricSpec("vllm:generation_tokens_total", "counter",
                                   "Number of generation tokens processed.", (), LABELS)
    TIME_TO_FIRST_TOKEN = MetricSpec(
        "vllm:time_to_first_token_seconds", "histogram",
        "Histogram of time to first token in seconds.",
        (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0), LABELS)
    TIME_PER_OUTPUT_TOKEN = MetricSpec(
        "vllm:time_per_output_token_seconds", "histogram",
        "Histogram of time per output token in seconds.",
        (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5), LABELS)
    E2E_REQUEST_LATENCY = MetricSpec(
        "vllm:e2e_request_latency_seconds", "histogram",
        "Histogram of end to end request latency in seconds.",
        (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0), LABELS)
    REQUEST_PROMPT_TOKENS = MetricSpec("vllm:request_prompt_tokens", "histogram",
                                       "Number of prefill tokens processed.",
                                       one_two_five(2048), LABELS)
    REQUEST_GENERATION_TOKENS = MetricSpec("vllm:request_generation_tokens", "histogram",
                                           "Number of generation tokens processed.",
                                           one_two_five(2048), LABELS)
    REQUEST_PARAMS_N = MetricSpec("vllm:request_params_n", "histogram",
                                  "Histogram of the n request parameter.",
                                  (1.0, 2.0, 5.0, 10.0, 20.0), LABELS)


TABLES: tuple[type[MetricTable], ...] = (OrchestratorMetrics, LlmMetrics, DitMetrics, AudioMetrics,
                                         EncoderMetrics, OpenAIMetrics)


def exported() -> dict[str, MetricSpec]:
    """Every family the project's code creates, by its name on /metrics."""
    return {spec.name: spec for table in TABLES for spec in table.ALL}


def known() -> dict[str, MetricSpec]:
    """exported() and the Triton metrics the dashboard reads."""
    return {**exported(), **{spec.name: spec for spec in TritonMetrics.ALL}}


def family(series: str, names: dict[str, MetricSpec]) -> MetricSpec | None:
    """The family a series name belongs to (`x_bucket` -> histogram `x`), or None."""
    if series in names:
        return names[series]
    for suffix in HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if base != series and base in names and names[base].kind == "histogram":
            return names[base]
    return None

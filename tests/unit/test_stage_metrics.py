"""The stages' Prometheus metrics: what the vLLM stat logger forwards (queue time, scheduler,
prefix cache), and omni_serve.metrics_table, checked here against the families the adapters
really create (name, kind, help, buckets, labels)."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_serve import metrics_table
from omni_serve.llm.metrics import stat_logger_factory
from omni_serve.metrics_table import (
    AudioMetrics,
    DitMetrics,
    EncoderMetrics,
    LlmMetrics,
    MetricSpec,
    OpenAIMetrics,
    OrchestratorMetrics,
)

ROOT = Path(__file__).resolve().parents[2]


class _Recorder:
    """A StageMetrics that keeps every call."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def _vllm_stats(queued_times=(), running=0, waiting=0, queries=0, hits=0):
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import (
        FinishedRequestStats,
        IterationStats,
        PrefixCacheStats,
        SchedulerStats,
    )

    sched = SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting,
                           prefix_cache_stats=PrefixCacheStats(queries=queries, hits=hits))
    it = IterationStats()
    it.finished_requests = [FinishedRequestStats(FinishReason.LENGTH, queued_time=q)
                            for q in queued_times]
    return sched, it


def test_the_stat_logger_forwards_scheduler_prefix_cache_and_queue_times():
    sink = _Recorder()
    logger = stat_logger_factory(lambda: sink)(vllm_config=None)
    sched, it = _vllm_stats(queued_times=(0.25, 0.5), running=3, waiting=2, queries=64, hits=48)
    logger.record(sched, it)
    assert sink.calls == [("scheduler", 3, 2), ("prefix_cache", 64, 48),
                          ("queue_time", 0.25), ("queue_time", 0.5)]


def test_queue_times_come_without_scheduler_stats_and_not_for_requests_never_scheduled():
    sink = _Recorder()
    logger = stat_logger_factory(lambda: sink)(vllm_config=None)
    # aborted while waiting: scheduled_ts stays 0, so vLLM's queued_time is <= 0
    _, it = _vllm_stats(queued_times=(-1234.5, 0.0, 0.125))
    logger.record(None, it)
    logger.record(None, None)
    assert sink.calls == [("queue_time", 0.125)]


# --- the adapters' families, with a stand-in for triton_python_backend_utils --------------
class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: list[_Family] = []

    def __init__(self, name, description, kind):
        self.name, self.description, self.kind, self.samples = name, description, kind, []
        self.labels: set[tuple[str, ...]] = set()
        self.buckets: set[tuple[float, ...]] = set()
        _Family.created.append(self)

    def Metric(self, labels, buckets=None):  # pb_utils spelling
        family = self
        family.labels.add(tuple(sorted(labels)))
        family.buckets.add(tuple(buckets or ()))

        class _Metric:
            def observe(self, v):
                family.samples.append((labels, v))

            increment = set = observe

        return _Metric()


@pytest.fixture()
def families(monkeypatch) -> list[_Family]:
    fake = types.ModuleType("triton_python_backend_utils")
    fake.MetricFamily = _Family
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.setattr(_Family, "created", [])
    return _Family.created


def _adapter(stage: str):
    spec = importlib.util.spec_from_file_location(f"{stage}_model_metrics",
                                                  ROOT / "backends" / stage / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engine_metrics(model: str):
    """What the omni_llm and omni_talker adapters create (omni_serve.engine_adapter)."""
    from omni_serve.engine_adapter import EngineMetrics

    return EngineMetrics(model)


def test_the_llm_adapter_records_vllm_queue_time_in_its_histogram(families):
    metrics = _engine_metrics("thinker")
    metrics.queue_time(0.3)
    queue = next(f for f in families if f.name == "omni_llm_queue_time_seconds")
    assert (queue.kind, queue.samples) == ("histogram", [({"model": "thinker"}, 0.3)])


def test_the_llm_adapter_sends_its_scheduler_gauges_only_when_they_change(families):
    """Every engine step reports them; each Triton `set` is a round trip to the parent."""
    metrics = _engine_metrics("thinker")
    for running, waiting in [(0, 0), (2, 1), (2, 1), (2, 1), (3, 0), (3, 0)]:
        metrics.scheduler(running, waiting)
    sent = {f.name: [v for _, v in f.samples] for f in families if f.kind == "gauge"}
    assert sent["omni_llm_engine_running_requests"] == [0, 2, 3]
    assert sent["omni_llm_engine_waiting_requests"] == [0, 1, 0]


def _initialized(monkeypatch, stage: str, runner_attr: str, runner) -> None:
    module = _adapter(stage)
    monkeypatch.setattr(module, runner_attr, lambda cfg: runner)
    monkeypatch.setattr(module, "stage_config", lambda args, cls: SimpleNamespace(modality="image"))
    model = module.TritonPythonModel()
    model.WATCHED = False  # no stub registry entry
    model.initialize({"model_name": stage, "model_repository": "/nonexistent"})


def _declared(families: list[_Family]) -> list[MetricSpec]:
    """The created families, as MetricSpecs (one label set and bucket list per family)."""
    specs = []
    for f in families:
        assert len(f.labels) == len(f.buckets) == 1, f.name
        (labels,), (buckets,) = f.labels, f.buckets
        specs.append(MetricSpec(f.name, f.kind, f.description, buckets, labels))
    return specs


def _sorted(specs) -> list[MetricSpec]:
    return sorted((MetricSpec(s.name, s.kind, s.help, s.buckets, tuple(sorted(s.labels)))
                   for s in specs), key=lambda s: s.name)


def test_the_engine_adapters_create_exactly_the_llm_table(families):
    _engine_metrics("llm")
    assert _sorted(_declared(families)) == _sorted(LlmMetrics.ALL)


@pytest.mark.parametrize("stage, runner_attr, runner, table", [
    ("omni_dit", "DitRunner", SimpleNamespace(cache_stats={"lookups": 0, "hits": 0}), DitMetrics),
    ("omni_audio", "AudioRunner", SimpleNamespace(sample_rate=24000, limits=None), AudioMetrics),
    ("omni_encoder", "EncoderRunner", SimpleNamespace(), EncoderMetrics),
])
def test_a_batched_adapter_creates_exactly_its_table(families, monkeypatch, stage, runner_attr,
                                                     runner, table):
    """Including BatchedExecute's `<stage>_batch_size` and `<stage>_compute_seconds_total`."""
    _initialized(monkeypatch, stage, runner_attr, runner)
    assert f"{stage}_batch_size" in {f.name for f in families}
    assert _sorted(_declared(families)) == _sorted(table.ALL)


def test_the_orchestrator_adapter_creates_exactly_its_table(families):
    module = _adapter("omni_orchestrator")
    model = SimpleNamespace(model_name="omni",
                            cfg=SimpleNamespace(stages=SimpleNamespace(thinkers=("a", "b"))))
    module.TritonPythonModel._create_metrics(model)
    assert _sorted(_declared(families)) == _sorted(OrchestratorMetrics.ALL)
    stage = next(f for f in families if f.name == "omni_stage_latency_seconds")
    assert len(stage.samples) == 0 and stage.labels == {("model", "stage")}


def test_omni_openai_creates_exactly_its_table():
    from omni_client.openai_server.app import Frontend

    registry = Frontend("localhost:1", timeout_s=None).registry
    created = {}
    for fam in registry.collect():
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        created[name] = (fam.type, fam.documentation)
    assert created == {s.name: (s.kind, s.help) for s in OpenAIMetrics.ALL}


def test_metrics_refuses_a_spec_of_another_kind_or_other_labels(families):
    from omni_serve.tritonio import Metrics

    m = Metrics({"model": "x"})
    with pytest.raises(ValueError, match="declared a counter, not a gauge"):
        m.gauge(DitMetrics.IMAGES)
    with pytest.raises(ValueError, match="labels"):
        m.counter(EncoderMetrics.ITEMS)  # declared with model and modality
    assert families == []


def test_a_spec_is_checked_when_declared():
    with pytest.raises(ValueError, match="buckets"):
        MetricSpec("omni_x_seconds", "histogram", "no buckets")
    with pytest.raises(ValueError, match="buckets"):
        MetricSpec("omni_x_total", "counter", "buckets", (1.0,))
    with pytest.raises(ValueError, match="_total"):
        MetricSpec("omni_x_events", "counter", "counter without _total")


def test_no_two_tables_declare_one_name():
    names = [s.name for t in metrics_table.TABLES for s in t.ALL]
    assert len(names) == len(set(names))


def test_series_names_map_to_their_family():
    known = metrics_table.known()
    assert metrics_table.family("omni_llm_queue_time_seconds_bucket", known).kind == "histogram"
    assert metrics_table.family("omni_dit_images_total", known).kind == "counter"
    assert metrics_table.family("omni_dit_images_total_count", known) is None  # not a histogram
    assert metrics_table.family("omni_llm_no_such_seconds", known) is None
    assert metrics_table.family("nv_inference_request_success", known).kind == "counter"

"""The stages' Prometheus metrics: what the vLLM stat logger forwards (queue time, scheduler,
prefix cache), and omni_tools.metric_names, which reads the exported names from the source
(checked here against the families the adapters really create)."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_serve.llm.metrics import stat_logger_factory
from omni_tools import metric_names

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
        self.name, self.kind, self.samples = name, kind, []
        _Family.created.append(self)

    def Metric(self, labels, buckets=None):  # pb_utils spelling
        family = self

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


def _exported_by(source: str) -> dict[str, str]:
    return {m.name: m.kind for m in metric_names.exported().values() if m.source == source}


def test_metric_names_finds_the_families_the_engine_adapters_create(families):
    _engine_metrics("llm")
    assert {f.name: f.kind for f in families} == _exported_by("backends/omni_serve/engine_adapter.py")


@pytest.mark.parametrize("stage, runner_attr, runner", [
    ("omni_dit", "DitRunner", SimpleNamespace(cache_stats={"lookups": 0, "hits": 0})),
    ("omni_audio", "AudioRunner", SimpleNamespace(sample_rate=24000, limits=None)),
    ("omni_encoder", "EncoderRunner", SimpleNamespace()),
])
def test_metric_names_finds_the_families_a_batched_adapter_creates(families, monkeypatch, stage,
                                                                    runner_attr, runner):
    """Including BatchedExecute's `<prefix>_batch_size` and `<prefix>_compute_seconds_total`."""
    _initialized(monkeypatch, stage, runner_attr, runner)
    created = {f.name: f.kind for f in families}
    assert f"{stage}_batch_size" in created
    assert created == _exported_by(f"backends/{stage}/model.py")


def test_metric_names_reads_literal_templated_and_prometheus_client_metrics(tmp_path):
    (tmp_path / "backends").mkdir()
    (tmp_path / "omni_client").mkdir()
    (tmp_path / "backends" / "helper.py").write_text(
        "class Exec:\n"
        "    def __init__(self, metrics, prefix, doc):\n"
        "        self.b = metrics.histogram(f'{prefix}_batch_size', 'Batch', (1, 2))\n"
        "        self.c = metrics.counter(f'{prefix}_busy_seconds_total', doc)\n")
    (tmp_path / "backends" / "stage.py").write_text(
        "m = Metrics({'model': 'x'})\n"
        "a = m.gauge('omni_x_things', 'Things')\n"
        "b = m.counters('omni_x_events_total', 'Events', 'kind', ['a'])\n"
        "e = Exec(m, 'omni_x', 'Busy')\n"
        "f = Exec(m, prefix='omni_y', doc='Busy')\n"
        "n = m.counter('not_ours_total', 'Skipped: no omni_ prefix')\n")
    (tmp_path / "omni_client" / "app.py").write_text(
        "requests = Counter('omni_front_requests', 'Requests', ['status'])\n"
        "latency = Histogram('omni_front_seconds', 'Latency')\n")
    found = {m.name: (m.kind, m.source) for m in metric_names.exported(tmp_path).values()}
    assert found == {
        "omni_x_things": ("gauge", "backends/stage.py"),
        "omni_x_events_total": ("counter", "backends/stage.py"),
        "omni_x_batch_size": ("histogram", "backends/stage.py"),
        "omni_x_busy_seconds_total": ("counter", "backends/stage.py"),
        "omni_y_batch_size": ("histogram", "backends/stage.py"),
        "omni_y_busy_seconds_total": ("counter", "backends/stage.py"),
        "omni_front_requests_total": ("counter", "omni_client/app.py"),
        "omni_front_seconds": ("histogram", "omni_client/app.py"),
    }


def test_series_names_map_to_their_family():
    known = metric_names.exported()
    assert metric_names.family("omni_llm_queue_time_seconds_bucket", known).kind == "histogram"
    assert metric_names.family("omni_dit_images_total", known).kind == "counter"
    assert metric_names.family("omni_dit_images_total_count", known) is None  # not a histogram
    assert metric_names.family("omni_llm_no_such_seconds", known) is None

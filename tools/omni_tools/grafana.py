"""Writes the Grafana dashboard docs/grafana/omni-triton.json from the table `ROWS`.

    python -m omni_tools.grafana            # (re)write docs/grafana/omni-triton.json
    python -m omni_tools.grafana --check    # exit 1 if the committed file is not what it writes

Each panel is a title, a unit and its PromQL; the metric names in the PromQL
must be ones the stages declare (omni_serve.metrics_table, the tables the
adapters create their families from) or Triton's own, so a renamed metric fails the generator
(and tests/unit/test_grafana.py) instead of leaving a blank panel. The
dashboard has a Prometheus datasource variable `DS_PROMETHEUS` and a
multi-value `model` variable (Triton model names); docs/metrics.md says
what each metric means.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omni_serve import metrics_table

OUTPUT = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "omni-triton.json"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
M = 'model=~"$model"'  # the model variable, in a selector
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # a Grafana unit id: s, short, percentunit, reqps, ...
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""


def quantiles(histogram: str, by: str = "model", qs: tuple[float, ...] = (0.5, 0.95, 0.99)
              ) -> tuple[tuple[str, str], ...]:
    """histogram_quantile targets of a histogram family, one per quantile."""
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return tuple((f"histogram_quantile({q}, sum by (le, {by}) "
                  f"(rate({histogram}_bucket{{{M}}}{RATE})))", f"{legend} p{round(q * 100)}")
                 for q in qs)


def ratio(numerator: str, denominator: str, by: str = "model") -> str:
    return (f"sum by ({by}) (rate({numerator}{{{M}}}{RATE})) / "
            f"sum by ({by}) (rate({denominator}{{{M}}}{RATE}))")


def per_second(counter: str, by: str = "model") -> str:
    return f"sum by ({by}) (rate({counter}{{{M}}}{RATE}))"


def mean_batch(stage: str) -> tuple[str, str]:
    return ratio(f"omni_{stage}_batch_size_sum", f"omni_{stage}_batch_size_count"), "{{model}}"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Pipeline (omni_orchestrator)", (
        Panel("Time to first token (pipeline)", "s",
              quantiles("omni_time_to_first_token_seconds"),
              "Request arrival at the orchestrator to the first text delta"),
        Panel("Time to first audio", "s", quantiles("omni_time_to_first_audio_seconds"),
              "Request arrival at the orchestrator to the first audio chunk"),
        Panel("Speech real-time factor", "short",
              quantiles("omni_audio_real_time_factor", qs=(0.5, 0.95)) + (
                  (ratio("omni_audio_compute_seconds_total",
                         "omni_audio_generated_seconds_total"), "{{model}} decoder compute"),),
              "Per request: speech generation wall time / seconds of audio (below 1 is faster "
              "than real time); and the audio decoder stage's compute seconds per audio second"),
        Panel("Stage latency p95", "s",
              quantiles("omni_stage_latency_seconds", by="model, stage", qs=(0.95,)),
              "Per request: seconds the orchestrator spent in calls to each stage"),
        Panel("Requests in flight", "short", (
            (f"sum by (model) (omni_requests_in_flight{{{M}}})", "{{model}} pipeline"),
            (f"sum by (model) (omni_llm_requests_in_flight{{{M}}})", "{{model}} llm stage"),
        ), "Requests accepted and not yet ended (orchestrators), held by an LLM stage"),
        Panel("Thinker failovers", "reqps", (
            (per_second("omni_thinker_failovers_total", "model, engine"),
             "{{model}} past {{engine}}"),
        ), "Requests sent on to another thinker engine because this one was down"),
    )),
    ("LLM stages (omni_llm)", (
        Panel("Time to first token (LLM stage)", "s",
              quantiles("omni_llm_time_to_first_token_seconds")),
        Panel("Time per output token", "s", quantiles("omni_llm_time_per_output_token_seconds"),
              "Per request: decode time / (output tokens - 1)"),
        Panel("Tokens/s", "short", (
            (per_second("omni_llm_generation_tokens_total"), "{{model}} generated"),
            (per_second("omni_llm_prompt_tokens_total"), "{{model}} prompt"),
        )),
        Panel("vLLM scheduler (continuous batch)", "short", (
            (f"sum by (model) (omni_llm_engine_running_requests{{{M}}})", "{{model}} running"),
            (f"sum by (model) (omni_llm_engine_waiting_requests{{{M}}})", "{{model}} waiting"),
        ), "Requests the vLLM scheduler runs (the decode batch) and keeps waiting"),
        Panel("Queue time (vLLM waiting queue)", "s",
              quantiles("omni_llm_queue_time_seconds", qs=(0.5, 0.95)),
              "Per finished request: queued to first scheduled in vLLM (Triton's own queue "
              "time is near 0 for the decoupled LLM stages)"),
        Panel("Prefix-cache hit rate", "percentunit", (
            (ratio("omni_llm_prefix_cache_hits_total", "omni_llm_prefix_cache_queries_total"),
             "{{model}}"),
        ), "Prompt tokens found in vLLM's prefix cache / prompt tokens looked up"),
        Panel("Spoken replies recomputed", "reqps", (
            (per_second("omni_llm_hidden_rows_recomputed_total"), "{{model}}"),
        ), "Requests for hidden states (spoken replies) computed again without the prefix "
           "cache: it held their prefix, the engine kept no rows for it"),
    )),
    ("Batched stages (omni_dit, omni_audio, omni_encoder)", (
        Panel("Batch size (mean per execute)", "short",
              (mean_batch("dit"), mean_batch("audio"), mean_batch("encoder")),
              "Requests per execute() call of Triton's dynamic batcher"),
        Panel("Queue time (Triton, mean)", "s", (
            (f"{ratio('nv_inference_queue_duration_us', 'nv_inference_request_success')} / 1e6",
             "{{model}}"),
        ), "Triton's per-model queue time (dynamic batcher) per successful request"),
        Panel("Busy fraction", "percentunit", tuple(
            (per_second(f"omni_{stage}_compute_seconds_total"), "{{model}}")
            for stage in ("dit", "audio", "encoder")),
            "Compute seconds per second (summed over a model's instances)"),
        Panel("Diffusion steps/s", "short", (
            (ratio("omni_dit_denoising_steps_total", "omni_dit_compute_seconds_total"),
             "{{model}} per compute second"),
            (per_second("omni_dit_denoising_steps_total"), "{{model}} served"),
            (per_second("omni_dit_images_total"), "{{model}} images/s"),
        ), "Denoising steps (per image) per second of pipeline calls, and served per second"),
        Panel("DiT step-cache hit rate", "percentunit", (
            (ratio("omni_dit_cache_hits_total", "omni_dit_cache_lookups_total"), "{{model}}"),
        ), "Transformer forwards that reused the cached residual / forwards with the cache on"),
        Panel("Audio and encoder throughput", "short", (
            (per_second("omni_audio_generated_seconds_total"), "{{model}} audio s/s"),
            (per_second("omni_encoder_items_total", "model, modality"),
             "{{model}} {{modality}} items/s"),
            (per_second("omni_encoder_tokens_total", "model, modality"),
             "{{model}} {{modality}} tokens/s"),
        )),
    )),
    ("omni-openai", (
        Panel("Requests/s", "reqps", (
            ("sum by (endpoint, status) (rate(omni_openai_requests_total" + RATE + "))",
             "{{endpoint}} {{status}}"),
        ), "HTTP requests by endpoint and status (the frontend's own /metrics)"),
        Panel("Time to response head", "s", tuple(
            (f"histogram_quantile({q}, sum by (le, endpoint) "
             f"(rate(omni_openai_request_seconds_bucket{RATE})))", f"{{{{endpoint}}}} p{p}")
            for q, p in ((0.5, 50), (0.95, 95))), "Streams: to the first event"),
        Panel("Realtime sessions and turns", "short", (
            ("sum by (model) (omni_openai_realtime_sessions)", "{{model}} sessions open"),
            ("sum by (status) (rate(omni_openai_realtime_turns_total" + RATE + "))",
             "turns/s {{status}}"),
            ("sum by (reason) (rate(omni_openai_realtime_interruptions_total" + RATE + "))",
             "interruptions/s {{reason}}"),
        ), "/v1/realtime: sessions open, responses by how they ended, cancels by reason"),
        Panel("Realtime time to first audio", "s", tuple(
            (f"histogram_quantile({q}, sum by (le, model) "
             f"(rate(omni_openai_realtime_first_audio_seconds_bucket{RATE})))",
             f"{{{{model}}}} p{p}")
            for q, p in ((0.5, 50), (0.99, 99))), "From the end of the user's turn"),
    )),
)

_NAME = re.compile(r"\b((?:omni|nv)_[a-z0-9_]+)\b")


def metrics_in(expr: str) -> list[str]:
    """The metric (series) names a PromQL expression reads."""
    return _NAME.findall(expr)


def unknown_metrics(rows=ROWS, known=None) -> list[str]:
    """'panel: series' for each series the panels read that nothing exports."""
    known = metrics_table.known() if known is None else known
    return [f"{panel.title}: {name}" for _, panels in rows for panel in panels
            for expr, _ in panel.targets for name in metrics_in(expr)
            if metrics_table.family(name, known) is None]


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": panel.title,
        "description": panel.description, "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "min": 0,
                                     "custom": {"lineWidth": 1, "fillOpacity": 10,
                                                "showPoints": "never"}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend,
                     "refId": chr(ord("A") + i), "range": True}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def dashboard(rows=ROWS) -> dict:
    panels, pid, y = [], 1, 0
    for title, row in rows:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, panel in enumerate(row):
            panels.append(_panel(panel, pid, 12 * (i % 2), y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(row) + 1) // 2)
    model_query = 'label_values({__name__=~"omni_.+|nv_inference_request_success"}, model)'
    return {
        "annotations": {"list": []},
        "description": "Omni pipelines on Triton: per-stage latency, batching, caches "
                       "(generated by tools/omni_tools/grafana.py; see docs/metrics.md)",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["omni", "triton"],
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
            {"name": "model", "label": "Model", "type": "query", "datasource": DS,
             "definition": model_query,
             "query": {"query": model_query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
             "multi": True, "includeAll": True, "allValue": ".*", "current": {},
             "refresh": 2, "sort": 1, "hide": 0},
        ]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "Omni on Triton",
        "uid": "omni-triton",
        "version": 1,
    }


def render(rows=ROWS) -> str:
    return json.dumps(dashboard(rows), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, default=OUTPUT)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when the file differs from what would be written")
    args = ap.parse_args(argv)
    unknown = unknown_metrics()
    if unknown:
        print("panels read metrics the code does not export:\n  " + "\n  ".join(unknown),
              file=sys.stderr)
        return 1
    text = render()
    if args.check:
        same = args.output.exists() and args.output.read_text() == text
        if not same:
            print(f"{args.output} is stale: run python -m omni_tools.grafana", file=sys.stderr)
        return 0 if same else 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

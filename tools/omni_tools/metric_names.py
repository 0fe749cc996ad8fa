"""The Prometheus metrics this repository's code exports, read from its source.

The stages create their Triton custom metrics through omni_serve.tritonio.Metrics
(`m.counter("omni_llm_...", "doc")`, `m.histogram(...)`, `m.histograms(...)`,
...), the batched stages through omni_serve.batched_adapter.BatchedExecute
(`f"{prefix}_batch_size"` with `prefix` given at each `BatchedExecute(m,
"omni_dit", ...)`), and omni-openai through prometheus_client (`Counter(...)`,
which appends `_total`). `exported()` finds all of them with `ast`, without
importing the stages (which need Triton or vLLM), so the Grafana dashboard
(omni_tools.grafana) and docs/metrics.md can be checked against what the
code really exports rather than against a copy of the names.

`TRITON` lists the few metrics of Triton itself that the dashboard uses.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("backends", "omni_client")

# omni_serve.tritonio.Metrics' methods -> the kind of the family they create
_METRICS_METHODS = {"counter": "counter", "counters": "counter", "gauge": "gauge",
                    "histogram": "histogram", "histograms": "histogram"}
_PROMETHEUS_CLIENT = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter, gauge or histogram
    doc: str
    source: str  # the file that creates it, relative to the repository root


# Triton's own per-model metrics (labels model, version) the dashboard reads.
TRITON = {
    "nv_inference_request_success": Metric("nv_inference_request_success", "counter",
                                           "Successful inference requests", "tritonserver"),
    "nv_inference_queue_duration_us": Metric("nv_inference_queue_duration_us", "counter",
                                             "Cumulative queue time of requests (microseconds)",
                                             "tritonserver"),
}


def _text(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # implicit concatenation of plain strings
        parts = [v.value for v in node.values if isinstance(v, ast.Constant)]
        if len(parts) == len(node.values):
            return "".join(parts)
    return None


def _template(node: ast.AST) -> tuple[str, str] | None:
    """f"{param}suffix" -> (param, suffix)."""
    if (isinstance(node, ast.JoinedStr) and len(node.values) == 2
            and isinstance(node.values[0], ast.FormattedValue)
            and isinstance(node.values[0].value, ast.Name)
            and isinstance(node.values[1], ast.Constant)):
        return node.values[0].value.id, node.values[1].value
    return None


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _files(root: Path) -> Iterator[tuple[str, ast.Module]]:
    for top in SOURCES:
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield str(path.relative_to(root)), ast.parse(path.read_text(), str(path))


def exported(root: Path = ROOT) -> dict[str, Metric]:
    """Every metric family the code creates, by the name it has on /metrics."""
    found: dict[str, Metric] = {}
    # class name -> (source, position of the prefix argument, its name, [(suffix, kind, doc)])
    templated: dict[str, tuple[str, int, str, list[tuple[str, str, str]]]] = {}
    trees = list(_files(root))

    def add(metric: Metric) -> None:
        seen = found.get(metric.name)
        if seen is not None and seen.kind != metric.kind:
            raise ValueError(f"{metric.name} is a {seen.kind} in {seen.source} and a "
                             f"{metric.kind} in {metric.source}")
        found.setdefault(metric.name, metric)

    for source, tree in trees:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            init = next((f for f in cls.body if isinstance(f, ast.FunctionDef)
                         and f.name == "__init__"), None)
            if init is None:
                continue
            params = [a.arg for a in init.args.args[1:]]
            for call in (n for n in ast.walk(init) if isinstance(n, ast.Call)):
                kind = _METRICS_METHODS.get(_callee(call) or "")
                tpl = _template(call.args[0]) if kind and call.args else None
                if tpl and tpl[0] in params:
                    doc = _text(call.args[1]) if len(call.args) > 1 else None
                    entry = templated.setdefault(cls.name, (source, params.index(tpl[0]),
                                                            tpl[0], []))
                    entry[3].append((tpl[1], kind, doc or ""))

    for source, tree in trees:
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            callee = _callee(call) or ""
            name = _text(call.args[0]) if call.args else None
            if callee in _METRICS_METHODS and name and name.startswith("omni_"):
                doc = _text(call.args[1]) if len(call.args) > 1 else ""
                add(Metric(name, _METRICS_METHODS[callee], doc or "", source))
            elif callee in _PROMETHEUS_CLIENT and name and name.startswith("omni_"):
                kind = _PROMETHEUS_CLIENT[callee]
                if kind == "counter" and not name.endswith("_total"):
                    name += "_total"  # prometheus_client's counter naming
                doc = _text(call.args[1]) if len(call.args) > 1 else ""
                add(Metric(name, kind, doc or "", source))
            elif callee in templated:
                _, position, param, members = templated[callee]
                prefix = (_text(call.args[position]) if len(call.args) > position else
                          next((_text(k.value) for k in call.keywords if k.arg == param), None))
                if prefix is None:
                    raise ValueError(f"{source}:{call.lineno}: {callee}'s {param} is not a "
                                     "string literal; omni_tools.metric_names cannot name "
                                     "its metrics")
                for suffix, kind, doc in members:
                    add(Metric(prefix + suffix, kind, doc, source))
    return found


def family(series: str, known: dict[str, Metric]) -> Metric | None:
    """The family a series name belongs to (`x_bucket` -> histogram `x`), or None."""
    if series in known:
        return known[series]
    for suffix in HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if base != series and known.get(base) and known[base].kind == "histogram":
            return known[base]
    return None


if __name__ == "__main__":
    for m in sorted(exported().values(), key=lambda m: m.name):
        print(f"{m.name:45} {m.kind:9} {m.source}")

"""docs/grafana/omni-triton.json and docs/metrics.md against the metrics the code exports
(omni_serve.metrics_table, the tables the adapters create their families from)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from omni_serve import metrics_table
from omni_tools import grafana

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "omni-triton.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"


def _known() -> dict[str, metrics_table.MetricSpec]:
    return metrics_table.known()


def _targets(board: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", ())]


def test_the_committed_dashboard_is_what_the_generator_writes():
    text = DASHBOARD.read_text()
    json.loads(text)  # valid JSON
    assert text == grafana.render(), "stale: run python -m omni_tools.grafana"
    assert grafana.main(["--check"]) == 0


def test_the_dashboard_has_the_datasource_and_model_variables():
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 39
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model"]["type"] == "query"
    assert "label_values(" in variables["model"]["query"]["query"]
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            assert p["targets"], p["title"]


def test_every_expression_reads_metrics_the_code_exports():
    known = _known()
    board = json.loads(DASHBOARD.read_text())
    for title, expr in _targets(board):
        names = grafana.metrics_in(expr)
        assert names, f"{title}: {expr} reads no metric"
        for name in names:
            assert metrics_table.family(name, known), f"{title}: nothing exports {name}"


def test_a_panel_on_a_metric_nobody_exports_is_reported():
    rows = (("Row", (grafana.Panel("Gone", "s", (
        ("rate(omni_llm_generation_tokens_total[1m])", ""),
        ("rate(omni_dit_steps_total[1m])", ""),  # renamed away
        ("omni_dit_images_total_bucket", ""),  # a counter has no buckets
    )),)),)
    assert grafana.unknown_metrics(rows) == ["Gone: omni_dit_steps_total",
                                             "Gone: omni_dit_images_total_bucket"]


def test_every_exported_metric_has_a_panel():
    known = metrics_table.exported()
    charted = {metrics_table.family(name, known).name
               for _, expr in _targets(json.loads(DASHBOARD.read_text()))
               for name in grafana.metrics_in(expr) if metrics_table.family(name, known)}
    assert sorted(set(known) - charted) == []


def _doc_table() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (counter|gauge|histogram) \| ([a-z, ]+) \|",
                      METRICS_DOC.read_text(), re.MULTILINE)
    return {name: (kind, tuple(label.strip() for label in labels.split(",")))
            for name, kind, labels in rows}


def test_the_metrics_page_lists_every_declared_metric_with_its_type_and_labels():
    table = _doc_table()
    assert table == {m.name: (m.kind, m.labels) for m in metrics_table.known().values()}


def test_the_metrics_page_promql_reads_exported_metrics():
    known = _known()
    blocks = re.findall(r"```promql\n(.*?)```", METRICS_DOC.read_text(), re.DOTALL)
    names = [n for block in blocks for n in grafana.metrics_in(block)]
    assert names
    assert [n for n in names if metrics_table.family(n, known) is None] == []

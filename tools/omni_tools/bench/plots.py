"""PNG plots of benchmark results (matplotlib, no display; omni-bench process)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def lines(path: Path, title: str, xlabel: str, ylabel: str, xs: Sequence[float],
          series: Mapping[str, Sequence[float | None]]) -> Path:
    """One line per series over `xs` (e.g. throughput vs concurrency)."""
    plt, fig, ax = _figure()
    for label, ys in series.items():
        ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.set_xticks(list(xs))
    ax.legend()
    return _save(plt, fig, path)


def percentiles(path: Path, title: str, unit: str,
                series: Mapping[str, Sequence[float | None]],
                names: Sequence[str] = ("p50", "p95", "p99")) -> Path:
    """Grouped bars: for each series its percentiles (e.g. latency p50/p95/p99)."""
    import numpy as np

    plt, fig, ax = _figure()
    width = 0.8 / max(1, len(series))
    x = np.arange(len(names))
    for i, (label, values) in enumerate(series.items()):
        ax.bar(x + i * width, [float("nan") if v is None else v for v in values], width,
               label=label)
    ax.set_xticks(x + width * (len(series) - 1) / 2, names)
    ax.set(title=title, ylabel=unit)
    ax.legend(fontsize="small")
    return _save(plt, fig, path)

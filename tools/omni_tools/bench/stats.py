"""Percentiles and medians of measured samples (omni-bench process)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, None when there are none."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summary(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    """{prefix_p50, prefix_p95, prefix_p99} of `values`."""
    return {f"{prefix}_p{q}": pct(values, q) for q in (50, 95, 99)}


def median(values: Sequence[float]) -> float | None:
    return pct(values, 50)

"""The tree stays ruff-clean (rules in pyproject.toml)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_reports_nothing():
    ruff = Path(sys.prefix) / "bin" / "ruff"
    proc = subprocess.run([str(ruff), "check", "backends", "omni_client", "tools", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

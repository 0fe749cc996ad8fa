"""perf_analyzer (from the venv's PATH) measures the streaming LLM stage."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .llm_io import metric

pytestmark = pytest.mark.integration

MAX_TOKENS = 8


def test_perf_analyzer_streams_against_the_llm_stage(text_chat_server, tmp_path):
    data = {"data": [{"text_input": ["The quick brown fox"], "stream": [True],
                      "sampling_parameters": [json.dumps({"max_tokens": MAX_TOKENS,
                                                          "ignore_eos": True})]}]}
    (tmp_path / "input.json").write_text(json.dumps(data))
    before = metric(text_chat_server.metrics(), "omni_llm_generation_tokens_total")
    proc = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "perf_analyzer"), "-m", "llm", "-i", "grpc",
         "--streaming", "-u", text_chat_server.grpc_url, "--input-data",
         str(tmp_path / "input.json"), "--concurrency-range", "2",
         "--measurement-mode", "count_windows", "--measurement-request-count", "10",
         "-s", "1000", "-r", "4"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    throughput = re.search(r"Throughput: ([\d.]+) infer/sec", proc.stdout)
    assert throughput and float(throughput.group(1)) > 0, proc.stdout
    generated = metric(text_chat_server.metrics(), "omni_llm_generation_tokens_total") - before
    # every request perf_analyzer sent ran to exactly MAX_TOKENS tokens
    assert generated >= 10 * MAX_TOKENS and generated % MAX_TOKENS == 0

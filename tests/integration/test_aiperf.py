"""NVIDIA AIPerf (.venv/bin/aiperf, its own venv, see tools/setup.sh) against omni-openai.

`aiperf profile --endpoint-type chat --streaming --extra-inputs ignore_eos:true` is what a
user benchmarking a vLLM-compatible endpoint runs. It must work here, and the output
length of every request must be exactly the one asked for.

That last check can fail only if EOS would otherwise end some replies early. The tiny
random-weight thinker samples one of its two EOS ids (0, 2 of a 2048 vocabulary) about
once per 1900 tokens (measured: 8 of 64 replies of 256 tokens stopped early without
ignore_eos). REQUESTS x OSL = 10240 tokens, so without ignore_eos at least one reply ends
early with a probability of about 1 - exp(-10240 / 1900), i.e. 99.5%.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from omni_tools import aiperf

pytestmark = pytest.mark.integration

MODEL = "llm"  # the plain text-chat entry model: no orchestrator hop, the fastest text chat
OSL = 256
REQUESTS = 40
CONCURRENCY = 20


def test_aiperf_ignore_eos_runs_every_request_to_the_output_length(
        openai_frontend, omni_chat_server, tmp_path):
    engine = json.loads((Path(omni_chat_server.repository) / MODEL / "engine.json").read_text())
    tokenizer = engine["model"]  # the checkpoint folder the llm model serves
    run = aiperf.profile(openai_frontend, MODEL, tokenizer, tmp_path, requests=REQUESTS,
                         concurrency=CONCURRENCY, isl=32, osl=OSL, timeout_s=300)
    artifacts, why = run.artifacts, run.why
    assert run.returncode == 0, why()

    # what AIPerf sent: every payload asks for ignore_eos and OSL tokens
    payloads = run.payloads
    assert len(payloads) == REQUESTS, why()
    assert all(p["ignore_eos"] is True and p["max_tokens"] == OSL == p["max_completion_tokens"]
               and p["stream"] is True for p in payloads), payloads[0]

    # one record per request, none failed, each exactly OSL tokens long
    records = run.records
    assert len(records) == REQUESTS, why()
    errors = [r["error"] for r in records if r.get("error")]
    assert not errors, f"{errors}\n{why()}"
    lengths = [r["metrics"]["output_sequence_length"]["value"] for r in records]
    usage = [r["metrics"]["usage_completion_tokens"]["value"] for r in records]
    assert lengths == usage == [OSL] * REQUESTS, f"lengths {lengths}\n{why()}"

    # the summary agrees: all completed, no errors, min == max == OSL
    summary = run.summary
    assert summary["request_count"]["avg"] == REQUESTS, why()
    assert summary.get("error_summary") == [], f"{summary.get('error_summary')}\n{why()}"
    assert summary.get("request_error_rate", {"avg": 0})["avg"] == 0, why()
    assert not summary["was_cancelled"] and summary["is_complete"], why()
    osl = summary["output_sequence_length"]
    assert (osl["min"], osl["max"], osl["count"]) == (OSL, OSL, REQUESTS), f"{osl}\n{why()}"
    assert summary["request_throughput"]["avg"] > 0 and summary["time_to_first_token"]["avg"] > 0
    # and so does the CSV export (what spreadsheets read)
    rows = {row[0]: row[1:] for row in
            csv.reader((artifacts / "profile_export_aiperf.csv").read_text().splitlines()) if row}
    assert [float(x) for x in rows["Output Sequence Length (tokens)"][:3]] == [OSL] * 3, rows
    assert float(rows["Request Count"][0]) == REQUESTS, rows
    assert float(rows["Request Error Rate (%)"][0]) == 0, rows

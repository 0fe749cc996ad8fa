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
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

AIPERF = Path(sys.prefix) / "bin" / "aiperf"
MODEL = "llm"  # the plain text-chat entry model: no orchestrator hop, the fastest text chat
OSL = 256
REQUESTS = 40
CONCURRENCY = 20


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e})"


def _aiperf_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    # AIPerf 0.13 with HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set looks every tokenizer
    # up as a hub repo id in the HF cache, and a local folder fails ("HFValidationError:
    # Repo id must be in the form 'repo_name'"). Without them it reads the folder with no
    # network at all; a dead HF_ENDPOINT makes any hub call fail at once, not download.
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(key, None)
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    env["HF_HOME"] = str(tmp_path / "hf")
    # where its dataset memory maps go (it leaves their empty folders behind)
    env["AIPERF_DATASET_MMAP_BASE_PATH"] = str(tmp_path / "mmap")
    (tmp_path / "mmap").mkdir()
    return env


def test_aiperf_ignore_eos_runs_every_request_to_the_output_length(
        openai_frontend, omni_chat_server, tmp_path):
    engine = json.loads((Path(omni_chat_server.repository) / MODEL / "engine.json").read_text())
    tokenizer = engine["model"]  # the checkpoint folder the llm model serves
    artifacts = tmp_path / "artifacts"
    cmd = [str(AIPERF), "profile", "--model", MODEL, "--url", openai_frontend,
           "--endpoint-type", "chat", "--streaming", "--tokenizer", tokenizer,
           "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
           "--synthetic-input-tokens-mean", "32", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OSL), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"max_tokens:{OSL}",
           # lengths as the server counts them: a random model's tokens do not survive
           # detokenize + retokenize (the client count was 12-16 for 12 tokens)
           "--use-server-token-count",
           "--random-seed", "7", "--artifact-dir", str(artifacts),
           "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=_aiperf_env(tmp_path))
    log = artifacts / "logs" / "aiperf.log"

    def why() -> str:
        return (f"{' '.join(cmd)}\nrc={proc.returncode}\n--- stdout (tail) ---\n"
                + "\n".join(proc.stdout.splitlines()[-40:])
                + f"\n--- stderr (tail) ---\n{proc.stderr[-4000:]}\n--- {log} (tail) ---\n"
                + _tail(log))

    assert proc.returncode == 0, why()

    # what AIPerf sent: every payload asks for ignore_eos and OSL tokens
    payloads = [p for s in json.loads((artifacts / "inputs.json").read_text())["data"]
                for p in s["payloads"]]
    assert len(payloads) == REQUESTS, why()
    assert all(p["ignore_eos"] is True and p["max_tokens"] == OSL == p["max_completion_tokens"]
               and p["stream"] is True for p in payloads), payloads[0]

    # one record per request, none failed, each exactly OSL tokens long
    records = [json.loads(line) for line in
               (artifacts / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    assert len(records) == REQUESTS, why()
    errors = [r["error"] for r in records if r.get("error")]
    assert not errors, f"{errors}\n{why()}"
    lengths = [r["metrics"]["output_sequence_length"]["value"] for r in records]
    usage = [r["metrics"]["usage_completion_tokens"]["value"] for r in records]
    assert lengths == usage == [OSL] * REQUESTS, f"lengths {lengths}\n{why()}"

    # the summary agrees: all completed, no errors, min == max == OSL
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
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

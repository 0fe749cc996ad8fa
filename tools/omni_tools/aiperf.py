"""Run NVIDIA AIPerf (`aiperf profile`) against an OpenAI-compatible endpoint.

Runs in the caller's process (omni-bench, the integration tests); AIPerf itself is a
child process from its own venv (.venv/bin/aiperf, installed by tools/setup.sh). One
call is one `aiperf profile` run, of one of two kinds: chat streaming with fixed prompt
and output lengths, `ignore_eos` so every reply is exactly as long as asked, lengths as
the server counts them (`profile`); or image generation (`POST /v1/images/generations`)
of given prompts with per-request seeds, one size and one step count (`image_profile`).
Both build their command from the same common part (`command`) and run it the same way
(`run`); only the endpoint's arguments differ. It returns what AIPerf wrote: the
summary, the per-request records and the payloads it sent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AIPERF = Path(sys.prefix) / "bin" / "aiperf"


def aiperf_env(work: Path) -> dict[str, str]:
    """The environment AIPerf runs in: no hub, its files under `work`."""
    env = dict(os.environ)
    # AIPerf 0.13 with HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set looks every tokenizer
    # up as a hub repo id in the HF cache, and a local folder fails ("HFValidationError:
    # Repo id must be in the form 'repo_name'"). Without them it reads the folder with no
    # network at all; a dead HF_ENDPOINT makes any hub call fail at once, not download.
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(key, None)
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    env["HF_HOME"] = str(work / "hf")
    # where its dataset memory maps go (it leaves their empty folders behind)
    env["AIPERF_DATASET_MMAP_BASE_PATH"] = str(work / "mmap")
    (work / "mmap").mkdir(parents=True, exist_ok=True)
    return env


@dataclass
class Profile:
    """One finished `aiperf profile` run."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    artifacts: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.artifacts / "profile_export_aiperf.json").read_text())

    @property
    def records(self) -> list[dict[str, Any]]:
        text = (self.artifacts / "profile_export.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    @property
    def payloads(self) -> list[dict[str, Any]]:
        data = json.loads((self.artifacts / "inputs.json").read_text())["data"]
        return [p for session in data for p in session["payloads"]]

    def raise_for_failures(self) -> None:
        """RuntimeError when AIPerf failed or any request it sent got an error."""
        if self.returncode != 0:
            raise RuntimeError(f"aiperf failed:\n{self.why()}")
        errors = [r for r in self.records if r.get("error")]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed: {errors[0]['error']}\n{self.why()}")

    def why(self) -> str:
        """The command, its exit code and the tails of its output and log (for errors)."""
        log = self.artifacts / "logs" / "aiperf.log"
        try:
            log_tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        except OSError as e:
            log_tail = f"({log}: {e})"
        return (f"{' '.join(self.command)}\nrc={self.returncode}\n--- stdout (tail) ---\n"
                + "\n".join(self.stdout.splitlines()[-40:])
                + f"\n--- stderr (tail) ---\n{self.stderr[-4000:]}\n--- {log} (tail) ---\n"
                + log_tail)


def command(url: str, model: str, tokenizer: str | Path, artifacts: Path,
            endpoint_args: Sequence[str], *, requests: int, concurrency: int, seed: int = 7,
            warmup: int = 0) -> list[str]:
    """The `aiperf profile` command line: what every run shares, then `endpoint_args`
    (the endpoint type and its own inputs)."""
    cmd = [str(AIPERF), "profile", "--model", model, "--url", url, *endpoint_args,
           "--tokenizer", str(tokenizer),
           "--request-count", str(requests), "--concurrency", str(concurrency),
           "--random-seed", str(seed), "--artifact-dir", str(artifacts),
           "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "2"]
    if warmup:
        cmd += ["--warmup-request-count", str(warmup)]
    return cmd


def run(cmd: Sequence[str], work: Path, timeout_s: float = 600) -> Profile:
    """Run one `aiperf profile` command (from `command`) with its files under `work`."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s,
                          env=aiperf_env(work))
    return Profile(list(cmd), proc.returncode, proc.stdout, proc.stderr, work / "artifacts")


def chat_args(isl: int, osl: int) -> list[str]:
    """Streamed chats, `isl` prompt and exactly `osl` output tokens each."""
    return ["--endpoint-type", "chat", "--streaming",
            "--synthetic-input-tokens-mean", str(isl), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(osl), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"max_tokens:{osl}",
            # lengths as the server counts them: a random model's tokens do not survive
            # detokenize + retokenize (the client count was 12-16 for 12 tokens)
            "--use-server-token-count"]


def image_dataset(prompts: Sequence[tuple[str, int]]) -> str:
    """AIPerf's single_turn JSONL of (prompt, seed) pairs: one request each, the seed
    merged into its body (`extra`)."""
    return "".join(json.dumps({"text": prompt, "extra": {"seed": seed}}) + "\n"
                   for prompt, seed in prompts)


def image_args(input_file: Path, *, width: int, height: int, steps: int) -> list[str]:
    """Image generation of the prompts in `input_file` (from `image_dataset`), in file
    order, `width`x`height`, `steps` denoising steps (omni-openai's extension field)."""
    return ["--endpoint-type", "image_generation",
            "--input-file", str(input_file), "--custom-dataset-type", "single_turn",
            "--dataset-sampling-strategy", "sequential",
            "--extra-inputs", f"size:{width}x{height}",
            "--extra-inputs", f"num_inference_steps:{steps}"]


def profile(url: str, model: str, tokenizer: str | Path, work: Path, *, requests: int,
            concurrency: int, isl: int = 32, osl: int = 64, seed: int = 7,
            warmup: int = 0, timeout_s: float = 600) -> Profile:
    """`aiperf profile` of `requests` streamed chats at `concurrency`, `isl` prompt and
    exactly `osl` output tokens each; artifacts under `work`."""
    cmd = command(url, model, tokenizer, work / "artifacts", chat_args(isl, osl),
                  requests=requests, concurrency=concurrency, seed=seed, warmup=warmup)
    return run(cmd, work, timeout_s)


def image_profile(url: str, model: str, tokenizer: str | Path, work: Path,
                  prompts: Sequence[tuple[str, int]], *, concurrency: int, width: int,
                  height: int, steps: int, timeout_s: float = 600) -> Profile:
    """`aiperf profile` of one image generation per (prompt, seed) of `prompts`, in order,
    at `concurrency`; no warm-up (it would take the first prompts); artifacts under `work`."""
    work.mkdir(parents=True, exist_ok=True)
    dataset = work / "prompts.jsonl"
    dataset.write_text(image_dataset(prompts))
    cmd = command(url, model, tokenizer, work / "artifacts",
                  image_args(dataset, width=width, height=height, steps=steps),
                  requests=len(prompts), concurrency=concurrency)
    return run(cmd, work, timeout_s)

"""Scenario `openai`: omni-openai + Triton vs `vllm serve`, text chat under NVIDIA AIPerf.

Runs in the omni-bench process; starts, as children: tritonserver serving the text-chat
preset with omni-openai in front, and vLLM's own OpenAI server (`python -m
vllm.entrypoints.openai.api_server`) on the same checkpoint folder with the same engine
arguments, twice: without this project's vLLM plugins (VLLM_PLUGINS=""), as a user's vLLM
install runs, and with only its CPU no-spin plugin (`omni_cpu_spin`, which the llm stage
runs with), so the last pair differs only in the serving path. One server is up at a time
(vanilla vLLM's CPU workers spin in sched_yield() even when idle, which would tax the
others); each round starts each side, runs every concurrency level on it and stops it,
the order of the sides alternating between rounds. AIPerf sends the same seeded
synthetic chats (prompt and output lengths fixed, ignore_eos) to every side.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omni_tools import aiperf
from omni_tools.bench import plots
from omni_tools.bench.scenario import Ratio, Results, Scenario
from omni_tools.bench.stats import median

SIDES = ("omni", "vllm", "vllm_nospin")
LABELS = {"omni": "omni-openai + Triton", "vllm": "vllm serve",
          "vllm_nospin": "vllm serve + no-spin plugin"}
VLLM_PLUGINS = {"vllm": "", "vllm_nospin": "omni_cpu_spin"}  # VLLM_PLUGINS of each vLLM side
MODEL = "llm"  # the served name on both sides
# engine.json keys that are the stage's own, not vLLM engine arguments
STAGE_KEYS = {"model", "max_queued", "warmup", "worker_extension_cls"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--concurrency", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--isl", type=int, default=32, help="prompt tokens")
    ap.add_argument("--osl", type=int, default=64, help="output tokens (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=2)


def vllm_flags(engine_args: dict[str, Any]) -> list[str]:
    """Engine arguments as `vllm serve` flags (True: the bare flag)."""
    flags = []
    for key, value in engine_args.items():
        if key in STAGE_KEYS or value is False or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


class VllmServer:
    """vLLM's OpenAI server on a free port (a context manager)."""

    def __init__(self, model: str, engine_args: dict[str, Any], log_path: Path,
                 plugins: str = ""):
        from omni_tools.server import free_port

        self.plugins = plugins
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                    "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                    *vllm_flags(engine_args)]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VllmServer:
        env = {**os.environ, "VLLM_PLUGINS": self.plugins}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; see "
                                   f"{self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"vllm serve not answering after 300 s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _measure(url: str, tokenizer: str, work: Path, args, concurrency: int) -> dict[str, Any]:
    run = aiperf.profile(url, MODEL, tokenizer, work, requests=args.requests,
                         concurrency=concurrency, isl=args.isl, osl=args.osl,
                         warmup=min(concurrency, 8))
    run.raise_for_failures()
    s = run.summary
    return {"tok_s": s["output_token_throughput"]["avg"],
            "requests_s": s["request_throughput"]["avg"],
            "ttft_p50_ms": s["time_to_first_token"]["p50"],
            "ttft_p99_ms": s["time_to_first_token"]["p99"],
            "itl_p50_ms": s["inter_token_latency"]["p50"],
            "latency_p50_ms": s["request_latency"]["p50"],
            "latency_p95_ms": s["request_latency"]["p95"],
            "latency_p99_ms": s["request_latency"]["p99"]}


def run(args: argparse.Namespace) -> Results:
    from omni_tools import gen_repo, spec
    from omni_tools.server import OpenAIFrontend, TritonServer

    # every engine gets the same KV cache size (vLLM's CPU default is 4 GiB each)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    work = Path(tempfile.mkdtemp(prefix="omni-bench-openai-"))  # logs stay for a look
    print(f"openai: logs and AIPerf artifacts in {work}", flush=True)
    repo = work / "repo"
    gen_repo.generate(spec.load_preset("text-chat"), repo, force=True)
    engine = json.loads((repo / MODEL / "engine.json").read_text())
    model = engine["model"]
    commands: dict[str, str] = {}

    @contextmanager
    def serving(side: str, rnd: int) -> Iterator[str]:
        if side == "omni":
            with TritonServer(repo, log_path=work / f"r{rnd}-tritonserver.log") as triton, \
                    OpenAIFrontend(triton.grpc_url, log_path=work / f"r{rnd}-omni-openai.log") \
                    as front:
                yield front.base_url
            return
        with VllmServer(model, engine, work / f"r{rnd}-{side}.log", VLLM_PLUGINS[side]) as vllm:
            commands[side] = f"VLLM_PLUGINS={vllm.plugins!r} " + " ".join(vllm.cmd[1:])
            yield vllm.base_url

    runs: dict[int, dict[str, list]] = {c: {s: [] for s in SIDES} for c in args.concurrency}
    for rnd in range(args.rounds):
        for side in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
            with serving(side, rnd) as url:
                for c in args.concurrency:
                    m = _measure(url, model, work / f"r{rnd}-c{c}-{side}", args, c)
                    runs[c][side].append(m)
                    print(f"openai round={rnd} c={c} {side:11s} {m['tok_s']:7.0f} tok/s "
                          f"ttft p50 {m['ttft_p50_ms']:.0f} ms", flush=True)
    levels = {}
    for c, by_side in runs.items():
        level: dict[str, Any] = {}
        for side, ms in by_side.items():
            level[side] = {k: median([m[k] for m in ms]) for k in ms[0]}
        for key, side in (("ratio", "vllm"), ("ratio_nospin", "vllm_nospin")):
            per_round = [o["tok_s"] / v["tok_s"] for o, v in zip(by_side["omni"], by_side[side])]
            level[key] = median(per_round)
            level[f"{key}_per_round"] = per_round
        levels[str(c)] = level
    return {"model": model, "engine_args": {k: v for k, v in engine.items() if k != "model"},
            "isl": args.isl, "osl": args.osl, "requests": args.requests, "rounds": args.rounds,
            "vllm_commands": commands, "levels": levels}


def ratios(results: Results) -> list[Ratio]:
    level = results["levels"].get("32")
    out = []
    for key, side in (("ratio", "vllm"), ("ratio_nospin", "vllm_nospin")):
        value = None if level is None else level.get(key)
        out.append(Ratio(f"omni-openai + Triton / {LABELS[side]}, output tok/s at concurrency 32",
                         value, 0.95, note="" if value is not None else "not measured"))
    return out


def _sides(level: dict[str, Any]) -> list[str]:
    return [s for s in SIDES if s in level]  # results of older runs lack vllm_nospin


def table(results: Results) -> str:
    first = next(iter(results["levels"].values()), {})
    sides = _sides(first)
    vs = [s for s in sides if s != "omni"]
    rows = ["| concurrency | " + " | ".join(f"{LABELS[s]} tok/s" for s in sides) + " | "
            + " | ".join(f"omni / {LABELS[s]} (per round)" for s in vs)
            + " | TTFT p50 ms | ITL p50 ms | latency p99 ms |",
            "|---:|" + "---:|" * len(sides) + "---|" * len(vs) + "---|---|---|"]
    keys = {"vllm": "ratio", "vllm_nospin": "ratio_nospin"}
    for c, lv in results["levels"].items():
        cells = [f"{lv[s]['tok_s']:.0f}" for s in sides]
        cells += [f"**{lv[keys[s]]:.2f}** ("
                  + ", ".join(f"{r:.2f}" for r in lv[f"{keys[s]}_per_round"]) + ")" for s in vs]
        for metric, spec in (("ttft_p50_ms", ".0f"), ("itl_p50_ms", ".1f"),
                             ("latency_p99_ms", ".0f")):
            cells.append(" / ".join(format(lv[s][metric], spec) for s in sides))
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    rows.append("\nTTFT, ITL and latency columns: " + " / ".join(LABELS[s] for s in sides) + ".")
    return "\n".join(rows)


def draw(results: Results, folder: Path) -> list[Path]:
    levels = results["levels"]
    xs = [int(c) for c in levels]
    return [
        plots.lines(folder / "openai_throughput.png", "Text chat: output tokens/s (AIPerf)",
                    "concurrency", "output tokens/s", xs,
                    {LABELS[s]: [levels[c][s]["tok_s"] for c in levels]
                     for s in _sides(next(iter(levels.values())))}),
        plots.percentiles(folder / "openai_latency.png", "Text chat: request latency (AIPerf)",
                          "ms", {f"{LABELS[s]} c={c}": [levels[c][s][f"latency_p{q}_ms"]
                                                         for q in (50, 95, 99)]
                                 for c in levels for s in _sides(levels[c])}),
    ]


SCENARIO = Scenario(
    name="openai", title="Text chat: omni-openai + Triton vs vllm serve (AIPerf)",
    add_arguments=add_arguments, run=run, ratios=ratios, table=table, plots=draw,
    quick=["--rounds", "2", "--requests", "64"])

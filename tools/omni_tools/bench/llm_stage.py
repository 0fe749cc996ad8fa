"""Benchmark: the omni_llm stage inside tritonserver vs the same AsyncLLM in-process.

Runs in one process (the client side) plus one tritonserver child. Both
sides use the same engine arguments and prompts; per round, one side's
engine runs every concurrency level, then the other's (order alternating
between rounds, one engine alive at a time). Reports output tokens/s and TTFT
percentiles per side, the throughput ratio (triton / in-process) and the
extra TTFT (triton - in-process) at p50 and p99. The `llm` scenario of omni-bench
(its child process); the functions at the top are shared with the `spin` and `split`
scenarios.

    omni-bench llm                                       # the quick set
    omni-bench llm -- --models qwen2-tiny qwen2.5-0.5b-random --rounds 1
    .venv/bin/python -m omni_tools.bench.llm_stage --report RESULTS.json   # the table
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np

from omni_serve.contract import LLM
from omni_tools.bench.scenario import results_file, write_results

ENGINE_ARGS = {"max_model_len": 1024, "enforce_eager": True, "max_num_seqs": 64,
               "dtype": "float32"}
PROMPTS = [f"Request {i}: tell me a story about the {w} and the {v}." for i, (w, v) in
           enumerate([("sea", "moon"), ("city", "river"), ("forest", "fox"),
                      ("mountain", "goat"), ("desert", "rain"), ("island", "ship"),
                      ("garden", "bee"), ("valley", "wind")] * 8)]


@dataclass
class Run:
    side: str
    concurrency: int
    tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    cores: dict[str, float] = field(default_factory=dict)  # CPU-seconds / wall, per process

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


_KINDS = (("VLLM::Worker", "vllm worker"), ("VLLM::EngineCor", "vllm engine core"),
          ("triton_python_backend_stub", "python stub"), ("tritonserver", "tritonserver"))


def cpu_snapshot() -> dict[str, float]:
    """CPU-seconds so far of this process tree, by role (perf_analyzer via RUSAGE_CHILDREN)."""
    import resource

    import psutil

    me = psutil.Process()
    out = {"client (this process)": sum(me.cpu_times()[:2])}
    for p in me.children(recursive=True):
        try:
            name = " ".join(p.cmdline()) or p.name()
            t = sum(p.cpu_times()[:2])
        except psutil.Error:
            continue
        kind = next((k for pat, k in _KINDS if pat in name), "other")
        out[kind] = out.get(kind, 0.0) + t
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["perf_analyzer (exited children)"] = ru.ru_utime + ru.ru_stime
    return out


def cores_used(before: dict, after: dict, wall: float) -> dict[str, float]:
    return {k: round((after[k] - before.get(k, 0.0)) / wall, 2) for k in after
            if after[k] - before.get(k, 0.0) > 0.01 * wall}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


# --- in-process AsyncLLM ---------------------------------------------------------
class InProcess:
    def __init__(self, engine_args: dict):
        from omni_serve.llm import cpu_engine

        self.engine = cpu_engine.start(engine_args)  # as the stage starts it (same env)

    async def one(self, prompt: str, max_tokens: int) -> tuple[int, float]:
        from vllm import SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                            output_kind=RequestOutputKind.DELTA)
        t0 = time.perf_counter()
        parsed = parse_model_prompt(self.engine.model_config, {"prompt": prompt})
        (inp,) = await self.engine.renderer.render_cmpl_async([parsed])
        ttft, n = None, 0
        async for out in self.engine.generate(inp, sp, uuid.uuid4().hex):
            k = len(out.outputs[0].token_ids)
            if k and ttft is None:
                ttft = time.perf_counter() - t0
            n += k
        return n, ttft

    def shutdown(self):
        self.engine.shutdown()


# --- the stage in tritonserver, driven by perf_analyzer ---------------------------
def perf_analyzer_level(url: str, concurrency: int, n_requests: int, max_tokens: int,
                        workdir: Path) -> Run:
    """One level measured by perf_analyzer (C++ client, --streaming).

    A Python gRPC client spends ~100-300 us per response; at thousands of
    deltas per second on 2 cores it measures itself, not the server.
    Tokens per request are fixed (ignore_eos), so tokens = requests x
    max_tokens; TTFT comes from the per-request response timestamps of
    --profile-export-file.
    """
    import subprocess

    sp = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    data = {"data": [{LLM.TEXT_INPUT: [p], LLM.STREAM: [True], LLM.SAMPLING_PARAMETERS: [sp],
                      LLM.RETURN_FINISH_REASON: [True]} for p in PROMPTS]}
    inp, export = workdir / "pa_input.json", workdir / f"pa_export_{concurrency}.json"
    inp.write_text(json.dumps(data))
    export.unlink(missing_ok=True)
    cmd = [str(Path(sys.prefix) / "bin" / "perf_analyzer"), "-m", "llm", "-i", "grpc",
           "--streaming", "-u", url, "--input-data", str(inp),
           "--concurrency-range", str(concurrency), "--measurement-mode", "count_windows",
           "--measurement-request-count", str(n_requests), "-s", "1000", "-r", "4",
           "--profile-export-file", str(export)]
    t0, cpu0 = time.perf_counter(), cpu_snapshot()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    cores = cores_used(cpu0, cpu_snapshot(), time.perf_counter() - t0)
    if proc.returncode != 0 or not export.exists():
        raise RuntimeError(f"perf_analyzer failed ({proc.returncode}): {proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    reqs = json.loads(export.read_text())["experiments"][0]["requests"]
    reqs = [r for r in reqs if r.get("response_timestamps")]
    start = min(r["timestamp"] for r in reqs)
    end = max(r["response_timestamps"][-1] for r in reqs)
    run = Run("triton", concurrency, len(reqs) * max_tokens, (end - start) / 1e9)
    run.ttft_s = [(r["response_timestamps"][0] - r["timestamp"]) / 1e9 for r in reqs]
    run.cores = cores
    return run


async def level(side: str, concurrency: int, n_requests: int, max_tokens: int, one) -> Run:
    """n_requests calls of `one(prompt, max_tokens) -> (tokens, ttft)`, `concurrency` at once."""
    queue = [PROMPTS[i % len(PROMPTS)] for i in range(n_requests)]
    run = Run(side, concurrency, 0, 0.0)

    async def worker():
        while queue:
            n, ttft = await one(queue.pop(), max_tokens)
            run.tokens += n
            run.ttft_s.append(ttft)

    t0, cpu0 = time.perf_counter(), cpu_snapshot()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall_s = time.perf_counter() - t0
    run.cores = cores_used(cpu0, cpu_snapshot(), run.wall_s)
    return run


def summarize(runs: list[Run]) -> dict:
    out = {}
    for c in sorted({r.concurrency for r in runs}):
        side = {}
        for s in ("inprocess", "triton"):
            rs = [r for r in runs if r.concurrency == c and r.side == s]
            ttft = [x for r in rs for x in r.ttft_s]
            side[s] = {"tok_s": sum(r.tokens for r in rs) / sum(r.wall_s for r in rs),
                       "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3}
        # per-round ratios: each triton round against the in-process round beside it
        pairs = zip([r for r in runs if r.concurrency == c and r.side == "inprocess"],
                    [r for r in runs if r.concurrency == c and r.side == "triton"])
        ratios = [t.tok_s / i.tok_s for i, t in pairs]
        out[c] = {**side,
                  "throughput_ratio": side["triton"]["tok_s"] / side["inprocess"]["tok_s"],
                  "throughput_ratio_per_round": ratios,
                  "extra_ttft_p50_ms": side["triton"]["ttft_p50_ms"] - side["inprocess"]["ttft_p50_ms"],
                  "extra_ttft_p99_ms": side["triton"]["ttft_p99_ms"] - side["inprocess"]["ttft_p99_ms"]}
    return out


async def _levels(name: str, side: str, one, args, rnd: int, runs: list[Run]) -> None:
    await level("warmup", 2, 4, 8, one)
    for c in args.concurrency:
        run = await level(side, c, max(args.min_requests, 2 * c), args.max_tokens, one)
        runs.append(run)
        print(f"[{name}] round={rnd} c={c:<3} {side:9s} {run.tok_s:8.1f} tok/s "
              f"ttft p50 {pct(run.ttft_s, 50) * 1e3:7.1f} ms  cores {run.cores}", flush=True)


async def _inprocess_phase(name, engine_args, args, rnd, runs):
    eng = InProcess(engine_args)
    try:
        await _levels(name, "inprocess", eng.one, args, rnd, runs)
    finally:
        eng.shutdown()


def _triton_phase(name, repo, workdir, args, rnd, runs):
    from omni_tools.server import TritonServer

    server = TritonServer(repo, log_path=workdir / f"triton-{name}-{rnd}.log")
    server.start(timeout=600)
    try:
        perf_analyzer_level(server.grpc_url, 2, 4, 8, workdir)  # warm-up
        for c in args.concurrency:
            run = perf_analyzer_level(server.grpc_url, c, max(args.min_requests, 2 * c),
                                      args.max_tokens, workdir)
            runs.append(run)
            print(f"[{name}] round={rnd} c={c:<3} triton    {run.tok_s:8.1f} tok/s "
                  f"ttft p50 {pct(run.ttft_s, 50) * 1e3:7.1f} ms  cores {run.cores}", flush=True)
    finally:
        server.stop()


def pin_cores() -> dict:
    """Pin the vLLM worker to the last core and everything else to the others.

    On a 2-core machine the worker's OpenMP threads otherwise share a core
    with the client, tritonserver and the stub, and a preempted OpenMP
    barrier stalls every step. Both sides get the same layout.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    worker, rest = cores[-1], cores[:-1]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(worker)
    os.sched_setaffinity(0, rest)  # inherited by tritonserver and the engine core
    return {"worker_core": worker, "other_cores": rest}


def bench_model(name: str, args, workdir: Path) -> dict:
    """Rounds of: one side's engine up, every level, engine down; then the other side.

    Only one engine runs at a time (an idle vLLM CPU engine still binds and
    spins on a core, which would tax the other side), and the order of the
    sides alternates between rounds.
    """
    from omni_tools import gen_repo, spec
    from omni_tools.tiny_models import ensure_model

    path = ensure_model(name)
    engine_args = {**ENGINE_ARGS, "model": str(path)}
    data = {"pipeline": "bench", "stages": {"llm": {
        "backend": "omni_llm", "model": str(path), "engine_args": ENGINE_ARGS}}}
    repo = workdir / f"repo-{name}"
    gen_repo.generate(spec.parse_spec(data, base_dir=workdir), repo, force=True)
    runs: list[Run] = []
    for rnd in range(args.rounds):
        phases = [lambda: asyncio.run(_inprocess_phase(name, engine_args, args, rnd, runs)),
                  lambda: _triton_phase(name, repo, workdir, args, rnd, runs)]
        for phase in (phases if rnd % 2 == 0 else phases[::-1]):
            phase()
    return {"model": name, "engine_args": ENGINE_ARGS, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "levels": summarize(runs),
            "runs": [asdict(r) | {"tok_s": r.tok_s} for r in runs]}


def to_markdown(report: dict) -> str:
    """The figures of a results JSON as a markdown table (for docs/benchmarks.md)."""
    lines = ["| model | concurrency | in-process tok/s | triton tok/s | ratio (per round) "
             "| TTFT p50 in-proc / triton ms | extra TTFT p50 / p99 ms |",
             "|---|---:|---:|---:|---|---|---|"]
    for res in report["results"]:
        for c, lv in res["levels"].items():
            rounds = ", ".join(f"{r:.2f}" for r in lv["throughput_ratio_per_round"])
            lines.append(
                f"| {res['model']} | {c} | {lv['inprocess']['tok_s']:.0f} | "
                f"{lv['triton']['tok_s']:.0f} | **{lv['throughput_ratio']:.2f}** ({rounds}) | "
                f"{lv['inprocess']['ttft_p50_ms']:.1f} / {lv['triton']['ttft_p50_ms']:.1f} | "
                f"{lv['extra_ttft_p50_ms']:+.1f} / {lv['extra_ttft_p99_ms']:+.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2-tiny", "qwen2.5-0.5b-random"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--out", type=Path, default=results_file("llm"))
    ap.add_argument("--no-pin", action="store_true", help="leave CPU placement to the OS")
    ap.add_argument("--report", metavar="JSON", help="only print the table of a results file")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                    help="extra engine argument for both sides, e.g. stream_interval=4")
    args = ap.parse_args(argv)
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        ENGINE_ARGS[key] = json.loads(value)
    if args.report:
        print(to_markdown(json.loads(Path(args.report).read_text())))
        return 0
    placement = {} if args.no_pin else pin_cores()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as d:
        for name in args.models:
            results.append(bench_model(name, args, Path(d)))
    report = {"command": " ".join(["python", *sys.argv]), "placement": placement,
              "results": results}
    write_results(args.out, report)
    print(to_markdown(report))
    for res in results:
        print(f"\n{res['model']}: throughput ratio (triton / in-process), extra TTFT")
        for c, lv in res["levels"].items():
            print(f"  c={c:>3}: {lv['inprocess']['tok_s']:8.1f} vs {lv['triton']['tok_s']:8.1f} "
                  f"tok/s  ratio {lv['throughput_ratio']:.3f}  extra TTFT p50 "
                  f"{lv['extra_ttft_p50_ms']:+.1f} ms  p99 {lv['extra_ttft_p99_ms']:+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

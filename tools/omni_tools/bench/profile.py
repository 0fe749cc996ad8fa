"""Scenario `profile`: where the time goes in omni-chat under load (py-spy).

Runs in the omni-bench process; starts tritonserver serving the omni-chat preset (or,
with `--checkpoint`, omni-bench transformers' served spec on that checkpoint, e.g.
`qwen3-tiny`), sends speech requests (text in, text + speech out) from threads through omni_client,
and meanwhile samples the stub processes of the orchestrator and of each stage (with
their vLLM engine processes) with py-spy, CPU time only (no idle samples). Reports per
process its share of one core and the functions its samples were in (self time).
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from omni_tools.bench.scenario import Ratio, Results, Scenario

PY_SPY = Path(sys.prefix) / "bin" / "py-spy"
STUB = "triton_python_backend_stub"
RATE = 50  # samples per second and process


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from omni_tools.bench.transformers_baseline import MODELS

    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0, help="sampling time under load")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stages", "--models", dest="stages", nargs="+",
                    default=["omni", "llm", "talker", "audio_decoder"],
                    help="the stage models whose processes are sampled")
    ap.add_argument("--checkpoint", default=None, choices=list(MODELS),
                    help="serve this omni-bench transformers model (e.g. qwen3-tiny) instead "
                         "of the omni-chat preset's tiny default")
    ap.add_argument("--top", type=int, default=6)


def stub_pids(server_pid: int, models: list[str]) -> dict[str, int]:
    """The stub process of each model (its command line names the model's folder)."""
    found = {}
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            if proc.name() != STUB and STUB not in " ".join(proc.cmdline()[:1]):
                continue
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        for model in models:
            if f"/{model}/" in cmd and model not in found:
                found[model] = proc.pid
    return found


def stage_pids(server_pid: int, stages: list[str]) -> dict[str, int]:
    """stub_pids of every one of `stages`; a ValueError names those not served."""
    found = stub_pids(server_pid, stages)
    if missing := [m for m in stages if m not in found]:
        raise ValueError(f"--stages: no stage process for {', '.join(missing)} "
                         f"(found {', '.join(found) or 'none'})")
    return found


def self_time(raw: str, top: int) -> tuple[int, list[tuple[str, float]]]:
    """(samples, the `top` leaf frames by share of the samples) of py-spy's raw output."""
    leaves: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        name, _, where = stack.split(";")[-1].partition(" (")
        where = where.rstrip(")").rsplit("/", 1)[-1]  # file:line without its folder
        leaves[f"{name} ({where})" if where else name] += int(count)
    total = sum(leaves.values())
    return total, [(f, n / total) for f, n in leaves.most_common(top)] if total else []


def _load(url: str, stop: threading.Event, concurrency: int, max_tokens: int,
          done: list[float]) -> None:
    from omni_client import OmniClient

    def worker(k: int) -> None:
        with OmniClient(url) as client:
            i = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                client.chat(f"request {k}-{i}: tell me a story", model="omni",
                            modalities=["text", "audio"], seed=i,
                            sampling_parameters={"max_tokens": max_tokens, "ignore_eos": True,
                                                 "temperature": 0})
                done.append(time.perf_counter() - t0)
                i += 1

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(args: argparse.Namespace) -> Results:
    from omni_tools import gen_repo, spec
    from omni_tools.server import TritonServer

    work = Path(tempfile.mkdtemp(prefix="omni-bench-profile-"))
    repo = work / "repo"
    if args.checkpoint:
        from omni_tools.bench.transformers_baseline import served_spec

        served = served_spec(args.checkpoint, work)
    else:
        served = spec.load_preset("omni-chat")
    gen_repo.generate(served, repo, force=True)
    done: list[float] = []
    with TritonServer(repo, log_path=work / "tritonserver.log") as server:
        pids = stage_pids(server.proc.pid, args.stages)
        stop = threading.Event()
        load = threading.Thread(target=_load, args=(server.grpc_url, stop, args.concurrency,
                                                    args.max_tokens, done), daemon=True)
        load.start()
        deadline = time.monotonic() + 300
        while len(done) < args.concurrency and time.monotonic() < deadline:
            time.sleep(0.2)  # warm: every worker has finished one request
        spies = {m: subprocess.Popen(
            [str(PY_SPY), "record", "--pid", str(pid), "--duration", str(int(args.seconds)),
             "--rate", str(RATE), "--format", "raw", "--nonblocking", "--subprocesses",
             "-o", str(work / f"{m}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for m, pid in pids.items()}
        before = len(done)
        for proc in spies.values():
            proc.wait(timeout=args.seconds + 120)
        requests_s = (len(done) - before) / args.seconds
        stop.set()
        load.join(timeout=300)
    processes = {}
    for model in pids:
        path = work / f"{model}.txt"
        samples, top = self_time(path.read_text() if path.is_file() else "", args.top)
        processes[model] = {"cores": samples / (RATE * args.seconds), "top_self": top}
    return {"checkpoint": args.checkpoint, "concurrency": args.concurrency,
            "seconds": args.seconds,
            "max_tokens": args.max_tokens, "requests_s_while_sampled": requests_s,
            "processes": processes, "artifacts": str(work)}


def table(results: Results) -> str:
    served = f" on {results['checkpoint']}" if results.get("checkpoint") else ""
    rows = [f"Sampled {results['seconds']:.0f} s{served} at concurrency {results['concurrency']} "
            f"({results['requests_s_while_sampled']:.2f} speech replies/s of "
            f"{results['max_tokens']} tokens), CPU time only:", "",
            "| process (with its engine processes) | cores busy | where (self time) |",
            "|---|---:|---|"]
    for model, p in results["processes"].items():
        where = "; ".join(f"{f} {share:.0%}" for f, share in p["top_self"])
        rows.append(f"| {model} | {p['cores']:.2f} | {where} |")
    return "\n".join(rows)


SCENARIO = Scenario(name="profile", title="omni-chat under load: where the time goes (py-spy)",
                    add_arguments=add_arguments, run=run, table=table,
                    ratios=lambda results: list[Ratio](), quick=["--seconds", "15"])

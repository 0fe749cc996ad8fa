"""Benchmark: how long a fresh tritonserver takes to turn ready, per preset, side by side.

Runs in omni-bench's child process (`omni-bench server-start`, on demand). Each
preset's repository is generated once with omni-gen-repo; then, per round, each
side starts a fresh `tritonserver --model-repository=...` in its own environment,
and the time from the launch to ready (/v2/health/ready and the metrics endpoint
answer, polled every 0.5 s) is taken, then the time from asking it to stop (SIGTERM
to its process group) to its exit; the next side starts after that. The sides
alternate in order from round to round. The first side is the
baseline: each other side's ratio is its ready time over the baseline's, per round.

    omni-bench server-start
    omni-bench server-start -- --presets text-chat omni-chat --rounds 3
    omni-bench server-start -- --side spawned:OMNI_VLLM_ENGINE_FORK=0 --side forked:

Default sides: `spawned` (OMNI_VLLM_ENGINE_FORK=0: vLLM spawns each engine core) and
`forked` (the default: the stage's stub forks it, omni_serve/llm/engine_fork.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omni_tools.bench.scenario import results_file, write_results
from omni_tools.server import TritonServer

DEFAULT_SIDES = ["spawned:OMNI_VLLM_ENGINE_FORK=0", "forked:"]


def parse_side(text: str) -> tuple[str, dict[str, str]]:
    """`name:K=V,K=V` -> (name, {K: V}); `name:` is the server's default environment."""
    name, _, settings = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"--side {text!r}: give it a name (name:K=V,...)")
    env = {}
    for item in filter(None, settings.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"--side {text!r}: {item!r} is not NAME=VALUE")
        env[key] = value
    return name, env


def start_and_stop(repo: Path, env: dict[str, str], log_path: Path,
                   timeout_s: float) -> tuple[float, float]:
    """Seconds from launching tritonserver on `repo` to ready, and from asking it to stop
    (SIGTERM to its process group) to its exit."""
    server = TritonServer(repo, log_path=log_path, env=env)
    t0 = time.monotonic()
    server.start(timeout=timeout_s, attempts=1)
    ready = time.monotonic() - t0
    t1 = time.monotonic()
    server.stop()
    return ready, time.monotonic() - t1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["text-chat", "omni-chat"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--side", dest="sides", action="append", type=parse_side,
                   help="name:K=V,... (repeatable; the first is the baseline); default: "
                        + " ".join(DEFAULT_SIDES))
    p.add_argument("--timeout", type=float, default=600.0, help="a start's bound, s")
    p.add_argument("--out", type=Path, default=results_file("server-start"))
    args = p.parse_args(argv)
    sides = args.sides or [parse_side(s) for s in DEFAULT_SIDES]
    if len({name for name, _ in sides}) != len(sides):
        p.error("give each --side its own name")

    tmp = Path(tempfile.mkdtemp(prefix="bench-server-start-"))
    gen = str(Path(sys.prefix) / "bin" / "omni-gen-repo")
    results = []
    for preset in args.presets:
        repo = tmp / preset
        subprocess.run([gen, "--preset", preset, "-o", str(repo)], check=True)
        times: dict[str, list[float]] = {name: [] for name, _ in sides}
        stops: dict[str, list[float]] = {name: [] for name, _ in sides}
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for name, env in order:
                ready, stop = start_and_stop(repo, env, tmp / f"{preset}-{name}-{r}.log",
                                             args.timeout)
                times[name].append(ready)
                stops[name].append(stop)
                print(f"{preset} round {r} {name}: ready in {ready:.1f} s, stopped in "
                      f"{stop:.1f} s", flush=True)
        base = sides[0][0]
        row = {"preset": preset, "ready_s": {n: [round(t, 2) for t in ts] for n, ts in times.items()},
               "stop_s": {n: [round(t, 2) for t in ts] for n, ts in stops.items()},
               "ready_s_median": {n: round(statistics.median(ts), 2) for n, ts in times.items()},
               "ratio_per_round": {n: [round(t / b, 3) for t, b in zip(ts, times[base])]
                                   for n, ts in times.items() if n != base}}
        row["ratio"] = {n: round(statistics.median(rs), 3)
                        for n, rs in row["ratio_per_round"].items()}
        print(json.dumps(row), flush=True)
        results.append(row)
    write_results(args.out, {"sides": {name: env for name, env in sides}, "baseline": sides[0][0],
                             "rounds": args.rounds, "logs": str(tmp), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

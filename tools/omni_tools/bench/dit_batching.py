"""Benchmark: the omni_dit stage with Triton dynamic batching vs max_batch_size 1.

One process (the client, tritonclient gRPC from threads) and two tritonserver
children serving the text-to-image preset: one as generated (max_batch_size 8,
dynamic batching), one with max_batch_size 1. Both stay up; every round
measures each concurrency level on both, order alternating, so drift hits
both alike. Reports images/s and the ratio batched / unbatched. The `dit` scenario
of omni-bench (its child process).

    omni-bench dit -- --rounds 2 --requests 24
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from omni_tools.bench import dit_request
from omni_tools.bench.scenario import results_file, write_results

MODEL = "text_to_image"


def level(url: str, concurrency: int, n: int, size: int, steps: int) -> float:
    """Images per second for n requests with `concurrency` in flight."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: dit_request.generate(url, i, size, steps, model=MODEL),
                      range(n)))
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    from omni_tools import gen_repo, spec
    from omni_tools.server import TritonServer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--out", type=Path, default=results_file("dit"))
    args = ap.parse_args(argv)

    base = spec.load_preset("text-to-image")
    results: dict = {"command": " ".join(["python", *sys.argv]), "levels": {}}
    with tempfile.TemporaryDirectory(prefix="bench-dit-") as d:
        servers = {}
        for label, mbs in (("batched", None), ("mbs1", 1)):
            data = base.model_dump(mode="json", exclude_none=True)
            if mbs is not None:
                data["stages"][MODEL]["max_batch_size"] = mbs
            repo = Path(d) / label
            gen_repo.generate(spec.parse_spec(data, base_dir=Path(d)), repo, force=True)
            servers[label] = TritonServer(repo, log_path=Path(d) / f"{label}.log").start()
        try:
            for s in servers.values():
                level(s.grpc_url, 2, 4, args.size, args.steps)  # warm-up
            runs: dict = {c: {"batched": [], "mbs1": []} for c in args.concurrency}
            for rnd in range(args.rounds):
                for c in args.concurrency:
                    order = ["batched", "mbs1"] if rnd % 2 == 0 else ["mbs1", "batched"]
                    for label in order:
                        ips = level(servers[label].grpc_url, c, args.requests, args.size,
                                    args.steps)
                        runs[c][label].append(ips)
                        print(f"round={rnd} c={c} {label:8s} {ips:6.2f} images/s", flush=True)
        finally:
            for s in servers.values():
                s.stop()
    for c, r in runs.items():
        b, u = float(np.mean(r["batched"])), float(np.mean(r["mbs1"]))
        results["levels"][c] = {"batched_images_s": b, "mbs1_images_s": u, "ratio": b / u,
                                "ratio_per_round": [x / y for x, y in zip(r["batched"], r["mbs1"])]}
        print(f"c={c}: batched {b:.2f} vs max_batch_size 1 {u:.2f} images/s -> {b / u:.2f}x")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

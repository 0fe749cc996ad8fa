"""Stress: unary ModelInfer calls cancelled by gRPC while they run, queue or complete.

Runs in its own process against a tritonserver it starts (the text-to-image preset, one
DiT stage with Triton's dynamic batcher): T threads each send a `text_to_image` call
and cancel it after a random 0-`--max-delay-ms` ms (a DiT call takes ~90 ms here, so
cancels land while the request is queued, while it runs and as it completes), until N
calls in all. Prints one JSON line: the calls, whether the server is still alive and
its models ready, Triton's own success / CANCELED counts (a CANCELED one was dropped
from the queue and never computed) and how many times its log says
"HandleCancellation" (the 2.51 stream-cancellation race, upstream #7368).

It is why the orchestrator cancels unary stage calls with gRPC on Triton 2.51 while it
ends streams in-band. Measured on the 2-core development machine (Triton 2.51):
N=1200, T=4: 19 s, alive, ready, served after, 0 HandleCancellation lines, 235
CANCELED by Triton before they ran; N=6000, T=8: 47 s, the same, 1454 CANCELED.

The `unary-cancel` scenario of omni-bench (its child process; on demand).

    omni-bench unary-cancel -- --calls 6000 --threads 8
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from omni_tools import gen_repo, spec
from omni_tools.bench.scenario import results_file, write_results
from omni_tools.server import TritonServer, metric_sample

MODEL = "text_to_image"


def _prompt(text: str) -> list:
    x = grpcclient.InferInput("prompt", [1, 1], "BYTES")
    x.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return [x]


def _calls(url: str, n: int, seed: int, max_delay_s: float) -> None:
    rng = random.Random(seed)
    with grpcclient.InferenceServerClient(url) as client:
        for i in range(n):
            # the callback of a cancelled call may never run: nothing waits for it
            call = client.async_infer(MODEL, _prompt(f"cancel {seed} {i}"),
                                      callback=lambda result, error: None)
            time.sleep(rng.uniform(0, max_delay_s))
            call.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1200)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--max-delay-ms", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=results_file("unary-cancel"))
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-unary-cancel-") as tmp:
        root = Path(tmp)
        gen_repo.generate(spec.load_preset("text-to-image"), root / "repo")
        with TritonServer(root / "repo", log_path=root / "tritonserver.log") as server:
            t0 = time.monotonic()
            per_thread = args.calls // args.threads
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(lambda k: _calls(server.grpc_url, per_thread, k,
                                               args.max_delay_ms / 1000), range(args.threads)))
            with grpcclient.InferenceServerClient(server.grpc_url) as client:
                ready = client.is_server_live() and client.is_model_ready(MODEL)
                # a valid call after the storm is served
                served = client.infer(MODEL, _prompt("after")).as_numpy("image") is not None
            metrics = server.metrics()
            report = {
                "calls": per_thread * args.threads, "seconds": round(time.monotonic() - t0, 1),
                "alive": server.proc.poll() is None, "ready": bool(ready), "served_after": served,
                "triton_success": metric_sample(metrics, "nv_inference_request_success",
                                                model=MODEL),
                "triton_cancelled": metric_sample(metrics, "nv_inference_request_failure",
                                                  model=MODEL, reason="CANCELED"),
                "handle_cancellation_lines":
                    Path(server.log_path).read_text(errors="replace").count("HandleCancellation"),
            }
    print(json.dumps(report))
    write_results(args.out, report)
    return 0 if report["alive"] and report["ready"] and report["served_after"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Stress: ModelStreamInfer streams that end in an error, with or without `triton_grpc_error`.

Runs in its own process against a tritonserver it starts (the text-chat preset): T
threads each open a stream, send one request the `llm` stage rejects
(`sampling_parameters: {"max_tokenz": 3}`), wait for the error, stop the stream, and
repeat, until N streams in all or the server is gone. Prints one JSON line: the streams
sent, whether the server is still alive, and how many times its log says
"HandleCancellation called even when the context was not cancelled".

With `--sdk` each thread uses one `omni_client.OmniClient` with its default
`strict_stream_errors` instead (the header only for Triton >= 2.53) and checks
that every error is still a BadRequestError.

Measured on the 2-core development machine (Triton 2.51, N=8000, T=4):
    strict (`triton_grpc_error: true`): Signal 11 after ~3700-4100 streams (6 s), twice
    plain (no header): 8000 streams, alive, 0 HandleCancellation lines
    --sdk: see docs/benchmarks-notes.md
Upstream: triton-inference-server/server #7368, fixed in 24.12 by PR #7840.

The `stream-errors` scenario of omni-bench (its child process; on demand).

    omni-bench stream-errors -- --streams 8000 --threads 4 --strict
    omni-bench stream-errors -- --streams 8000 --threads 4 --sdk
"""
from __future__ import annotations

import argparse
import json
import queue
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from omni_tools import gen_repo, spec
from omni_tools.bench.scenario import results_file, write_results
from omni_tools.server import TritonServer


def _bad_request() -> list:
    def tensor(name, value):
        x = grpcclient.InferInput(name, [1], "BYTES")
        x.set_data_from_numpy(np.array([value], dtype=object))
        return x

    return [tensor("text_input", b"hi"), tensor("sampling_parameters", b'{"max_tokenz": 3}')]


def _streams(url: str, n: int, strict: bool) -> int:
    """Streams completed before one failed (n when none did)."""
    headers = {"triton_grpc_error": "true"} if strict else None
    for i in range(n):
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        try:
            client.start_stream(callback=lambda result, error: answers.put(error),
                                headers=headers)
            client.async_stream_infer("llm", _bad_request())
            if answers.get(timeout=30) is None:
                raise RuntimeError("the bad request was accepted")
            client.stop_stream()
        except Exception:
            return i
        finally:
            client.close()
    return n


def _sdk_streams(url: str, n: int) -> int:
    """The same through OmniClient's defaults; every error must still be a bad request."""
    from omni_client import BadRequestError, OmniClient

    with OmniClient(url, timeout=30, model="llm") as client:
        for i in range(n):
            try:
                client.generate("hi", sampling_parameters={"max_tokenz": 3})
            except BadRequestError:
                continue
            except Exception:
                return i
            return i  # the bad request was accepted
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--strict", action="store_true", help="send the triton_grpc_error header")
    ap.add_argument("--sdk", action="store_true", help="use OmniClient's defaults instead")
    ap.add_argument("--out", type=Path, default=results_file("stream-errors"))
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-stream-errors-"))
    gen_repo.generate(spec.load_preset("text-chat"), root / "repo")
    log = root / "tritonserver.log"
    with TritonServer(root / "repo", log_path=log) as server:
        t0 = time.perf_counter()
        per_thread = args.streams // args.threads
        with ThreadPoolExecutor(args.threads) as pool:
            def run(_):
                if args.sdk:
                    return _sdk_streams(server.grpc_url, per_thread)
                return _streams(server.grpc_url, per_thread, args.strict)

            done = list(pool.map(run, range(args.threads)))
        alive = server.proc.poll() is None
        report = {"strict": args.strict, "sdk": args.sdk, "threads": args.threads,
                  "streams": sum(done), "alive": alive,
                  "seconds": round(time.perf_counter() - t0, 1),
                  "handle_cancellation_lines": log.read_text(errors="replace")
                  .count("HandleCancellation called even when the context was not"),
                  "log": str(log)}
    print(json.dumps(report))
    write_results(args.out, report)
    return 0 if alive else 1


if __name__ == "__main__":
    raise SystemExit(main())

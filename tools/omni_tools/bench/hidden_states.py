"""Benchmark: what streaming hidden states costs the LLM stage (off, as tensors, in /dev/shm).

Runs in its own process against a tritonserver it starts (the text-chat preset, one
vLLM engine). Every round measures each concurrency level in each mode, the mode
order rotating between rounds, so drift hits all alike. A request streams
`--max-tokens` tokens (greedy, ignore_eos) of a fixed prompt; the client (tritonclient
gRPC streams) reads every response, and in shm mode also reads the rows from the
file and deletes it, as a caller on this host does. Prints one JSON document:
per level and mode the generated tokens/s (median over rounds) and the median over
rounds of its ratio to off in the same round. The `hidden-states` scenario of
omni-bench (its child process; on demand).

    omni-bench hidden-states -- --rounds 7 --requests 24
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from omni_serve.contract import LLM
from omni_serve.llm.hidden_states import read_rows
from omni_tools import gen_repo, spec
from omni_tools.bench.scenario import results_file, write_results
from omni_tools.server import TritonServer

MODES = ("off", "tensors", "shm")


def _inputs(mode: str, max_tokens: int) -> list:
    def t(name, arr, dtype):
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        return x

    sampling = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    return [t(LLM.TEXT_INPUT, np.array([b"tell me a long story about the sea"], object), "BYTES"),
            t(LLM.STREAM, np.array([True]), "BOOL"),
            t(LLM.SAMPLING_PARAMETERS, np.array([json.dumps(sampling).encode()], object), "BYTES"),
            t(LLM.RETURN_HIDDEN_STATES, np.array([mode != "off"]), "BOOL"),
            t(LLM.HIDDEN_STATES_IN_SHM, np.array([mode == "shm"]), "BOOL")]


def _one(url: str, mode: str, max_tokens: int) -> int:
    """Rows received (hidden states) for one request."""
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    rows, path = 0, None
    try:
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        client.async_stream_infer("llm", _inputs(mode, max_tokens),
                                  enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=300)
            if error is not None:
                raise RuntimeError(str(error))
            if mode == "tensors" and result.as_numpy(LLM.HIDDEN_STATES) is not None:
                rows += len(result.as_numpy(LLM.HIDDEN_STATES))
            if mode == "shm" and result.as_numpy(LLM.HIDDEN_STATES_ROWS) is not None:
                path = result.as_numpy(LLM.HIDDEN_STATES_FILE)[0].decode()
                first, count, width = result.as_numpy(LLM.HIDDEN_STATES_ROWS).tolist()
                rows += len(read_rows(path, first, count, width))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return rows
    finally:
        if path is not None:
            os.unlink(path)
        client.stop_stream()
        client.close()


def _level(url: str, mode: str, concurrency: int, requests: int, max_tokens: int) -> float:
    """Generated tokens/s over `requests` requests, `concurrency` at a time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: _one(url, mode, max_tokens), range(requests)))
    return requests * max_tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--requests", type=int, default=16, help="per level, mode and round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=results_file("hidden-states"))
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.levels.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-hidden-states-"))
    gen_repo.generate(spec.load_preset("text-chat"), root / "repo")
    runs: dict[str, dict[str, list[float]]] = {str(c): {m: [] for m in MODES} for c in levels}
    with TritonServer(root / "repo", log_path=root / "tritonserver.log") as server:
        for c in levels:  # warm-up: every level in every mode once, not counted
            for m in MODES:
                _level(server.grpc_url, m, c, c, args.max_tokens)
        for r in range(args.rounds):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for c in levels:
                for m in order:
                    runs[str(c)][m].append(
                        _level(server.grpc_url, m, c, args.requests, args.max_tokens))
    report = {}
    for c, by_mode in runs.items():
        off = by_mode["off"]
        report[c] = {m: {"tokens_per_s": round(statistics.median(v), 1),
                         # per round, against off measured beside it; then the median
                         "ratio_to_off": round(statistics.median(
                             x / o for x, o in zip(v, off, strict=True)), 3),
                         "rounds": [round(x, 1) for x in v]} for m, v in by_mode.items()}
    results = {"max_tokens": args.max_tokens, "requests": args.requests,
               "rounds": args.rounds, "levels": report}
    print(json.dumps(results, indent=1))
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: omni-chat on one tritonserver vs split over two (the thinker alone on one).

Sides, on this machine, only one side's servers alive at a time:
  one    the omni-chat preset on one server (the orchestrator calls every
         stage over gRPC on its own server);
  split  the same stages, `llm` (the thinker) on an `engine` server and the rest
         on a `front` server (like tests/integration/test_two_servers.py), plus
         a second entry model `omni_grpc` that never uses shared memory.
Rounds alternate the order (one, split | split, one | ...); a side that runs
twice in a row keeps its servers. Per visit:
  load   speech requests (text + 1 s WAV in, text + speech out) at --concurrency:
         requests/s, p50/p99 of total, first text and first audio (the pipelining
         scenario's client), each stage's seconds from the requests' `metrics` JSON, and
         CPU-seconds per request of all the side's processes;
  image  image + text requests one at a time (text out): the thinker's seconds,
         first text and total, through `omni` (split: image_embeds in system
         shared memory) and, on the split side, `omni_grpc` (image_embeds inline),
         the two taking turns;
  hop    the orchestrator's own GrpcStageClient from this process, one small
         llm call (1 token) at a time against the server that has `llm`:
         text only, --rows rows of image_embeds, and --big-rows x --big-hidden
         (a real model's image; the tiny stage refuses it after it crossed),
         each inline and in system shared memory.
Figures are reported as ratios against the one-server side of the same run. The
`split` scenario of omni-bench (its child process; on demand, 2 rounds ~6-8 min).

    omni-bench split
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from omni_serve.orchestrator.prompt import ChatPrompt
from omni_tools.bench.llm_stage import cores_used, cpu_snapshot
from omni_tools.bench.pipelining import level, one_request, wav
from omni_tools.bench.scenario import results_file, write_results

SIDES = ("one", "split")
NO_SHM = "omni_grpc"


def split_spec(data: dict) -> dict:
    """The omni-chat spec `data` with `llm` on server `engine`, the rest on `front`."""
    data = json.loads(json.dumps(data))
    data["stages"][NO_SHM] = json.loads(json.dumps(data["stages"]["omni"]))
    data["stages"][NO_SHM]["env"] = {"OMNI_SERVER_ENGINE_SHM": "none"}
    # the engine's real port is given at start (OMNI_SERVER_ENGINE_URL on the front)
    # (and takes image_embeds in shared memory from 1 KiB: the tiny image's are ~16 KiB)
    data["servers"] = {"front": {}, "engine": {"grpc_url": "127.0.0.1:1",
                                               "shared_memory_min_bytes": 1024}}
    for name, stage in data["stages"].items():
        stage["server"] = "engine" if name == "llm" else "front"
    data["pipeline"] = "omni-split"
    return data


@contextlib.contextmanager
def serving(side: str, repo: Path, logs: Path):
    """Start the side's server(s); yields (entry server's gRPC URL, llm server's gRPC URL)."""
    from concurrent.futures import ThreadPoolExecutor

    from omni_tools.server import TritonServer, free_ports

    if side == "one":
        with TritonServer(repo, log_path=logs / "one.log") as server:
            yield server.grpc_url, server.grpc_url
        return
    ports = free_ports(6)  # both servers start at once: their ports must differ
    engine = TritonServer(repo / "engine", http_port=ports[0], grpc_port=ports[1],
                          metrics_port=ports[2], log_path=logs / "engine.log")
    front = TritonServer(repo / "front", http_port=ports[3], grpc_port=ports[4],
                         metrics_port=ports[5], log_path=logs / "front.log",
                         env={"OMNI_SERVER_ENGINE_URL": engine.grpc_url})
    try:
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(engine.start), pool.submit(front.start)]:
                started.result()
        if front.env["OMNI_SERVER_ENGINE_URL"] != engine.grpc_url:  # a retry took new ports
            front.stop()
            front.env["OMNI_SERVER_ENGINE_URL"] = engine.grpc_url
            front.start()
        yield front.grpc_url, engine.grpc_url
    finally:
        front.stop()
        engine.stop()


def _png(side: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    rng = np.random.default_rng(side)
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def images(url: str, models: list[str], n: int, image: bytes) -> dict:
    """Image + text requests one at a time, the entry models taking turns (after one warm-up
    each): per model the thinker's seconds, first text and total (p50)."""
    rows: dict[str, list] = {m: [] for m in models}
    for i in range(n + 1):
        for model in models:
            r = one_request(url, model, i, 8, None, image=image, modalities=("text",))
            if i:
                rows[model].append(r)
    return {m: {"thinker_s_p50": float(np.median([r["metrics"]["stage_seconds"]["thinker"]
                                                   for r in rs])),
                "ttft_p50": float(np.median([r["ttft"] for r in rs])),
                "total_p50": float(np.median([r["total"] for r in rs]))}
            for m, rs in rows.items()}


async def _hop(url: str, prompt: ChatPrompt, n: int, rows: int, hidden: int, shm: str, *,
               refused: bool = False) -> float:
    """p50 seconds of one 1-token llm call through the orchestrator's GrpcStageClient.

    `refused`: `hidden` is not the thinker's, so the stage refuses the rows after
    they crossed (a real model's payload size on the tiny model).
    """
    from omni_serve.contract import LLM
    from omni_serve.orchestrator.grpc_client import GrpcStageClient
    from omni_serve.orchestrator.pipeline import StageCallError

    client = GrpcStageClient(url, shm, shared_memory_min_bytes=1024)
    text = prompt.render("You are a helpful assistant.", "what is this?", ["image"] if rows else [])
    inputs = {LLM.TEXT_INPUT: np.array([text.encode()], dtype=np.object_),
              LLM.STREAM: np.array([True]),
              LLM.SAMPLING_PARAMETERS: np.array([json.dumps({"max_tokens": 1, "temperature": 0})
                                                 .encode()], dtype=np.object_)}
    if rows:  # one image of `rows` rows: a (1, 2, 2 * rows) patch grid, merged 2 x 2
        inputs[LLM.IMAGE_EMBEDS] = np.random.default_rng(0).standard_normal(
            (rows, hidden)).astype(np.float32) * 0.02
        inputs[LLM.IMAGE_GRID_THW] = np.array([[1, 2, 2 * rows]], dtype=np.int64)
    times = []
    try:
        for i in range(n + 1):
            t0 = time.perf_counter()
            try:
                async for _ in client.stream("llm", inputs, [LLM.TEXT_OUTPUT],
                                             request_id=f"hop-{i}", timeout_s=60):
                    pass
            except StageCallError as e:
                if not (refused and LLM.IMAGE_EMBEDS in e.message):
                    raise
            if i:  # the first one warms the connection
                times.append(time.perf_counter() - t0)
            if client.shm is not None:
                await client.shm.drain()  # its unregister is off the call's path; not timed
    finally:
        await client.close()
    return float(np.median(times))


_LOOP = asyncio.new_event_loop()  # one loop for the process: grpc.aio stays bound to it


def hop(url: str, args, hidden: int, prompt: ChatPrompt) -> dict:
    """One small llm call at a time: text only, --rows real rows, --big-rows x --big-hidden."""
    n = args.hop_calls
    out = {"text_only_s": _LOOP.run_until_complete(_hop(url, prompt, n, 0, hidden, "none"))}
    for name, rows, width in (("rows", args.rows, hidden), ("big", args.big_rows, args.big_hidden)):
        for shm in ("none", "system"):
            key = f"{name}_{'shm' if shm == 'system' else 'inline'}_s"
            out[key] = _LOOP.run_until_complete(
                _hop(url, prompt, n, rows, width, shm, refused=width != hidden))
    return out


def encoder_rows(url: str, image: bytes) -> tuple[int, int]:
    """(rows, width) of the image encoder's embeddings for `image`."""
    import tritonclient.grpc as grpcclient

    from omni_serve.contract import ENCODER

    x = grpcclient.InferInput(ENCODER.MEDIA, [1, 1], "BYTES")
    x.set_data_from_numpy(np.array([[image]], dtype=np.object_))
    emb = grpcclient.InferenceServerClient(url).infer("image_encoder", [x]).as_numpy(
        ENCODER.EMBEDDINGS)
    return int(np.prod(emb.shape[:-1])), int(emb.shape[-1])


def visit(side: str, urls: tuple[str, str], args, audio: bytes, image: bytes, hidden: int,
          prompt: ChatPrompt) -> dict:
    entry, llm = urls
    # The load runs the split without shared memory (the front's `omni_grpc`), so it
    # measures the split alone; shared memory is measured by the image and hop phases.
    model = NO_SHM if side == "split" else "omni"
    level(entry, model, 2, 2, 8, audio)  # warm-up
    before, t0 = cpu_snapshot(), time.perf_counter()
    out = {"load": level(entry, model, args.concurrency, args.requests, args.max_tokens, audio)}
    # CPU-seconds per wall-second of every process of the side (and this client)
    out["load_cores"] = cores_used(before, cpu_snapshot(), time.perf_counter() - t0)
    out["load"]["cpu_s_per_request"] = sum(out["load_cores"].values()) / out["load"]["requests_s"]
    out["image"] = images(entry, ["omni", NO_SHM] if side == "split" else ["omni"],
                          args.image_requests, image)
    out["hop"] = hop(llm, args, hidden, prompt)
    return out


def thinker_width(config: dict) -> int:
    """The width of the thinker's input rows (image_embeds): its text model's hidden size,
    in an omni checkpoint's config.json (thinker_config.text_config) or a plain one."""
    text = config.get("thinker_config", {}).get("text_config", config)
    return int(text["hidden_size"])


def _mean(rows: list[dict]) -> dict:
    """Key by key mean of `rows` (nested dicts alike; a missing number counts as 0)."""
    out: dict = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        present = [r[k] for r in rows if k in r]
        out[k] = (_mean(present) if isinstance(present[0], dict)
                  else float(np.mean([r.get(k, 0.0) for r in rows])))
    return out


def summarize(runs: dict) -> dict:
    """Per side the mean over rounds; every figure of `split` also as split / one."""
    mean = {side: _mean(visits) for side, visits in runs.items()}

    def ratio(a, b):
        return {k: ratio(a[k], b[k]) if isinstance(a[k], dict) else a[k] / b[k]
                for k in a if k in b}

    out = {"one": mean["one"], "split": mean["split"],
           "split_over_one": ratio(mean["split"], mean["one"]),
           "throughput_ratio_per_round": [s["load"]["requests_s"] / o["load"]["requests_s"]
                                          for s, o in zip(runs["split"], runs["one"])]}
    img = mean["split"]["image"]
    out["split_image_shm_over_inline"] = ratio(img["omni"], img[NO_SHM])
    return out


def main(argv=None) -> int:
    from omni_tools import gen_repo, spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16, help="speech requests per visit")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--image-requests", type=int, default=6, help="image requests per entry model")
    ap.add_argument("--image-side", type=int, default=448, help="px of the square test image")
    ap.add_argument("--hop-calls", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1024,
                    help="image_embeds rows (of the thinker's width) of the hop calls")
    ap.add_argument("--big-rows", type=int, default=1200,
                    help="rows of a real model's image: Qwen2.5-Omni-7B, ~1280x720 px")
    ap.add_argument("--big-hidden", type=int, default=3584, help="a real thinker's hidden size")
    ap.add_argument("--out", type=Path, default=results_file("split"))
    args = ap.parse_args(argv)

    data = spec.load_preset("omni-chat").model_dump(mode="json", exclude_none=True)
    audio, image = wav(), _png(args.image_side)
    results: dict = {"command": " ".join(["python", *sys.argv]), "args": vars(args),
                     "hop_big_image_embeds_bytes": args.big_rows * args.big_hidden * 4, "rounds": []}
    runs: dict = {side: [] for side in SIDES}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-split-") as d:
        root = Path(d)
        repos = {"one": root / "one", "split": root / "split"}
        gen_repo.generate(spec.parse_spec(data, base_dir=root), repos["one"], force=True)
        llm_dir = Path(json.loads((repos["one"] / "llm" / "engine.json").read_text())["model"])
        hidden = thinker_width(json.loads((llm_dir / "config.json").read_text()))
        prompt = ChatPrompt.load(
            json.loads((repos["one"] / "omni" / "engine.json").read_text())["tokenizer"])
        results["hop_image_embeds_bytes"] = args.rows * hidden * 4
        gen_repo.generate(spec.parse_spec(split_spec(data), base_dir=root), repos["split"],
                          force=True)
        order = [side for rnd in range(args.rounds)
                 for side in (SIDES if rnd % 2 == 0 else SIDES[::-1])]
        stack = contextlib.ExitStack()
        running = None
        try:
            for i, side in enumerate(order):
                if side != running:
                    stack.close()
                    t0 = time.perf_counter()
                    urls = stack.enter_context(serving(side, repos[side], root))
                    running = side
                    print(f"[{side}] servers up in {time.perf_counter() - t0:.0f} s", flush=True)
                    if "image_image_embeds_bytes" not in results:
                        rows, width = encoder_rows(urls[0], image)
                        results["image_image_embeds_bytes"] = rows * width * 4
                r = visit(side, urls, args, audio, image, hidden, prompt)
                runs[side].append(r)
                results["rounds"].append({"round": i // 2, "side": side, **r})
                ld = r["load"]
                print(f"round {i // 2} {side:5s} {ld['requests_s']:.3f} req/s  total p50/p99 "
                      f"{ld['total_p50']:.2f}/{ld['total_p99']:.2f}s  first audio p50/p99 "
                      f"{ld['ttfa_p50']:.2f}/{ld['ttfa_p99']:.2f}s  first text p50/p99 "
                      f"{ld['ttft_p50']:.3f}/{ld['ttft_p99']:.3f}s  thinker p50 "
                      f"{ld['thinker_s_p50']:.2f}s  CPU {ld['cpu_s_per_request']:.2f} s/request | "
                      f"image {json.dumps(r['image'])} | "
                      f"hop {json.dumps(r['hop'])}", flush=True)
        finally:
            stack.close()
    results["summary"] = summarize(runs)
    results["wall_s"] = time.perf_counter() - t_start
    print(json.dumps(results["summary"], indent=2))
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

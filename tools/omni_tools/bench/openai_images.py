"""Scenario `images`: AIPerf -> omni-openai -> Triton vs a plain diffusers script.

Processes. The omni-bench process starts, as children, tritonserver serving the
text-to-image preset (the omni_dit stage on qwen-image-tiny, Triton's dynamic batcher up
to 8) and `omni-openai` in front of it; NVIDIA AIPerf (`aiperf profile --endpoint-type
image_generation`, its own venv) is a child per measurement and drives `POST
/v1/images/generations`. The other side is what a user without a server runs, in the
omni-bench process itself: diffusers' `QwenImagePipeline.from_pretrained` on the same
checkpoint folder the stage serves, called one prompt at a time, and with a list of
`--batch` prompts per call. Both stay loaded the whole run; each side has the machine to
itself while it is measured (the served side shares it with AIPerf, its client).

What flows. The same seeded prompts, each with its own seed, the same size and steps on
both sides: AIPerf reads them from a single_turn JSONL (the seed per request in its
body, size and num_inference_steps as extra inputs, in file order); diffusers gets one
seeded torch.Generator per image and each image is encoded to PNG, as the server does.
Warm-up first on both (which also checks that both make the same images for the first
seeds); each round measures every concurrency level served and both diffusers ways,
the order of the two sides alternating between rounds; medians of the rounds.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import random
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omni_tools.bench import plots
from omni_tools.bench.scenario import Ratio, Results, Scenario
from omni_tools.bench.stats import median, summary

SIDES = ("omni", "diffusers")
LABELS = {"omni": "AIPerf -> omni-openai + Triton", "diffusers": "diffusers, one at a time",
          "diffusers_batched": "diffusers, batched"}
MODEL = "text_to_image"  # the preset's entry model: omni-openai's model name
PRESET = "text-to-image"
RATIO_LEVEL = 8
TARGET = 1.0  # ours: the issue sets no target for this comparison
WORDS = ("lighthouse", "fox", "teapot", "glacier", "violin", "orchard", "comet", "harbor",
         "lantern", "desert", "falcon", "castle", "meadow", "robot", "canyon", "tram")
STYLES = ("at dusk", "in watercolor", "under snow", "in neon light", "as a woodcut",
          "in fog", "at noon", "in pastel")


# --- requests (pure) ---------------------------------------------------------------------

def prompts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """`n` fixed (prompt, seed) pairs drawn from `seed`: the same on every run and both
    sides; request i's image seed is `seed * 100_000 + i`."""
    rng = random.Random(seed)
    return [(f"image {i}: a {rng.choice(WORDS)} and a {rng.choice(WORDS)} {rng.choice(STYLES)}",
             seed * 100_000 + i) for i in range(n)]


def request_body(prompt: str, seed: int, size: int, steps: int) -> dict[str, Any]:
    """The JSON body AIPerf sends for one image (used by the warm-up too)."""
    return {"prompt": prompt, "model": MODEL, "response_format": "b64_json", "n": 1,
            "size": f"{size}x{size}", "num_inference_steps": steps, "seed": seed}


# --- the served side -----------------------------------------------------------------------

def _post(base_url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(f"{base_url}/v1/images/generations",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return base64.b64decode(json.loads(resp.read())["data"][0]["b64_json"])


def _served(base_url: str, tokenizer: str, work: Path, reqs: Sequence[tuple[str, int]],
            args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    from omni_tools import aiperf

    run = aiperf.image_profile(base_url, MODEL, tokenizer, work, reqs, concurrency=concurrency,
                               width=args.size, height=args.size, steps=args.steps)
    run.raise_for_failures()
    sent = [(p["prompt"], p["seed"], p["size"], p["num_inference_steps"]) for p in run.payloads]
    want = [(p, s, f"{args.size}x{args.size}", args.steps) for p, s in reqs]
    if sorted(sent) != sorted(want):  # AIPerf sent exactly our requests
        raise RuntimeError(f"AIPerf sent other requests than asked: {sent[:2]} vs {want[:2]}")
    return summarize_aiperf(run.summary)


def summarize_aiperf(s: dict[str, Any], images_per_request: int = 1) -> dict[str, Any]:
    """images/s and request latency percentiles from AIPerf's profile_export_aiperf.json.

    AIPerf 0.13 exports no image metric for image generation: its num_images,
    image_throughput and image_latency count the images a request sends (chat vision
    inputs), so a text-to-image run has none, and image_throughput would be per request
    (its images / its latency) anyway. images/s is requests/s times the `n` each asks."""
    return {"images_s": s["request_throughput"]["avg"] * images_per_request,
            "requests": int(s["request_count"]["avg"]),
            "latency_p50_ms": s["request_latency"]["p50"],
            "latency_p95_ms": s["request_latency"]["p95"],
            "latency_p99_ms": s["request_latency"]["p99"]}


# --- the diffusers side --------------------------------------------------------------------

class DiffusersScript:
    """What a user without a server writes: the pipeline in-process, PNGs out."""

    def __init__(self, model: str, threads: int | None):
        import torch
        from diffusers import QwenImagePipeline

        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.pipe = QwenImagePipeline.from_pretrained(model)
        self.pipe.set_progress_bar_config(disable=True)

    def __call__(self, reqs: Sequence[tuple[str, int]], size: int, steps: int) -> list[bytes]:
        import torch

        # true_cfg_scale=1: no negative prompt, no CFG (as the stage; diffusers warns otherwise)
        images = self.pipe(prompt=[p for p, _ in reqs], height=size, width=size,
                           num_inference_steps=steps, true_cfg_scale=1.0,
                           generator=[torch.Generator().manual_seed(s) for _, s in reqs]).images
        out = []
        for image in images:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            out.append(buf.getvalue())
        return out


def timed_batches(call, reqs: Sequence[tuple[str, int]], batch: int) -> dict[str, Any]:
    """Run `call` on consecutive chunks of `batch` requests; images/s over them all and the
    latency percentiles of each image (an image waits for its whole batch)."""
    latencies = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        t = time.perf_counter()
        call(chunk)
        latencies += [(time.perf_counter() - t) * 1000] * len(chunk)
    wall = time.perf_counter() - t0
    return {"images_s": len(reqs) / wall, "requests": len(reqs), "batch": batch,
            **summary(latencies, "latency")}


def _ms_keys(d: dict[str, Any]) -> dict[str, Any]:
    return {(f"{k}_ms" if k.startswith("latency_p") else k): v for k, v in d.items()}


# --- the scenario ----------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, RATIO_LEVEL])
    ap.add_argument("--requests", type=int, default=64, help="images per measurement")
    ap.add_argument("--size", type=int, default=64, help="width = height")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="prompts per diffusers call, batched")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compare", type=int, default=2,
                    help="seeds whose images are compared between the sides (warm-up)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the diffusers script (default: torch's own)")


def _same_images(a: Sequence[bytes], b: Sequence[bytes]) -> dict[str, Any]:
    import numpy as np
    from PIL import Image

    def px(png: bytes):
        return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)

    diffs = [int(np.abs(px(x) - px(y)).max()) for x, y in zip(a, b)]
    return {"compared": len(diffs), "identical": sum(d == 0 for d in diffs),
            "max_abs_pixel_diff": max(diffs, default=0)}


def run(args: argparse.Namespace) -> Results:
    from omni_tools import aiperf, gen_repo, spec
    from omni_tools.server import OpenAIFrontend, TritonServer

    work = Path(tempfile.mkdtemp(prefix="omni-bench-images-"))  # logs stay for a look
    print(f"images: logs and AIPerf artifacts in {work}", flush=True)
    repo = work / "repo"
    gen_repo.generate(spec.load_preset(PRESET), repo, force=True)
    engine = json.loads((repo / MODEL / "engine.json").read_text())
    model = engine["model"]  # the checkpoint folder the stage serves
    tokenizer = str(Path(model) / "tokenizer")  # AIPerf counts prompt tokens with it
    reqs = prompts(args.requests)
    script = DiffusersScript(model, args.threads)

    def local(chunk):
        return script(chunk, args.size, args.steps)

    served: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    one: list[dict] = []
    batched: list[dict] = []
    with TritonServer(repo, log_path=work / "tritonserver.log") as triton, \
            OpenAIFrontend(triton.grpc_url, log_path=work / "omni-openai.log") as front:
        url = front.base_url
        # warm-up: diffusers one at a time and batched; the server from 1 and 8 clients
        cmp = reqs[:max(1, args.compare)]
        local_pngs = [local([r])[0] for r in cmp]
        local(reqs[:args.batch])
        served_pngs = [_post(url, request_body(p, s, args.size, args.steps)) for p, s in cmp]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda r: _post(url, request_body(*r, args.size, args.steps)),
                          reqs[:16]))
        same = _same_images(served_pngs, local_pngs)
        print(f"images: warm-up done; first {same['compared']} seeds: {same['identical']} "
              f"identical, largest pixel difference {same['max_abs_pixel_diff']}", flush=True)
        for rnd in range(args.rounds):
            for side in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
                if side == "omni":
                    for c in args.concurrency:
                        m = _served(url, tokenizer, work / f"r{rnd}-c{c}", reqs, args, c)
                        served[c].append(m)
                        print(f"images round={rnd} served c={c}: {m['images_s']:.1f} images/s, "
                              f"latency p50 {m['latency_p50_ms']:.0f} ms", flush=True)
                else:
                    one.append(_ms_keys(timed_batches(local, reqs, 1)))
                    batched.append(_ms_keys(timed_batches(local, reqs, args.batch)))
                    print(f"images round={rnd} diffusers: {one[-1]['images_s']:.1f} images/s "
                          f"one at a time, {batched[-1]['images_s']:.1f} batched by "
                          f"{args.batch}", flush=True)
    example = aiperf.command(url, MODEL, tokenizer, Path("artifacts"),
                             aiperf.image_args(Path("prompts.jsonl"), width=args.size,
                                               height=args.size, steps=args.steps),
                             requests=args.requests, concurrency=max(args.concurrency))
    return collect(served, one, batched) | {
        "model": model, "size": args.size, "steps": args.steps, "requests": args.requests,
        "rounds": args.rounds, "batch": args.batch, "same_images": same,
        "torch_threads": {"served": engine.get("torch_threads"), "diffusers": script.threads},
        "aiperf_command": " ".join(["aiperf", *example[1:]]),
        "notes": (f"Served: {PRESET} preset (omni_dit, Triton dynamic batching up to "
                  f"8 per call, {engine.get('torch_threads')} torch thread), AIPerf running "
                  f"on the same 2 cores. diffusers: QwenImagePipeline.from_pretrained in "
                  f"process, {script.threads} torch threads, PNG encoding included. "
                  f"Target {TARGET:g} at concurrency {RATIO_LEVEL} is ours: the issue "
                  f"sets none.")}


def collect(served: dict[int, list[dict]], one: list[dict], batched: list[dict]) -> Results:
    """Medians of the rounds and per-round ratios against the diffusers script."""
    def med(ms: list[dict]) -> dict[str, Any]:  # counts are the same in every round
        return {k: v if k in ("requests", "batch") else median([m[k] for m in ms])
                for k, v in ms[0].items()}

    levels = {}
    for c, ms in served.items():
        per_round = [m["images_s"] / o["images_s"] for m, o in zip(ms, one)]
        per_batched = [m["images_s"] / b["images_s"] for m, b in zip(ms, batched)]
        levels[str(c)] = {"omni": med(ms), "ratio": median(per_round),
                          "ratio_per_round": per_round, "ratio_vs_batched": median(per_batched),
                          "ratio_vs_batched_per_round": per_batched}
    return {"levels": levels, "diffusers": {"one_at_a_time": med(one), "batched": med(batched)}}


def ratios(results: Results) -> list[Ratio]:
    level = results["levels"].get(str(RATIO_LEVEL))
    return [Ratio(f"AIPerf -> omni-openai + Triton / diffusers one at a time, images/s at "
                  f"concurrency {RATIO_LEVEL} (qwen-image-tiny)",
                  None if level is None else level["ratio"], TARGET,
                  note="our own target" if level is not None
                  else f"concurrency {RATIO_LEVEL} not measured")]


def table(results: Results) -> str:
    d = results["diffusers"]
    one, bat = d["one_at_a_time"], d["batched"]
    b = bat["batch"]
    rows = [f"| concurrency | served images/s | diffusers one at a time | diffusers batch {b} "
            f"| served / one at a time (per round) | served / batch {b} "
            f"| served latency p50 / p95 / p99 ms |",
            "|---:|---:|---:|---:|---|---:|---|"]
    for c, lv in sorted(results["levels"].items(), key=lambda kv: int(kv[0])):
        o = lv["omni"]
        per = ", ".join(f"{r:.2f}" for r in lv["ratio_per_round"])
        rows.append(f"| {c} | {o['images_s']:.1f} | {one['images_s']:.1f} | {bat['images_s']:.1f} "
                    f"| **{lv['ratio']:.2f}** ({per}) | {lv['ratio_vs_batched']:.2f} "
                    f"| {o['latency_p50_ms']:.0f} / {o['latency_p95_ms']:.0f} / "
                    f"{o['latency_p99_ms']:.0f} |")
    rows.append(f"\ndiffusers latency per image p50 / p95 / p99: one at a time "
                f"{one['latency_p50_ms']:.0f} / {one['latency_p95_ms']:.0f} / "
                f"{one['latency_p99_ms']:.0f} ms; batch {b} (each image waits for its batch) "
                f"{bat['latency_p50_ms']:.0f} / {bat['latency_p95_ms']:.0f} / "
                f"{bat['latency_p99_ms']:.0f} ms.")
    same = results.get("same_images")
    if same:
        rows.append(f"\n{results['size']}x{results['size']}, {results['steps']} steps, "
                    f"{results['requests']} seeded prompts per measurement; first "
                    f"{same['compared']} seeds: {same['identical']} pixel-identical images "
                    f"served vs diffusers (largest difference {same['max_abs_pixel_diff']}/255).")
    return "\n".join(rows)


def draw(results: Results, folder: Path) -> list[Path]:
    levels = sorted(results["levels"], key=int)
    if not levels:
        return []
    d = results["diffusers"]
    b = d["batched"]["batch"]
    xs = [int(c) for c in levels]
    series = {LABELS["omni"]: [results["levels"][c]["omni"]["images_s"] for c in levels],
              LABELS["diffusers"]: [d["one_at_a_time"]["images_s"]] * len(levels)}
    if b in xs:  # a batch of b is the script's answer to b waiting prompts
        series[f"diffusers, batch of {b}"] = [d["batched"]["images_s"] if x == b else None
                                              for x in xs]
    return [plots.lines(folder / "openai_images.png",
                        f"Text to image {results['size']}x{results['size']}, "
                        f"{results['steps']} steps: images/s", "concurrency", "images/s",
                        xs, series)]


SCENARIO = Scenario(
    name="images", title="Image generation: AIPerf -> omni-openai + Triton vs diffusers",
    add_arguments=add_arguments, run=run, ratios=ratios, table=table, plots=draw,
    quick=["--rounds", "2", "--requests", "64"])

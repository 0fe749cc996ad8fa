"""Measure vLLM-Omni (PyPI vllm-omni 0.30.0) itself on this checkout's tiny checkpoints.

Runs in .venv/vllm-omni (tools/bench/vllm_omni_setup.sh) with OMNI_VLLM_OMNI_SHIM
pointing at tools/bench, so tools/bench/vllm_omni_shim.py (vLLM 0.32 API drift) and
vllm_omni_cpu_platform.py (a CPU OmniPlatform) are applied; vllm-omni's files are not
edited. Each path runs in its own child process (vllm-omni keeps process-global
state); a path that fails records its error and where it was raised.

  diffusion: AsyncOmni on qwen-image-tiny, float32, the DiT benchmark's prompts and
             seeds ("image {i}: a lighthouse at dusk", seed i), images/s at
             concurrency 1 and 8; images saved as .npy for a PSNR against ours.
  omni:      Omni on qwen2.5-omni-tiny (thinker -> talker -> code2wav), one text prompt.

    .venv/vllm-omni/bin/python tools/bench/vllm_omni_run.py --out /tmp/vo.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def prompt(i: int) -> str:
    from omni_tools.bench import dit_request  # .venv's, through the venv's .pth

    return dit_request.prompt(i)  # what our DiT benchmarks send


def _where(exc: BaseException) -> dict:
    """The error and the innermost frames (file:line) it came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {exc}"[:2000],
            "where": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} in {f.name}"
                      for f in frames[-6:]]}


# --- diffusion ------------------------------------------------------------------------

async def _diffusion(args) -> dict:
    import numpy as np
    from vllm_omni import AsyncOmni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    t0 = time.perf_counter()
    engine = AsyncOmni(model=args.model, dtype="float32", max_num_seqs=max(args.concurrency))
    startup_s = time.perf_counter() - t0

    async def one(i: int):
        sp = OmniDiffusionSamplingParams(height=args.size, width=args.size,
                                         num_inference_steps=args.steps, seed=i)
        last = None
        async for out in engine.generate(prompt(i), request_id=f"img-{i}-{time.monotonic_ns()}",
                                         sampling_params_list=[sp]):
            last = out
        return np.asarray(last.images[0].convert("RGB"), dtype=np.uint8)

    async def level(c: int, n: int) -> float:
        sem = asyncio.Semaphore(c)

        async def bounded(i):
            async with sem:
                return await one(i)

        t = time.perf_counter()
        await asyncio.gather(*(bounded(i) for i in range(n)))
        return n / (time.perf_counter() - t)

    res: dict = {"startup_s": startup_s, "levels": {}}
    try:
        await level(2, 4)  # warm-up
        for c in args.concurrency:
            runs = [await level(c, args.requests) for _ in range(args.rounds)]
            res["levels"][str(c)] = {"images_s": float(np.mean(runs)), "per_round": runs}
            print(f"vllm-omni diffusion c={c}: {np.mean(runs):.2f} images/s", flush=True)
        images = np.stack([await one(i) for i in range(args.compare)])
        np.save(Path(args.images), images)
        res["images"] = args.images
        res["image_shape"] = list(images.shape)
    finally:
        engine.shutdown()
    return res


# --- Qwen2.5-Omni -----------------------------------------------------------------------

def _omni(args) -> dict:
    from vllm_omni import Omni

    t0 = time.perf_counter()
    omni = Omni(model=args.model)
    startup_s = time.perf_counter() - t0
    try:
        t = time.perf_counter()
        outs = omni.generate(["Say hello."])
        wall = time.perf_counter() - t
        summary = [{"final_output_type": getattr(o, "final_output_type", None),
                    "text": [c.text for c in getattr(o, "outputs", []) or []][:1],
                    "multimodal_keys": sorted((o.multimodal_output or {}).keys())}
                   for o in outs]
        return {"startup_s": startup_s, "request_s": wall, "outputs": summary}
    finally:
        omni.close()


def child(args) -> int:
    try:
        if args.path == "diffusion":
            res = asyncio.run(_diffusion(args))
        else:
            res = _omni(args)
        res["ran"] = True
    except BaseException as exc:
        traceback.print_exc()
        res = {"ran": False, **_where(exc)}
    import vllm_omni_shim

    res["shim_applied"] = list(vllm_omni_shim.APPLIED)
    Path(args.child_out).write_text(json.dumps(res, indent=1))
    return 0


def root_causes(log: str, keep: int = 4) -> list[str]:
    """Distinct exceptions in a child's log (engine cores and workers log theirs there),
    each with the innermost frame that raised it, innermost processes first."""
    import re

    found: list[str] = []
    last_frame = ""
    for line in log.splitlines():
        line = re.sub(r"^\(\w+ pid=\d+\) (ERROR|WARNING) [\d\- :]+\[[^\]]+\] ", "", line)
        m = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', line)
        if m:
            last_frame = f"{m[1].split('site-packages/')[-1]}:{m[2]} in {m[3]}"
            continue
        m = re.match(r"(\w+(?:Error|Exception)): (.+)", line.strip())
        if m and "See root cause above" not in line and "Orchestrator initialization" not in line:
            entry = f"{m[1]}: {m[2][:300]} (at {last_frame})"
            if entry not in found:
                found.append(entry)
    return found[:keep]


def run_path(path: str, argv: list[str], timeout: float, workdir: Path) -> dict:
    out = workdir / f"{path}.json"
    # nobind: vLLM's CPU executor cannot autobind OpenMP threads in a VM with no NUMA
    # information ("Not enough allowed NUMA nodes"); our presets set it per engine too
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", **os.environ,
           "OMNI_VLLM_OMNI_SHIM": str(HERE), "VLLM_TARGET_DEVICE": "cpu"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", path,
           "--child-out", str(out), *argv]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode() + (exc.stderr or b"").decode() \
            if isinstance(exc.stdout, bytes) else (exc.stdout or "") + (exc.stderr or "")
        res = {"ran": False, "error": f"timed out after {timeout:.0f} s"}
    else:
        res = json.loads(out.read_text()) if out.is_file() else {
            "ran": False, "error": f"child exited {proc.returncode} without results"}
    res["wall_s"] = time.perf_counter() - t0
    (workdir / f"{path}.log").write_text(log)
    if not res["ran"]:
        res["root_causes"] = root_causes(log)
    res["log"] = str(workdir / f"{path}.log")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", nargs="+", default=["diffusion", "omni"],
                    choices=["diffusion", "omni"])
    ap.add_argument("--image-model", default=None, help="default: tiny_models qwen-image-tiny")
    ap.add_argument("--omni-model", default=None, help="default: tiny_models qwen2.5-omni-tiny")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--compare", type=int, default=4, help="images kept for the PSNR")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per path")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", required=False)
    # child-only
    ap.add_argument("--child", choices=["diffusion", "omni"])
    ap.add_argument("--child-out")
    ap.add_argument("--model")
    ap.add_argument("--images")
    args = ap.parse_args(argv)
    if args.child:
        args.path = args.child
        return child(args)

    import tempfile

    import vllm_omni_shim  # noqa: F401 - fail early if the shim is missing

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vllm-omni-run-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"vllm_omni_version": _version("vllm-omni"),
                     "vllm_version": _version("vllm") or _version("vllm-cpu"),
                     "paths": {}}
    common = ["--size", str(args.size), "--steps", str(args.steps), "--requests",
              str(args.requests), "--rounds", str(args.rounds), "--compare", str(args.compare),
              "--concurrency", *map(str, args.concurrency)]
    for path in args.paths:
        model = args.image_model if path == "diffusion" else args.omni_model
        model = model or str(_tiny("qwen-image-tiny" if path == "diffusion"
                                   else "qwen2.5-omni-tiny"))
        extra = ["--model", model, "--images", str(workdir / "vllm_omni_images.npy")]
        print(f"vllm-omni {path}: {model}", flush=True)
        results["paths"][path] = res = run_path(path, common + extra, args.timeout, workdir)
        res["model"] = model
        print(f"vllm-omni {path}: {'ran' if res['ran'] else 'failed: ' + res['error'][:300]}",
              flush=True)
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _tiny(name: str) -> Path:
    from omni_tools import tiny_models

    return tiny_models.ensure_model(name)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())

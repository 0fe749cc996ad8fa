"""Scenario `vllm-omni`: vLLM-Omni itself (PyPI vllm-omni 0.30.0) vs our served DiT.

Runs in the omni-bench process. vllm-omni lives in its own venv, .venv/vllm-omni
(tools/bench/vllm_omni_setup.sh; it reuses .venv's vLLM/torch/diffusers), and runs as a
child, `.venv/vllm-omni/bin/python tools/bench/vllm_omni_run.py`, through a benchmark-
only compatibility shim for vLLM 0.32 and a CPU platform plugin (tools/bench/). Its
diffusion path (AsyncOmni on qwen-image-tiny) is measured with the DiT benchmark's
prompts, seeds, size and steps; then tritonserver serving our text-to-image preset is
measured the same way in the same run, and the images of the first seeds are compared
(PSNR). Its Qwen2.5-Omni path (thinker -> talker -> code2wav on qwen2.5-omni-tiny) is
attempted too; a path that does not run records its error, and `notes` says which ran.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from omni_tools.bench import dit_request, plots
from omni_tools.bench.scenario import ROOT, Ratio, Results, Scenario

VENV_PYTHON = ROOT / ".venv" / "vllm-omni" / "bin" / "python"
RUNNER = ROOT / "tools" / "bench" / "vllm_omni_run.py"
SETUP = "tools/bench/vllm_omni_setup.sh"
MODEL = "text_to_image"  # our preset's DiT model


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--paths", nargs="+", default=["diffusion", "omni"],
                    choices=["diffusion", "omni"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--compare", type=int, default=4, help="seeds whose images are compared")
    ap.add_argument("--no-ours", action="store_true", help="skip our served DiT")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per vllm-omni path")


# --- ours: tritonserver serving the text-to-image preset ---------------------------------

def _infer(url: str, i: int, size: int, steps: int) -> np.ndarray:
    from omni_serve.contract import DIT

    return dit_request.generate(url, i, size, steps, model=MODEL, output=DIT.IMAGE_RAW)


def _ours(args, workdir: Path) -> dict:
    from omni_tools import gen_repo, spec
    from omni_tools.server import TritonServer

    base = spec.load_preset("text-to-image")
    repo = workdir / "repo"
    gen_repo.generate(base, repo, force=True)
    server = TritonServer(repo, log_path=workdir / "tritonserver.log").start()
    url = server.grpc_url

    def level(c: int, n: int) -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            list(pool.map(lambda i: _infer(url, i, args.size, args.steps), range(n)))
        return n / (time.perf_counter() - t0)

    try:
        level(2, 4)  # warm-up, as vllm_omni_run.py does
        levels = {}
        for c in args.concurrency:
            runs = [level(c, args.requests) for _ in range(args.rounds)]
            levels[str(c)] = {"images_s": float(np.mean(runs)), "per_round": runs}
            print(f"ours (text-to-image preset) c={c}: {np.mean(runs):.2f} images/s", flush=True)
        images = np.stack([_infer(url, i, args.size, args.steps) for i in range(args.compare)])
    finally:
        server.stop()
    return {"levels": levels, "images": images}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


# --- the scenario ---------------------------------------------------------------------------

def _notes(paths: dict, ours: dict | None, setup_error: str | None) -> str:
    if setup_error:
        return f"vllm-omni did not run: {setup_error}"
    parts = []
    for name, r in paths.items():
        label = {"diffusion": "diffusion (AsyncOmni, qwen-image-tiny)",
                 "omni": "Qwen2.5-Omni thinker->talker->code2wav (Omni, qwen2.5-omni-tiny)"}[name]
        if r.get("ran"):
            parts.append(f"{label}: ran")
        else:
            causes = r.get("root_causes") or [
                f"{r.get('error', '?')[:400]} (at {(r.get('where') or ['?'])[-1]})"]
            parts.append(f"{label}: did not run: " + " | ".join(causes))
    if paths.get("diffusion", {}).get("shim_applied"):
        parts.append("shim: " + "; ".join(paths["diffusion"]["shim_applied"]))
    if ours is None:
        parts.append("ours: not measured in this run")
    return ". ".join(parts)


def run(args: argparse.Namespace) -> Results:
    results: Results = {"paths": {}, "ours": None, "psnr_db": None}
    setup_error = None
    if not VENV_PYTHON.is_file():  # its own venv, set up on first use (PyPI vllm-omni)
        print("+", SETUP, flush=True)
        done = subprocess.run(["bash", str(ROOT / SETUP)], cwd=ROOT)
        if done.returncode != 0 or not VENV_PYTHON.is_file():
            setup_error = f"{SETUP} exited {done.returncode}"
    with tempfile.TemporaryDirectory(prefix="bench-vllm-omni-") as d:
        workdir = Path(d)
        vo_images = None
        if setup_error is None:
            out = workdir / "vllm_omni.json"
            cmd = [str(VENV_PYTHON), str(RUNNER), "--paths", *args.paths,
                   "--size", str(args.size), "--steps", str(args.steps),
                   "--requests", str(args.requests), "--rounds", str(args.rounds),
                   "--compare", str(args.compare), "--timeout", str(args.timeout),
                   "--concurrency", *map(str, args.concurrency),
                   "--workdir", str(workdir / "vllm-omni"), "--out", str(out)]
            print("+", " ".join(cmd[1:]), flush=True)
            proc = subprocess.run(cmd, cwd=ROOT)
            if out.is_file():
                vo = json.loads(out.read_text())
                results["vllm_omni_version"] = vo.get("vllm_omni_version")
                results["vllm_version"] = vo.get("vllm_version")
                for name, r in vo["paths"].items():
                    if r.get("images"):
                        vo_images = np.load(r.pop("images"))
                    r.pop("log", None)
                    results["paths"][name] = r
            else:
                setup_error = f"vllm_omni_run.py exited {proc.returncode} without results"
        ours = None
        if not args.no_ours and "diffusion" in args.paths:
            ours = _ours(args, workdir)
            if vo_images is not None:
                pairs = list(zip(vo_images, ours["images"]))
                results["psnr_db"] = {
                    "all": psnr(vo_images, ours["images"]),  # over every image compared
                    "per_seed": [psnr(a, b) for a, b in pairs],
                    "identical_images": sum(bool(np.array_equal(a, b)) for a, b in pairs),
                    "compared": len(pairs),
                    "max_abs_pixel_diff": int(np.abs(vo_images.astype(int)
                                                     - ours["images"].astype(int)).max())}
            results["ours"] = {"levels": ours["levels"]}
    results["notes"] = _notes(results["paths"], ours, setup_error)
    print("notes:", results["notes"], flush=True)
    return results


def _level(results: Results, side: str, c: str) -> float | None:
    if side == "ours":
        lv = (results.get("ours") or {}).get("levels", {}).get(c)
    else:
        lv = results["paths"].get("diffusion", {}).get("levels", {}).get(c)
    return None if lv is None else lv["images_s"]


def ratios(results: Results) -> list[Ratio]:
    out = []
    for c in ("1", "8"):
        ours, theirs = _level(results, "ours", c), _level(results, "vllm-omni", c)
        value = None if ours is None or theirs is None else ours / theirs
        out.append(Ratio(f"our DiT stage in Triton / vLLM-Omni diffusion, images/s at "
                         f"concurrency {c} (qwen-image-tiny)", value, 1.0,
                         note="" if value is not None else "not measured: " + results["notes"][:200]))
    return out


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def table(results: Results) -> str:
    rows = ["| concurrency | vLLM-Omni images/s | ours (Triton) images/s | ours / vLLM-Omni |",
            "|---:|---:|---:|---:|"]
    levels = sorted({*results["paths"].get("diffusion", {}).get("levels", {}),
                     *(results.get("ours") or {}).get("levels", {})}, key=int)
    for c in levels:
        a, b = _level(results, "vllm-omni", c), _level(results, "ours", c)
        ratio = "—" if a is None or b is None else f"**{b / a:.2f}**"
        rows.append(f"| {c} | {_fmt(a)} | {_fmt(b)} | {ratio} |")
    p = results.get("psnr_db")
    if p:
        rows.append(f"\nSame prompts and seeds ({p['compared']} images): vLLM-Omni's vs ours "
                    f"PSNR {p['all']:.1f} dB, {p['identical_images']} pixel-identical, "
                    f"largest pixel difference {p['max_abs_pixel_diff']}/255.")
    versions = (f"vllm-omni {results.get('vllm_omni_version')}, "
                f"vLLM {results.get('vllm_version')}")
    rows.append(f"\n{versions}.")  # the report adds the notes: what ran, what did not
    return "\n".join(rows)


def draw(results: Results, folder: Path) -> list[Path]:
    levels = sorted({*results["paths"].get("diffusion", {}).get("levels", {}),
                     *(results.get("ours") or {}).get("levels", {})}, key=int)
    if not levels:
        return []
    return [plots.lines(folder / "vllm_omni_dit.png", "qwen-image-tiny: vLLM-Omni vs ours",
                        "concurrency", "images/s", [int(c) for c in levels],
                        {"vLLM-Omni (AsyncOmni)": [_level(results, "vllm-omni", c) for c in levels],
                         "ours (Triton DiT stage)": [_level(results, "ours", c) for c in levels]})]


SCENARIO = Scenario(
    name="vllm-omni", title="vLLM-Omni itself (diffusion, Qwen2.5-Omni) vs our served DiT",
    add_arguments=add_arguments, run=run,
    quick=["--requests", "16", "--rounds", "1", "--timeout", "240"],
    ratios=ratios, table=table, plots=draw)

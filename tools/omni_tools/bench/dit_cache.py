"""Benchmark: omni_dit step cache (FirstBlockCache) speed and quality, in-process.

Same requests (prompts, seeds, size, steps) with the cache off and on at
several thresholds, one DitRunner (the stage's own runner), measured in one
run. Reports the speedup (off time / on time) and PSNR / SSIM of the cached
images against the uncached ones, plus where the uncached time goes (text
encoder, transformer, VAE decode), which bounds what step caching can save. The
`dit-cache` scenario of omni-bench (its child process).

    omni-bench dit-cache -- --repeats 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from omni_tools.bench.scenario import results_file, write_results


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Global SSIM on luminance (single window; enough to rank thresholds)."""
    def lum(x):
        return x.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    x, y = lum(a), lum(b)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = x.mean(), y.mean()
    vx, vy, cov = x.var(), y.var(), ((x - mx) * (y - my)).mean()
    return float(((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))


def timed(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def component_split(runner, reqs) -> dict[str, float]:
    """Seconds spent in text encoder, transformer and VAE during one uncached run."""
    pipe = runner.pipe
    spent = {"text_encoder": 0.0, "transformer": 0.0, "vae": 0.0}
    handles = []
    for name, mod in (("text_encoder", pipe.text_encoder), ("transformer", pipe.transformer),
                      ("vae", pipe.vae)):
        start = {}
        handles.append(mod.register_forward_pre_hook(
            lambda m, a, n=name: start.__setitem__(n, time.perf_counter())))
        handles.append(mod.register_forward_hook(
            lambda m, a, o, n=name: spent.__setitem__(n, spent[n] + time.perf_counter() - start[n])))
    # the VAE decode is a method call, not forward(): wrap it
    decode = pipe.vae.decode

    def timed_decode(*a, **kw):
        t0 = time.perf_counter()
        try:
            return decode(*a, **kw)
        finally:
            spent["vae"] += time.perf_counter() - t0

    pipe.vae.decode = timed_decode
    t0 = time.perf_counter()
    runner.run(reqs)
    total = time.perf_counter() - t0
    pipe.vae.decode = decode
    for h in handles:
        h.remove()
    spent["other"] = total - sum(spent.values())
    spent["total"] = total
    return spent


def main(argv=None) -> int:
    from omni_serve.dit.config import DitStageConfig
    from omni_serve.dit.request import DitRequest
    from omni_serve.dit.runner import DitRunner
    from omni_tools.tiny_models import ensure_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny:qwen-image-tiny")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--thresholds", nargs="+", type=float, default=[0.05, 0.1, 0.2, 0.4, 1.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=results_file("dit-cache"))
    args = ap.parse_args(argv)

    path = (str(ensure_model(args.model[5:])) if args.model.startswith("tiny:") else args.model)
    torch.manual_seed(0)
    reqs = lambda cache: [DitRequest(f"image {i}: a lighthouse at dusk, {i} gulls", None,  # noqa: E731
                                     args.size, args.size, args.steps, 4.0, i, cache)
                          for i in range(args.batch)]
    base = DitRunner(DitStageConfig(model=path))
    base.run(reqs(False))  # warm-up
    t_off, off = timed(lambda: base.run(reqs(False)), args.repeats)
    split = component_split(base, reqs(False))
    rows = []
    for thr in args.thresholds:
        runner = DitRunner(DitStageConfig(model=path, cache_threshold=thr))
        runner.run(reqs(True))
        t_on, on = timed(lambda r=runner: r.run(reqs(True)), args.repeats)
        rows.append({"threshold": thr, "speedup": t_off / t_on,
                     "psnr_db": min(psnr(a, b) for a, b in zip(off, on)),
                     "ssim": min(ssim(a, b) for a, b in zip(off, on))})
        print(f"threshold {thr:4.2f}: speedup {t_off / t_on:5.2f}x  "
              f"PSNR(min) {rows[-1]['psnr_db']:6.1f} dB  SSIM(min) {rows[-1]['ssim']:.4f}")
    print("uncached time split (s):", {k: round(v, 4) for k, v in split.items()})
    write_results(args.out, {"command": " ".join(["python", *sys.argv]), "uncached_s": t_off,
                              "split_s": split, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

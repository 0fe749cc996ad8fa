"""Benchmark: the audio stage's codec decoder, per chunk: the speaker-encoder memo and torch threads.

Runs as omni-bench's child process (`omni-bench decoder -- ...`), in-process on CPU: the
omni_audio runner (omni_serve.audio.runner.AudioRunner, as the stage loads it) on a
Qwen2.5-Omni checkpoint (default: the tiny one). Each cell decodes one chunk of
`--codes` random codes (no context, the default voice, transformers' sampler); the sides
differ in one thing each, measured in alternating order within each round:

- `memo`: the DiT's speaker encoder runs once per decode (LastCallMemo, the default) or
  once per DiT evaluation (transformers' forward: 36 times with its sampler);
- `threads`: torch threads of the process (the stage's `torch_threads`, 1 by default).

With and without the memo the samples are the same (checked: bitwise; the run fails
otherwise); with 2 threads they may differ by float rounding (the largest difference is
reported). Reports ms per decode (median of the rounds' medians) and each side's ratio
to the default.

    omni-bench decoder -- --codes 24 48 64 --rounds 5
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from omni_tools.bench.scenario import results_file, write_results

SIDES = ("default", "no memo", "2 threads")


@contextlib.contextmanager
def _side(decoder: Any, name: str) -> Iterator[None]:
    import torch

    embed = decoder.dit.input_embed
    memo, threads = embed.spk_encoder, torch.get_num_threads()
    memo.forget()  # its output may have been made with another thread count
    if name == "no memo":
        embed.spk_encoder = memo.inner
    elif name == "2 threads":
        torch.set_num_threads(2)
    try:
        yield
    finally:
        embed.spk_encoder = memo
        torch.set_num_threads(threads)


def measure(folder: str, codes: list[int], rounds: int, per_cell: int) -> dict[str, Any]:
    from omni_serve.audio.config import AudioStageConfig
    from omni_serve.audio.request import AudioRequest
    from omni_serve.audio.runner import AudioRunner

    runner = AudioRunner(AudioStageConfig(model=folder))
    decoder = runner.decoder
    rng = np.random.default_rng(0)
    rows = []
    for n in codes:
        req = AudioRequest(codes=rng.integers(0, decoder.codec_vocab, (n, 1)).astype(np.int64),
                           context=0, voice=decoder.default_voice, seed=0)
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        outputs: dict[str, np.ndarray] = {}
        for rnd in range(rounds + 1):  # round 0 warms up
            order = SIDES if rnd % 2 else tuple(reversed(SIDES))
            for side in order:
                with _side(decoder, side):
                    ts = []
                    for _ in range(per_cell):
                        start = time.perf_counter()
                        (wave,) = runner.run([req])
                        ts.append(time.perf_counter() - start)
                outputs[side] = wave
                if rnd:
                    times[side].append(statistics.median(ts))
        ms = {s: statistics.median(v) * 1e3 for s, v in times.items()}
        per_round = {s: [t * 1e3 for t in v] for s, v in times.items()}
        rows.append({"codes": n, "ms": ms, "per_round_ms": per_round,
                     "ratio_to_default": {s: ms[s] / ms["default"] for s in SIDES},
                     "same_samples": outputs["no memo"].tobytes() == outputs["default"].tobytes(),
                     "threads_max_diff": float(np.abs(outputs["2 threads"] - outputs["default"]).max())})
    return {"checkpoint": folder, "rounds": rounds, "per_cell": per_cell, "rows": rows}


def table(results: dict[str, Any]) -> str:
    lines = ["| codes per chunk | default ms | no memo ms | 2 threads ms | no memo / default | "
             "2 threads / default | memo: same samples |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in results["rows"]:
        ms, q = r["ms"], r["ratio_to_default"]
        lines.append(f"| {r['codes']} | {ms['default']:.0f} | {ms['no memo']:.0f} | {ms['2 threads']:.0f} | "
                     f"**{q['no memo']:.2f}** | **{q['2 threads']:.2f}** | {r['same_samples']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", help="a Qwen2.5-Omni checkpoint (default: the tiny one)")
    ap.add_argument("--codes", type=int, nargs="+", default=[16, 48, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-cell", type=int, default=3, help="decodes per side per round")
    ap.add_argument("--out", type=Path, default=results_file("decoder"))
    args = ap.parse_args(argv)
    if args.folder is None:
        from omni_tools.tiny_models import ensure_model

        args.folder = str(ensure_model("qwen2.5-omni-tiny"))
    results = measure(args.folder, args.codes, args.rounds, args.per_cell)
    write_results(args.out, results)
    print(table(results))
    return 0 if all(r["same_samples"] for r in results["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What a video costs Qwen3-Omni's thinker: sampled frames, video tokens, encode time.

    python -m omni_tools.bench.video_cost [--folder CHECKPOINT] [--seconds 4 30]

Runs in its own process on CPU. For each clip length it writes a synthetic clip (H.264, 30
fps, 640x360, PyAV), then times what the thinker stage does with it: decoding the frames the
family's processor samples (omni_serve.encoder.video.decode_video), the checkpoint's
processor (resize and patches), and the vision tower's forward (transformers' thinker
`visual`, fp32; on the tiny checkpoint by default, so that time is the tower's shape, not a
real model's). Each time is the median of 3 runs. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

FPS, SIZE = 30, (640, 360)


def synthetic_clip(seconds: float) -> bytes:
    """An MP4 (H.264) of moving bars, `seconds` long at FPS, SIZE (width, height)."""
    import av

    width, height = SIZE
    frames = int(seconds * FPS)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        out = av.open(str(path), "w", format="mp4")
        stream = out.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        for i in range(frames):
            img = np.zeros((height, width, 3), np.uint8)
            img[..., 0] = i * 255 // max(1, frames - 1)
            img[:, (i * 5) % width:(i * 5) % width + 16, 1] = 255
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())
        out.close()
        return path.read_bytes()


def _median_s(fn, runs: int = 3) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(folder: str, seconds: list[float]) -> list[dict]:
    import torch
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    from omni_serve.encoder.config import MediaLimits
    from omni_serve.encoder.video import decode_video
    from omni_serve.families.qwen3_omni_moe.video import VIDEO_SAMPLING

    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    for s in seconds:
        data = synthetic_clip(s)
        decode_s, clip = _median_s(lambda: decode_video(data, MediaLimits(), VIDEO_SAMPLING,
                                                        soundtrack=False))
        process_s, inputs = _median_s(lambda: processor(
            text=processor.video_token, videos=[clip.frames], return_tensors="pt"))
        grid = inputs["video_grid_thw"]
        with torch.no_grad():
            tower_s, _ = _median_s(lambda: model.thinker.visual(
                inputs["pixel_values_videos"], grid_thw=grid))
        merge = VIDEO_SAMPLING.merge
        rows.append({"seconds": s, "bytes": len(data), "frames": len(clip.frames),
                     "grid": tuple(int(v) for v in grid[0]),
                     "tokens": int(grid.prod(-1).sum()) // merge // merge,
                     "decode_ms": decode_s * 1e3, "process_ms": process_s * 1e3,
                     "tower_ms": tower_s * 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="a Qwen3-Omni checkpoint (default: the tiny one)")
    parser.add_argument("--seconds", type=float, nargs="+", default=[4.0, 30.0])
    args = parser.parse_args(argv)
    if args.folder is None:
        from omni_tools.tiny_models import ensure_model

        args.folder = str(ensure_model("qwen3-omni-tiny"))
    print(f"| clip ({SIZE[0]}x{SIZE[1]}, {FPS} fps) | frames sampled | grid (t, h, w) | "
          "thinker video tokens | decode (PyAV) | processor | vision tower |")
    print("|---|---|---|---|---|---|---|")
    for r in measure(args.folder, args.seconds):
        print(f"| {r['seconds']:g} s, {r['bytes'] / 1024:.0f} KiB | {r['frames']} | "
              f"{r['grid']} | {r['tokens']} | {r['decode_ms']:.0f} ms | "
              f"{r['process_ms']:.0f} ms | {r['tower_ms']:.0f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

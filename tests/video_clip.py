"""Short synthetic video clips for the video tests (made in the test process with PyAV).

Each frame differs from the last (a red ramp, a moving green bar and blue line), encoded as
H.264 in MP4; no sound.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np


def frame_image(i: int, n: int, width: int, height: int) -> np.ndarray:
    """Frame i of n, uint8 RGB [height, width, 3]."""
    img = np.zeros((height, width, 3), np.uint8)
    img[..., 0] = i * 255 // max(1, n - 1)
    img[:, (i * 3) % width: (i * 3) % width + 4, 1] = 255
    img[(i * 2) % height, :, 2] = 200
    img[: height // 2, : width // 2, 2] = 80 + (i * 7) % 150
    return img


def clip(*, fps: int = 10, frames: int = 25, size: tuple[int, int] = (64, 64),
         faststart: bool = False) -> bytes:
    """An MP4 (H.264, yuv420p) of `frames` frames at `fps`, `size` = (width, height); with
    `faststart` its index (moov) comes before the frames."""
    import av

    width, height = size
    folder = tempfile.TemporaryDirectory()  # faststart rewrites the file: no in-memory one
    path = Path(folder.name) / "clip.mp4"
    options = {"movflags": "faststart"} if faststart else {}
    out = av.open(str(path), "w", format="mp4", options=options)
    stream = out.add_stream("libx264", rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.options = {"preset": "ultrafast", "crf": "18"}
    for i in range(frames):
        picture = av.VideoFrame.from_ndarray(frame_image(i, frames, width, height), format="rgb24")
        out.mux(stream.encode(picture))
    out.mux(stream.encode())
    out.close()
    with folder:
        return path.read_bytes()


def clip_frames(processor, data: bytes, *, fps: float) -> np.ndarray:
    """transformers' own frames of the video file `data`: its pyav loading, sampled by the
    checkpoint processor's video processor at `fps` (torchcodec, transformers' default
    reader, is not installed here)."""
    import functools

    from transformers.video_utils import load_video

    sample = functools.partial(processor.video_processor.sample_frames, fps=fps)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "clip.mp4").write_bytes(data)
        frames, _ = load_video(str(Path(tmp) / "clip.mp4"), backend="pyav",
                               sample_indices_fn=sample)
    return np.asarray(frames)

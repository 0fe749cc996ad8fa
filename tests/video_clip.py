"""Short synthetic video clips for the video tests (made in the test process with PyAV).

Each frame differs from the last (a red ramp, a moving green bar and blue line), encoded as
H.264 in MP4 (MOV with PCM sound); no sound unless asked for: a tone or a chirp, AAC or PCM.
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


def sound_wave(kind: str, seconds: float, rate: int) -> np.ndarray:
    """float32 mono samples: "tone" (440 Hz) or "chirp" (200 Hz rising to 2 kHz), at half scale."""
    t = np.arange(int(round(seconds * rate))) / rate
    if kind == "tone":
        phase = 2 * np.pi * 440.0 * t
    elif kind == "chirp":
        phase = 2 * np.pi * (200.0 * t + (2000.0 - 200.0) / (2 * seconds) * t * t)
    else:
        raise ValueError(f"sound is 'tone' or 'chirp', got {kind!r}")
    return (0.5 * np.sin(phase)).astype(np.float32)


def clip(*, fps: int = 10, frames: int = 25, size: tuple[int, int] = (64, 64),
         faststart: bool = False, sound: str | None = None, sound_codec: str = "aac",
         sound_rate: int = 16000) -> bytes:
    """An MP4 (H.264, yuv420p) of `frames` frames at `fps`, `size` = (width, height); with
    `faststart` its index (moov) comes before the frames. `sound` ("tone" or "chirp") adds a
    mono soundtrack as long as the video at `sound_rate`, encoded with `sound_codec` ("aac",
    or "pcm_s16le" in a MOV file)."""
    import av

    width, height = size
    folder = tempfile.TemporaryDirectory()  # faststart rewrites the file: no in-memory one
    container = "mov" if sound and sound_codec.startswith("pcm") else "mp4"
    path = Path(folder.name) / f"clip.{container}"
    options = {"movflags": "faststart"} if faststart else {}
    out = av.open(str(path), "w", format=container, options=options)
    stream = out.add_stream("libx264", rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.options = {"preset": "ultrafast", "crf": "18"}
    audio = None
    if sound:
        audio = out.add_stream(sound_codec, rate=sound_rate, layout="mono")
    for i in range(frames):
        picture = av.VideoFrame.from_ndarray(frame_image(i, frames, width, height), format="rgb24")
        out.mux(stream.encode(picture))
    out.mux(stream.encode())
    if audio is not None:
        wave = sound_wave(sound, frames / fps, sound_rate)
        samples = (wave * 32767).astype(np.int16) if sound_codec.startswith("pcm") else wave
        fmt = "s16" if sound_codec.startswith("pcm") else "fltp"
        for start in range(0, len(samples), 1024):
            part = av.AudioFrame.from_ndarray(samples[None, start:start + 1024], format=fmt,
                                              layout="mono")
            part.sample_rate = sound_rate
            out.mux(audio.encode(part))
        out.mux(audio.encode())
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


def clip_soundtrack(data: bytes, *, rate: int = 16000) -> np.ndarray:
    """The video file's sound as transformers' callers pass it (`audio=`): every audio frame
    PyAV decodes, resampled by FFmpeg to float32 mono at `rate`."""
    import io

    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    parts = []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(parts).astype(np.float32)

"""Video bytes -> sampled frames and soundtrack (runs in the stage that decodes a request's
video, inside its Triton stub, and in tests).

Flow: one request's `video` bytes (a container file: MP4, MOV, MKV, WebM, AVI, ...) -> a
`Clip`: the frames the family's reference processor takes of it (`VideoSampling`, one per
family), as uint8 [T, H, W, 3] RGB decoded by FFmpeg through PyAV exactly as transformers'
pyav backend (`transformers.video_utils.read_video_pyav`) decodes them; their frame numbers
and timestamps; the stream's frame rate and frame count; and the soundtrack as float32 mono at
the audio tower's rate (None without an audio stream) for audio-in-video. The processor then
resizes and patches the frames as it does for transformers' own loading of the file.

Every bad input raises `RequestError("video", ...)` naming what is allowed, so the adapter
answers that request alone with INVALID_ARG. Cheap checks come first: size, then the container
header (streams, codec, frame size, frame count, duration), and only then frames are decoded,
no further than the last sampled one.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_serve.encoder.config import MediaLimits
from omni_serve.encoder.media import MAX_ASPECT_RATIO
from omni_serve.errors import RequestError

FIELD = "video"
VIDEO_FORMATS = "MP4, MOV, MKV, WebM or AVI with H.264, HEVC, VP8, VP9, AV1 or MPEG-4 video"


# --- sampling: what a family's processor takes of a clip ---------------------------------


@dataclass(frozen=True)
class VideoSampling:
    """How a family's reference processor samples and sizes a clip's frames (plain values,
    any process).

    Mirrors transformers' `Qwen2VLVideoProcessor` (both Qwen-Omni families use it) called with
    `fps=fps, do_sample_frames=True`: `fps` is the rate the family's processor assumes when
    the caller passes none (its video positions advance `temporal_patch / fps` seconds a
    grid), `min_frames` / `max_frames` bound the sampled count, and each frame is resized by
    `smart_resize` to a multiple of `patch * merge` with `min_pixels` to `max_pixels` pixels.
    """

    fps: float
    patch: int
    min_pixels: int
    max_pixels: int
    merge: int = 2
    temporal_patch: int = 2
    min_frames: int = 4
    max_frames: int = 768

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one merged patch)."""
        return self.patch * self.merge

    @property
    def seconds_per_grid(self) -> float:
        """Seconds one temporal grid step stands for (the processor's `video_second_per_grid`)."""
        return self.temporal_patch / self.fps

    def sampled_count(self, total: int, video_fps: float) -> int:
        """How many frames the processor asks for of a stream of `total` frames at `video_fps`
        (0 when the stream has fewer than `temporal_patch` frames)."""
        tp = self.temporal_patch
        most = math.floor(min(self.max_frames, total) / tp) * tp
        wanted = min(max(total / video_fps * self.fps, self.min_frames), most, total)
        return math.floor(wanted / tp) * tp

    def frame_indices(self, total: int, video_fps: float) -> np.ndarray:
        """Frame numbers (int64, ascending) the processor samples of a stream of `total` frames.

        transformers takes `torch.arange(0, total, total / n).int()`: float32 values of
        `i * step`, truncated. Where `total / step` rounds above n the range has one more
        value, always `total` itself: no frame, which its decoder never reaches, so it is
        dropped here.
        """
        n = self.sampled_count(total, video_fps)
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        step = total / n
        values = np.arange(math.ceil(total / step), dtype=np.float64) * step
        indices = values.astype(np.float32).astype(np.int64)
        return indices[indices < total]

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the processor resizes a height x width frame to (smart_resize)."""
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / f) * f
            w = math.ceil(width * beta / f) * f
        return h, w

    def grid_thw(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The processor's `video_grid_thw` of `frames` sampled frames of height x width."""
        h, w = self.resized(height, width)
        return -(-frames // self.temporal_patch), h // self.patch, w // self.patch


# --- the decoded clip --------------------------------------------------------------------


@dataclass(frozen=True)
class Clip:
    """One decoded, sampled clip."""

    frames: np.ndarray  # uint8 [T, H, W, 3] RGB, the sampled frames in stream order
    indices: np.ndarray  # int64 [T]: their frame numbers in decoding order
    fps: float  # the video stream's average frame rate (its header's)
    total_frames: int  # frames in the video stream
    audio: np.ndarray | None  # float32 mono soundtrack at `sample_rate`; None: no sound
    sample_rate: int

    @property
    def timestamps(self) -> np.ndarray:
        """Seconds of each sampled frame, `index / fps` (transformers' VideoMetadata.timestamps)."""
        return self.indices / self.fps

    @property
    def duration(self) -> float:
        """Seconds of video, `total_frames / fps` (transformers' VideoMetadata.duration)."""
        return self.total_frames / self.fps

    def video_metadata(self) -> dict[str, Any]:
        """transformers' VideoMetadata fields of the sampled frames, for a processor called on
        `frames` with `do_sample_frames=False`."""
        return {"total_num_frames": self.total_frames, "fps": self.fps,
                "width": int(self.frames.shape[2]), "height": int(self.frames.shape[1]),
                "duration": self.duration, "video_backend": "pyav",
                "frames_indices": [int(i) for i in self.indices]}


# --- checks on the bytes and the header --------------------------------------------------


def _check_size(data: Any, limits: MediaLimits) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RequestError(FIELD, f"expected the bytes of a video file, got {type(data).__name__}")
    if len(data) == 0:
        raise RequestError(FIELD, f"empty video: send the bytes of a video file ({VIDEO_FORMATS})")
    if len(data) > limits.max_video_bytes:
        raise RequestError(FIELD, f"video is {len(data)} bytes; at most {limits.max_video_bytes} "
                                  f"bytes are accepted (max_video_bytes)")


def _open(data: bytes) -> Any:
    import av

    try:
        return av.open(io.BytesIO(bytes(data)), mode="r")
    except av.error.EOFError as e:
        raise RequestError(FIELD, f"the file ends before its first video frame (truncated or "
                                  f"empty); send a complete video file ({VIDEO_FORMATS})") from e
    except av.error.InvalidDataError as e:
        raise RequestError(FIELD, f"not a decodable video file (or one cut short); send a "
                                  f"complete video file ({VIDEO_FORMATS})") from e
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise RequestError(FIELD, f"corrupt or truncated video file ({type(e).__name__}: {e}); "
                                  f"send a complete video file ({VIDEO_FORMATS})") from e


def _video_stream(container: Any) -> Any:
    if not container.streams.video:
        if container.streams.audio:
            raise RequestError(FIELD, "the file holds only audio (no video stream, 0 video "
                                      "frames); send sound as audio, or a video file with at "
                                      "least one video stream")
        raise RequestError(FIELD, f"the file holds no video stream (0 video frames); send a "
                                  f"video file ({VIDEO_FORMATS})")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        raise RequestError(FIELD, f"the video stream's codec is unknown to this server's decoder "
                                  f"(FFmpeg through PyAV); send {VIDEO_FORMATS}")
    return stream


def _check_frame_size(width: int, height: int, limits: MediaLimits) -> None:
    if width <= 0 or height <= 0:
        raise RequestError(FIELD, f"the video header gives no frame size ({width}x{height}); "
                                  f"send a complete video file")
    if width * height > limits.max_video_pixels:
        raise RequestError(FIELD, f"video frames are {width}x{height} = {width * height} pixels; "
                                  f"the limit is {limits.max_video_pixels} pixels a frame "
                                  f"(max_video_pixels)")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise RequestError(FIELD, f"video frames are {width}x{height}; the long side may be at "
                                  f"most {MAX_ASPECT_RATIO}x the short side")


def _frame_rate(stream: Any) -> float:
    """The stream's average frame rate, as transformers' pyav backend reads it."""
    rate = stream.average_rate or stream.guessed_rate
    if not rate or float(rate) <= 0:
        raise RequestError(FIELD, "the video header gives no frame rate; send a video file "
                                  "whose stream has a frame rate")
    return float(rate)


def _header_seconds(container: Any) -> float:
    """The container's duration in seconds (its longest stream); 0 when the header has none."""
    return container.duration / 1_000_000 if container.duration else 0.0


def _check_seconds(seconds: float, limits: MediaLimits) -> None:
    if seconds > limits.max_video_seconds:
        raise RequestError(FIELD, f"video is {seconds:.2f} s long; at most "
                                  f"{limits.max_video_seconds:g} s are accepted (max_video_seconds)")


def _check_frame_count(frames: int, limits: MediaLimits) -> None:
    if frames > limits.max_video_frames:
        raise RequestError(FIELD, f"the video stream has {frames} frames; at most "
                                  f"{limits.max_video_frames} frames are accepted (max_video_frames)")


def _count_packets(container: Any, stream: Any, limits: MediaLimits) -> int:
    """Frames of a stream whose header has no count (Matroska, WebM): its packets, demuxed
    without decoding (as torchcodec's exact scan counts them), never past the limit."""
    import av

    count = 0
    try:
        for packet in container.demux(stream):
            if packet.size:
                count += 1
                _check_frame_count(count, limits)
        container.seek(0)
    except av.error.FFmpegError as e:
        raise _corrupt(e) from e
    return count


def _corrupt(e: Exception) -> RequestError:
    return RequestError(FIELD, f"corrupt or truncated video file ({type(e).__name__}: {e}); "
                               f"send a complete video file ({VIDEO_FORMATS})")


# --- decoding ------------------------------------------------------------------------------


class _Soundtrack:
    """The audio stream's samples, resampled by FFmpeg (swresample) to float32 mono."""

    def __init__(self, rate: int, limits: MediaLimits):
        import av

        self.resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        self.most = int(math.ceil(limits.max_video_seconds * rate)) + rate  # a second's slack
        self.limits = limits
        self.rate = rate
        self.parts: list[np.ndarray] = []
        self.samples = 0

    def add(self, frame: Any) -> None:
        for out in self.resampler.resample(frame):
            part = out.to_ndarray().reshape(-1)
            self.parts.append(part)
            self.samples += part.shape[0]
        if self.samples > self.most:
            raise RequestError(FIELD, f"the soundtrack is over {self.samples / self.rate:.2f} s "
                                      f"long; at most {self.limits.max_video_seconds:g} s are "
                                      f"accepted (max_video_seconds)")

    def samples_array(self) -> np.ndarray | None:
        self.add(None)  # flush the resampler
        if not self.samples:
            return None
        audio = np.concatenate(self.parts).astype(np.float32, copy=False)
        if not np.isfinite(audio).all():
            raise RequestError(FIELD, "the soundtrack has NaN or infinite samples")
        return audio


def _soundtrack(container: Any, limits: MediaLimits) -> _Soundtrack | None:
    if not container.streams.audio:
        return None
    if container.streams.audio[0].codec_context is None:
        raise RequestError(FIELD, "the soundtrack's codec is unknown to this server's decoder "
                                  "(FFmpeg through PyAV); send AAC, MP3, Opus, Vorbis, FLAC or "
                                  "PCM sound, or the video without its sound")
    return _Soundtrack(limits.sample_rate, limits)


def _decode(container: Any, stream: Any, indices: np.ndarray, total: int,
            sound: _Soundtrack | None) -> np.ndarray:
    """The frames at `indices` (decoding order, as transformers enumerates them), converted
    as it converts them (`to_ndarray(format="rgb24")`); the soundtrack into `sound` on the way."""
    import av

    wanted = {int(i): k for k, i in enumerate(indices)}
    last = int(indices[-1])
    frames: np.ndarray | None = None
    audio = container.streams.audio[0] if sound is not None else None
    streams = [stream] if audio is None else [stream, audio]
    decoded = 0  # video frames out of the decoder so far
    try:
        for packet in container.demux(streams):
            if packet.stream is audio:
                for frame in packet.decode():
                    sound.add(frame)
                continue
            if decoded > last:
                if audio is None:
                    break
                continue
            for frame in packet.decode():
                k = wanted.get(decoded)
                decoded += 1
                if k is None:
                    continue
                rgb = frame.to_ndarray(format="rgb24")
                if frames is None:
                    frames = np.empty((len(indices), *rgb.shape), dtype=np.uint8)
                elif rgb.shape != frames.shape[1:]:
                    raise RequestError(FIELD, f"the frame size changes within the stream "
                                              f"({frames.shape[2]}x{frames.shape[1]} to "
                                              f"{rgb.shape[1]}x{rgb.shape[0]}); send a video "
                                              f"of one frame size")
                frames[k] = rgb
    except av.error.FFmpegError as e:
        raise RequestError(FIELD, f"truncated or corrupt video: decoding failed after {decoded} "
                                  f"of its {total} frames ({type(e).__name__}: {e}); send the "
                                  f"complete file") from e
    if decoded <= last:
        raise RequestError(FIELD, f"truncated or corrupt video: its header announces {total} "
                                  f"frames, {decoded} could be decoded; send the complete file")
    return frames


@dataclass(frozen=True)
class ClipHeader:
    """What a clip's header says, checked, before any frame is decoded."""

    width: int
    height: int
    fps: float  # the video stream's average frame rate
    total_frames: int
    indices: np.ndarray  # int64: the frame numbers the family's processor samples
    has_audio: bool = False  # the file has an audio stream (a soundtrack)

    def grid_thw(self, sampling: VideoSampling) -> tuple[int, int, int]:
        """The processor's `video_grid_thw` of the sampled frames."""
        return sampling.grid_thw(len(self.indices), self.height, self.width)


def _header(container: Any, limits: MediaLimits, sampling: VideoSampling) -> tuple[Any, ClipHeader]:
    """The video stream and its checked header (RequestError("video", ...) naming the limit)."""
    stream = _video_stream(container)
    ctx = stream.codec_context
    _check_frame_size(ctx.width, ctx.height, limits)
    video_fps = _frame_rate(stream)
    _check_seconds(_header_seconds(container), limits)
    total = int(stream.frames or 0)
    _check_frame_count(total, limits)
    if total <= 0:
        total = _count_packets(container, stream, limits)
    _check_seconds(total / video_fps, limits)
    if total < sampling.temporal_patch:
        raise RequestError(FIELD, f"the video stream has {total} frames; at least "
                                  f"{sampling.temporal_patch} are needed")
    return stream, ClipHeader(width=int(ctx.width), height=int(ctx.height), fps=video_fps,
                              total_frames=total,
                              indices=sampling.frame_indices(total, video_fps),
                              has_audio=bool(container.streams.audio))


def probe_video(data: bytes, limits: MediaLimits, sampling: VideoSampling) -> ClipHeader:
    """The checks of `decode_video` that need no decoded frame (size, container, streams,
    codecs, frame size, frame count, duration): RequestError("video", ...) as it raises them.
    A file cut short inside its frames passes here and is refused when decoded."""
    _check_size(data, limits)
    container = _open(data)
    try:
        return _header(container, limits, sampling)[1]
    finally:
        container.close()


def decode_video(data: bytes, limits: MediaLimits, sampling: VideoSampling, *,
                 soundtrack: bool = True) -> Clip:
    """The clip in `data`, its frames sampled as `sampling` says, and its soundtrack.

    The header's frame size, frame count and duration are checked against `limits` before
    any frame is decoded, and decoding stops at the last sampled frame (the soundtrack, when
    `soundtrack` and the file has one, is read to its end). Raises RequestError("video", ...)
    for empty or oversized input, bytes that are no video file, a file with no video stream
    or only audio, an unknown codec, no frame rate, too few frames, frames, frame count or
    duration beyond the limits, and a corrupt or truncated file.
    """
    _check_size(data, limits)
    container = _open(data)
    try:
        stream, header = _header(container, limits, sampling)
        sound = _soundtrack(container, limits) if soundtrack else None
        frames = _decode(container, stream, header.indices, header.total_frames, sound)
        audio = sound.samples_array() if sound is not None else None
    finally:
        container.close()
    return Clip(frames=frames, indices=header.indices, fps=header.fps,
                total_frames=header.total_frames, audio=audio, sample_rate=limits.sample_rate)


def decode_soundtrack(data: bytes, limits: MediaLimits) -> np.ndarray:
    """The soundtrack of the video file `data` alone (no frame decoded): float32 mono at
    `limits.sample_rate`, the samples `decode_video` gives as `Clip.audio`. Raises
    RequestError("video", ...) as `probe_video` does, and for a file without sound."""
    import av

    _check_size(data, limits)
    container = _open(data)
    try:
        sound = _soundtrack(container, limits)
        if sound is None:
            raise RequestError(FIELD, "the file has no audio stream (no soundtrack to hear)")
        try:
            for packet in container.demux(container.streams.audio[0]):
                for frame in packet.decode():
                    sound.add(frame)
        except av.error.FFmpegError as e:
            raise _corrupt(e) from e
        audio = sound.samples_array()
    finally:
        container.close()
    if audio is None:
        raise RequestError(FIELD, "the soundtrack holds no samples")
    return audio

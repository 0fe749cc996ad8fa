"""Video decoding (omni_serve.encoder.video) against transformers' own loading of the same file.

Runs in the pytest process (CPU, no server). Clips are made here with PyAV: moving coloured
frames (each frame different), a few seconds at 10, 25 or 30 fps, with no sound, an AAC tone
or a PCM tone. The goldens are transformers' on the same file, read by its pyav backend
(torchcodec, its default, is not installed here):
- for each family's VideoSampling, decode_video picks the frames `load_video` picks with the
  family's video processor's `sample_frames` at the family's fps, with the same pixels,
  indices and timestamps;
- the family's processor (Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor) gives the same
  `pixel_values_videos`, `video_grid_thw`, `video_second_per_grid` and prompt from our frames
  as from the file itself (`fps`, `do_sample_frames=True`, as apply_chat_template passes
  them); VideoSampling.grid_thw says the same grid;
- the soundtrack is the tone, resampled to 16 kHz mono, within the measured tolerance.
Every bad clip gets RequestError("video", ...) naming the limit or what is accepted.
"""

from __future__ import annotations

import functools
import io
import re
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from transformers import AutoProcessor
from transformers import video_processing_utils as hf_video_processing
from transformers.video_utils import VideoMetadata, load_video

from omni_serve import families
from omni_serve.encoder import video as video_mod
from omni_serve.encoder.config import MediaLimits
from omni_serve.encoder.video import decode_video
from omni_serve.errors import RequestError
from omni_tools import tiny_omni, tiny_qwen3_omni
from tests.video_clip import frame_image

torch.set_num_threads(1)

FAMILIES = ("qwen2_5_omni", "qwen3_omni_moe")
LIMITS = MediaLimits()
TONE_HZ, TONE_AMPLITUDE = 440.0, 0.5
# Measured (decode_video of these clips at 16 kHz, 50 ms in from each end, tone amplitude 0.5):
# AAC 128 kb/s at 44.1 kHz differs from the tone by at most 0.0156 (RMS 0.0005); 16-bit PCM
# at 48 kHz by at most 3e-5 (16-bit rounding and resampling). About twice that is allowed.
TONE_TOLERANCE = {"aac": 0.03, "pcm_s16le": 1e-4}


# --- clips ---------------------------------------------------------------------------------


def write_clip(path: Path, *, fps: int, frames: int, size: tuple[int, int] = (96, 64),
               audio: str | None = None, rate: int = 44100, fmt: str | None = None,
               options: dict[str, str] | None = None) -> bytes:
    """An H.264 clip of `frames` frames at `fps`, with a tone soundtrack in `audio`'s codec."""
    width, height = size
    out = av.open(str(path), "w", format=fmt, options=options or {})
    stream = out.add_stream("libx264", rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.options = {"preset": "ultrafast", "crf": "18"}
    sound = None
    if audio is not None:
        sound = out.add_stream(audio, rate=rate)
        sound.layout = "mono"
        if audio == "aac":
            sound.bit_rate = 128_000
    for i in range(frames):
        picture = av.VideoFrame.from_ndarray(frame_image(i, frames, width, height), format="rgb24")
        out.mux(stream.encode(picture))
    out.mux(stream.encode())
    if sound is not None:
        _write_tone(out, sound, rate, frames / fps)
    out.close()
    return path.read_bytes()


def _write_tone(out, sound, rate: int, seconds: float) -> None:
    tone = TONE_AMPLITUDE * np.sin(2 * np.pi * TONE_HZ * np.arange(int(rate * seconds)) / rate)
    fmt = sound.codec_context.format.name
    step = sound.codec_context.frame_size or 1024
    for start in range(0, len(tone), step):
        chunk = tone[start:start + step]
        samples = (chunk * 32767).astype(np.int16) if fmt.startswith("s16") else chunk.astype(np.float32)
        frame = av.AudioFrame.from_ndarray(samples[None], format=fmt, layout="mono")
        frame.sample_rate, frame.pts = rate, start
        out.mux(sound.encode(frame))
    out.mux(sound.encode())


# name: (fps, frames, size, audio codec, audio rate, container)
CLIPS = {
    # 25 fps, 3 s, an AAC tone
    "25fps-aac": (25, 75, (96, 64), "aac", 44100, None),
    # 10 fps, 75 frames: at 2 fps torch.arange(0, 75, 75 / 14) has 15 values, the last 75
    "10fps-overshoot": (10, 75, (64, 48), None, 44100, None),
    # 30 fps, 2 s, a 48 kHz PCM tone in QuickTime
    "30fps-pcm": (30, 60, (112, 70), "pcm_s16le", 48000, "mov"),
}


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("clips")
    paths = {}
    for name, (fps, frames, size, audio, rate, fmt) in CLIPS.items():
        paths[name] = folder / f"{name}.{fmt or 'mp4'}"
        write_clip(paths[name], fps=fps, frames=frames, size=size, audio=audio, rate=rate, fmt=fmt)
    return paths


@pytest.fixture(scope="module")
def processors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Each family's processor as its tiny checkpoint ships it (tokenizer + processor files)."""
    folder = tmp_path_factory.mktemp("processors")
    q25, q3 = folder / "qwen2_5_omni", folder / "qwen3_omni_moe"
    q25.mkdir()
    q3.mkdir()
    tiny_omni.build_omni_tokenizer().save_pretrained(q25)
    tiny_omni.save_preprocessor_config(q25)
    tiny_qwen3_omni.save_processor_files(q3, tiny_qwen3_omni.build_qwen3_omni_tokenizer())
    return {"qwen2_5_omni": AutoProcessor.from_pretrained(q25),
            "qwen3_omni_moe": AutoProcessor.from_pretrained(q3)}


@pytest.fixture
def transformers_reads_files_with_pyav(monkeypatch: pytest.MonkeyPatch) -> None:
    """The video processor's own file loading (`fetch_videos`), on its pyav backend: it asks
    for torchcodec, which is not installed here (its wheels are CUDA builds)."""
    load = hf_video_processing.load_video
    monkeypatch.setattr(hf_video_processing, "is_torchcodec_available", lambda: True)
    monkeypatch.setattr(hf_video_processing, "load_video",
                        lambda video, backend=None, **kw: load(video, backend="pyav", **kw))


# --- sampling ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sampled_frame_numbers_are_the_video_processors(family, processors):
    sampling = families.get(family).video
    video_processor = processors[family].video_processor
    assert (video_processor.patch_size, video_processor.merge_size,
            video_processor.temporal_patch_size) == (sampling.patch, sampling.merge,
                                                     sampling.temporal_patch)
    for video_fps in (8.0, 10.0, 12.5, 23.976, 25.0, 29.97, 60.0):
        for total in range(2, 400, 3):
            theirs = video_processor.sample_frames(
                VideoMetadata(total_num_frames=total, fps=video_fps), fps=sampling.fps).numpy()
            ours = sampling.frame_indices(total, video_fps)
            # where torch.arange overshoots, its one extra value is `total`: no frame
            np.testing.assert_array_equal(ours, theirs[:len(ours)])
            assert (theirs[len(ours):] == total).all() and len(theirs) - len(ours) <= 1


@pytest.mark.parametrize("family", FAMILIES)
def test_the_resized_grid_is_the_processors(family, processors):
    """Below the minimum, between the bounds, above the maximum, a long thin frame."""
    sampling = families.get(family).video
    processor = processors[family]
    for height, width in ((48, 64), (320, 448), (360, 640), (640, 1024), (1080, 1920), (30, 2000)):
        frames = np.zeros((3, height, width, 3), np.uint8)
        grid = processor(text=processor.video_token, videos=[frames], do_sample_frames=False,
                         return_tensors="np")["video_grid_thw"]
        assert [list(sampling.grid_thw(3, height, width))] == grid.tolist(), (height, width)


# --- frames and the processor's outputs against transformers' loading ---------------------


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("family", FAMILIES)
def test_frames_and_timestamps_equal_transformers_pyav_loading(family, clip, clips, processors):
    sampling = families.get(family).video
    ours = decode_video(clips[clip].read_bytes(), LIMITS, sampling)
    sample = functools.partial(processors[family].video_processor.sample_frames, fps=sampling.fps)
    frames, metadata = load_video(str(clips[clip]), backend="pyav", sample_indices_fn=sample)

    assert ours.frames.dtype == np.uint8 and ours.frames.shape == frames.shape
    np.testing.assert_array_equal(ours.frames, frames)
    n = len(frames)
    np.testing.assert_array_equal(ours.indices, np.asarray(metadata.frames_indices)[:n])
    # transformers divides int32 tensor indices by the rate: float32 seconds
    np.testing.assert_array_equal(ours.timestamps.astype(np.float32),
                                  np.asarray(metadata.timestamps, dtype=np.float32)[:n])
    assert (ours.fps, ours.total_frames) == (metadata.fps, metadata.total_num_frames)
    assert ours.duration == pytest.approx(metadata.duration)
    fps, count = CLIPS[clip][:2]
    assert n == max(4, min(count, int(count / fps * sampling.fps) // 2 * 2))
    if clip == "10fps-overshoot" and family == "qwen2_5_omni":
        assert len(metadata.frames_indices) == n + 1 == 15  # transformers' index 75: no frame


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_processor_gives_the_same_inputs_from_our_frames_as_from_the_file(
        family, clip, clips, processors, transformers_reads_files_with_pyav):
    sampling = families.get(family).video
    processor = processors[family]
    prompt = f"Describe {processor.video_token} please"
    from_file = processor(text=prompt, videos=[str(clips[clip])], fps=sampling.fps,
                          do_sample_frames=True, return_tensors="pt")
    ours = decode_video(clips[clip].read_bytes(), LIMITS, sampling)
    from_ours = processor(text=prompt, videos=[ours.frames], video_metadata=[ours.video_metadata()],
                          fps=sampling.fps, do_sample_frames=False, return_tensors="pt")

    assert torch.equal(from_ours["pixel_values_videos"], from_file["pixel_values_videos"])
    assert from_ours["video_grid_thw"].tolist() == from_file["video_grid_thw"].tolist()
    assert (list(from_ours["video_second_per_grid"]) == list(from_file["video_second_per_grid"])
            == [sampling.seconds_per_grid])
    assert torch.equal(from_ours["input_ids"], from_file["input_ids"])
    # the family's fps is the one its processor's positions assume when the caller passes none
    unpaced = processor(text=prompt, videos=[ours.frames], do_sample_frames=False, return_tensors="pt")
    assert list(unpaced["video_second_per_grid"]) == [sampling.seconds_per_grid]
    height, width = ours.frames.shape[1:3]
    assert [list(sampling.grid_thw(len(ours.frames), height, width))] == \
        from_file["video_grid_thw"].tolist()


def test_a_matroska_clip_without_a_frame_count_gives_the_mp4_clips_frames(tmp_path):
    """Matroska headers hold no frame count (transformers' pyav backend then samples nothing);
    its packets are counted, so the same stream gives the frames it gives in MP4."""
    mkv = write_clip(tmp_path / "c.mkv", fps=25, frames=75, fmt="matroska")
    mp4 = write_clip(tmp_path / "c.mp4", fps=25, frames=75)
    assert av.open(io.BytesIO(mkv)).streams.video[0].frames == 0
    for family in FAMILIES:
        sampling = families.get(family).video
        a, b = decode_video(mkv, LIMITS, sampling), decode_video(mp4, LIMITS, sampling)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.frames, b.frames)
        assert (a.total_frames, a.fps) == (b.total_frames, b.fps) == (75, 25.0)


# --- the soundtrack ------------------------------------------------------------------------


@pytest.mark.parametrize("clip", ["25fps-aac", "30fps-pcm"])
def test_the_soundtrack_is_the_tone_at_16_khz(clip, clips):
    fps, frames, _, codec, rate, _ = CLIPS[clip]
    got = decode_video(clips[clip].read_bytes(), LIMITS, families.get("qwen2_5_omni").video)
    assert got.sample_rate == 16000 and got.audio.dtype == np.float32 and got.audio.ndim == 1
    seconds = frames / fps
    # AAC leaves at most one frame (1024 samples at the source rate) of padding at the end
    assert 0 <= len(got.audio) - seconds * 16000 <= 1024 * 16000 / rate + 1
    tone = TONE_AMPLITUDE * np.sin(2 * np.pi * TONE_HZ * np.arange(len(got.audio)) / 16000)
    inner = slice(800, int(seconds * 16000) - 800)  # 50 ms in from each end
    error = np.abs(got.audio[inner] - tone[inner])
    assert error.max() <= TONE_TOLERANCE[codec], f"{codec}: max error {error.max():.5f}"


def test_no_soundtrack_without_an_audio_stream_or_when_not_asked(clips):
    sampling = families.get("qwen3_omni_moe").video
    assert decode_video(clips["10fps-overshoot"].read_bytes(), LIMITS, sampling).audio is None
    silent = decode_video(clips["25fps-aac"].read_bytes(), LIMITS, sampling, soundtrack=False)
    assert silent.audio is None and len(silent.frames) == 4


# --- bad clips -----------------------------------------------------------------------------


def _audio_only(tmp_path: Path) -> bytes:
    out = av.open(str(tmp_path / "a.m4a"), "w", format="mp4")
    sound = out.add_stream("aac", rate=16000)
    sound.layout = "mono"
    _write_tone(out, sound, 16000, 1.0)
    out.close()
    return (tmp_path / "a.m4a").read_bytes()


def _no_frames(tmp_path: Path) -> bytes:
    out = av.open(str(tmp_path / "empty.mp4"), "w")
    stream = out.add_stream("libx264", rate=10)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    out.start_encoding()
    out.close()
    return (tmp_path / "empty.mp4").read_bytes()


def _unknown_codec(tmp_path: Path) -> bytes:
    data = write_clip(tmp_path / "c.mp4", fps=10, frames=20)
    at = data.index(b"avc1", data.index(b"stsd"))  # the sample entry's codec tag
    return data[:at] + b"zzzz" + data[at + 4:]


def _truncated_index_at_end(tmp_path: Path) -> bytes:
    data = write_clip(tmp_path / "c.mp4", fps=10, frames=20)
    return data[: len(data) // 2]  # MP4's index (moov) is written last: cut off


def _truncated_index_first(tmp_path: Path) -> bytes:
    data = write_clip(tmp_path / "c.mp4", fps=25, frames=75, options={"movflags": "faststart"})
    assert data.index(b"moov") < data.index(b"mdat")
    return data[: len(data) * 6 // 10]  # the index announces 75 frames, 60% of the bytes left


BAD_CLIPS = {
    # name: (clip maker, limits, what the message must say)
    "not bytes": (lambda p: "video.mp4", {}, r"expected the bytes of a video file, got str"),
    "empty": (lambda p: b"", {}, r"empty video"),
    "garbage": (lambda p: np.random.default_rng(0).bytes(5000), {},
                r"not a decodable video file .*MP4, MOV, MKV, WebM or AVI"),
    "text": (lambda p: b"hello, this is no video " * 40, {}, r"not a decodable video file"),
    "truncated, index at the end": (_truncated_index_at_end, {}, r"cut short"),
    "truncated, index first": (_truncated_index_first, {},
                               r"truncated or corrupt video: .*\b75 frames"),
    "truncated, end of the index cut": (
        lambda p: write_clip(p / "c.mp4", fps=10, frames=20)[:-100], {},
        r"truncated or corrupt video: its header announces 20 frames, \d+ could be decoded"),
    "zero video frames": (_no_frames, {}, r"no video stream \(0 video frames\)"),
    "audio only": (_audio_only, {}, r"only audio \(no video stream, 0 video frames\)"),
    "unknown codec": (_unknown_codec, {}, r"codec is unknown .*H\.264"),
    "one frame": (lambda p: write_clip(p / "c.mp4", fps=10, frames=1), {},
                  r"has 1 frames; at least 2 are needed"),
    "over max bytes": (lambda p: write_clip(p / "c.mp4", fps=10, frames=20),
                       {"max_video_bytes": 1000}, r"\d+ bytes; at most 1000 bytes"),
    "over max seconds": (lambda p: write_clip(p / "c.mp4", fps=25, frames=75),
                         {"max_video_seconds": 2.5}, r"3\.00 s long; at most 2\.5 s"),
    "over max frames": (lambda p: write_clip(p / "c.mp4", fps=25, frames=75),
                        {"max_video_frames": 50}, r"75 frames; at most 50 frames"),
    "over max frames, no count": (lambda p: write_clip(p / "c.mkv", fps=25, frames=75, fmt="matroska"),
                                  {"max_video_frames": 50}, r"51 frames; at most 50 frames"),
    "over max pixels": (lambda p: write_clip(p / "c.mp4", fps=10, frames=20),
                        {"max_video_pixels": 96 * 64 - 1}, r"96x64 = 6144 pixels; the limit is 6143"),
}


@pytest.mark.parametrize("name", BAD_CLIPS)
def test_a_bad_clip_is_refused_naming_video_and_the_limit(name, tmp_path, monkeypatch):
    make, limits, message = BAD_CLIPS[name]
    data = make(tmp_path)
    if limits:
        # the limits hold before any frame is decoded
        monkeypatch.setattr(video_mod, "_decode", lambda *a, **k: pytest.fail("decoded frames"))
    for family in FAMILIES:
        with pytest.raises(RequestError) as caught:
            decode_video(data, MediaLimits(**limits), families.get(family).video)
        assert caught.value.field == "video"
        assert re.search(message, caught.value.message), caught.value.message
        assert str(caught.value).startswith("video: ")

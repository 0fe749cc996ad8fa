"""The omni_encoder stage on the tiny Qwen2.5-Omni checkpoints (CPU, no server).

Goldens are transformers' own Qwen2.5-Omni code on the same media:
- images: the runner's rows must be `get_image_features` of the HF thinker
  (and of the full model's `.thinker`) on the pixels the checkpoint's own
  Qwen2_5OmniProcessor makes (torchvision Qwen2VLImageProcessor), one row per
  <|IMAGE|> token the processor puts in the prompt;
- audio: the runner's `features` must be the processor's `input_features`
  (cut at its feature_attention_mask) and `tokens` the number of <|AUDIO|>
  tokens it puts in the prompt; the thinker's audio tower, which runs in the
  thinker engine, gives the same rows on them as on the processor's inputs.
Batched equals alone, every bad item fails alone with a RequestError naming
`media`, and the Triton adapter answers images with `embeddings` +
`grid_thw` and audio with `features`. That the thinker engine generates the
HF thinker's tokens from these outputs is an integration golden test.
"""

from __future__ import annotations

import importlib.util
import io
import json
import struct
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image
from pydantic import ValidationError
from scipy.signal import resample_poly
from transformers import (
    AutoImageProcessor,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerForConditionalGeneration,
)

from omni_serve.encoder.config import EncoderStageConfig
from omni_serve.encoder.runner import EncoderOutput, EncoderRunner
from omni_serve.errors import RequestError
from omni_serve.families.qwen2_5_omni.media_tokens import Qwen25OmniMediaTokens
from omni_tools import tiny_omni as to

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
MEL_BINS = 128


# --- media makers -------------------------------------------------------------------------


def make_image(width: int, height: int, fmt: str = "PNG", mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def make_audio(seconds: float, rate: int = 16000, channels: int = 1, seed: int = 0,
               subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t)
    samples = np.stack([tone * (c + 1) / channels + 0.05 * rng.standard_normal(len(t))
                        for c in range(channels)], axis=1).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height and that has no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinker(tiny_thinker: Path) -> Qwen2_5OmniThinkerForConditionalGeneration:
    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tiny_thinker).eval()


@pytest.fixture(scope="module")
def processor(tiny_thinker: Path) -> Qwen2_5OmniProcessor:
    return Qwen2_5OmniProcessor.from_pretrained(tiny_thinker)


def _runner(model_dir: Path, modality: str, **limits) -> EncoderRunner:
    return EncoderRunner(EncoderStageConfig(model=str(model_dir), modality=modality, **limits))


@pytest.fixture(scope="module")
def image_runner(tiny_thinker: Path) -> EncoderRunner:
    return _runner(tiny_thinker, "image")


@pytest.fixture(scope="module")
def audio_runner(tiny_thinker: Path) -> EncoderRunner:
    return _runner(tiny_thinker, "audio")


# --- references: transformers' Qwen2.5-Omni processor and thinker ------------------------------

IMAGE_PROMPT = f"{to.VISION_BOS_TOKEN}{to.IMAGE_TOKEN}{to.VISION_EOS_TOKEN}describe it."
AUDIO_PROMPT = f"{to.AUDIO_BOS_TOKEN}{to.AUDIO_TOKEN}{to.AUDIO_EOS_TOKEN}what is it?"


def reference_image(thinker, processor, data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows, grid_thw, <|IMAGE|> tokens in the prompt), as Qwen2_5OmniProcessor + get_image_features."""
    batch = processor(text=IMAGE_PROMPT, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    with torch.no_grad():
        rows = thinker.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    tokens = int((batch["input_ids"] == thinker.config.image_token_id).sum())
    return torch.cat(rows).numpy(), batch["image_grid_thw"][0].numpy(), tokens


def reference_wave(data: bytes) -> np.ndarray:
    """16 kHz mono float32 samples of an audio file."""
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    wave = samples.mean(axis=1)
    if rate != 16000:
        g = np.gcd(rate, 16000)
        wave = resample_poly(wave, 16000 // g, rate // g).astype(np.float32)
    return wave


def reference_audio(processor, data: bytes) -> dict[str, torch.Tensor]:
    """Qwen2_5OmniProcessor's inputs for one clip (features zero-padded to 300 s)."""
    return processor(text=AUDIO_PROMPT, audio=[reference_wave(data)], return_tensors="pt")


def thinker_audio_rows(thinker, features: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return thinker.get_audio_features(features, mask).last_hidden_state.numpy()


# --- config -----------------------------------------------------------------------------------


def test_config_rejects_unknown_keys_and_bad_limits() -> None:
    with pytest.raises(ValidationError, match="extra"):
        EncoderStageConfig(model="m", modality="image", max_side=3)
    with pytest.raises(ValidationError, match="min_image_side"):
        EncoderStageConfig(model="m", modality="image", min_image_side=100, max_image_side=50)
    with pytest.raises(ValidationError, match="modality"):
        EncoderStageConfig(model="m", modality="video")


def test_runner_rejects_audio_limit_beyond_the_feature_extractor(tiny_thinker: Path) -> None:
    with pytest.raises(ValueError, match="max_audio_seconds"):
        _runner(tiny_thinker, "audio", max_audio_seconds=301)


def test_runner_uses_the_checkpoints_torchvision_image_processor(image_runner, processor) -> None:
    own = image_runner.encoder.processor
    assert type(own) is type(processor.image_processor)
    assert type(own).__name__ == "Qwen2VLImageProcessor"
    assert own.to_dict() == processor.image_processor.to_dict()


# --- image rows == the thinker's image features ------------------------------------------------------

IMAGES = {
    "png-100x80": lambda: make_image(100, 80, "PNG"),
    "jpeg-64x48": lambda: make_image(64, 48, "JPEG", seed=1),
    "png-rgba-30x200": lambda: make_image(30, 200, "PNG", mode="RGBA", seed=2),
    "jpeg-gray-300x300": lambda: make_image(300, 300, "JPEG", mode="L", seed=3),
    "png-300x200": lambda: make_image(300, 200, "PNG", seed=4),  # over max_pixels: resized down
}


@pytest.mark.parametrize("name", list(IMAGES))
def test_image_rows_equal_the_thinker_image_features(image_runner, thinker, processor, name) -> None:
    data = IMAGES[name]()
    [out] = image_runner.run([data])
    want, grid, tokens = reference_image(thinker, processor, data)
    assert isinstance(out, EncoderOutput) and out.features is None
    assert out.embeddings.dtype == np.float32 and out.embeddings.shape == want.shape
    assert out.embeddings.shape[1] == to.TINY_TEXT_HIDDEN
    np.testing.assert_allclose(out.embeddings, want, atol=1e-5, rtol=0)
    assert out.grid_thw.dtype == np.int64 and out.grid_thw.tolist() == grid.tolist()
    assert out.tokens == tokens == out.embeddings.shape[0] == int(np.prod(grid)) // 4  # 2x2 merge


def test_resized_image_keeps_its_aspect_within_the_pixel_budget(image_runner) -> None:
    """300x200 is 60000 pixels, over the tiny max_pixels: smart_resize shrinks it to multiples of 28."""
    [out] = image_runner.run([IMAGES["png-300x200"]()])
    t, h, w = out.grid_thw.tolist()
    assert t == 1 and (h * 14) * (w * 14) <= to.TINY_MAX_PIXELS
    assert (h * 14, w * 14) != (200, 300) and h % 2 == w % 2 == 0
    assert w > h  # landscape stays landscape


def test_image_token_counts(tiny_thinker: Path) -> None:
    """100x80 -> 112x84 (multiples of 28) -> 4x3 merged tokens; 64x48 -> 56x56 -> 2x2."""
    processor = AutoImageProcessor.from_pretrained(tiny_thinker)
    assert processor.get_number_of_image_patches(80, 100) // 4 == 12
    assert processor.get_number_of_image_patches(48, 64) // 4 == 4
    assert processor.get_number_of_image_patches(2000, 2000) // 4 <= 32


# --- audio features == the processor's; tokens == the thinker's -------------------------------------

AUDIOS = {
    "wav-16k-mono-1s": lambda: make_audio(1.0),
    "wav-44k1-stereo-1.5s": lambda: make_audio(1.5, rate=44100, channels=2, seed=1),
    "flac-16k-mono-0.5s": lambda: make_audio(0.5, seed=2, fmt="FLAC"),
}


@pytest.mark.parametrize("name", list(AUDIOS))
def test_audio_features_equal_the_processor_features(audio_runner, thinker, processor, name) -> None:
    data = AUDIOS[name]()
    [out] = audio_runner.run([data])
    ref = reference_audio(processor, data)
    frames = int(ref["feature_attention_mask"].sum())
    want = ref["input_features"][0, :, :frames].numpy()
    assert isinstance(out, EncoderOutput) and out.embeddings is None and out.grid_thw is None
    assert out.features.dtype == np.float32 and out.features.shape == want.shape == (MEL_BINS, frames)
    assert out.features.flags.c_contiguous
    np.testing.assert_allclose(out.features, want, atol=1e-5, rtol=0)
    _, thinker_tokens = thinker.audio_tower._get_feat_extract_output_lengths(torch.tensor(frames))
    prompt_tokens = int((ref["input_ids"] == thinker.config.audio_token_id).sum())
    assert out.tokens == prompt_tokens == int(thinker_tokens)


@pytest.mark.parametrize("name", list(AUDIOS)[:2])
def test_audio_tower_gives_the_same_rows_on_the_features(audio_runner, thinker, processor, name) -> None:
    """What the thinker engine computes: its audio tower on the runner's features (unpadded) gives
    the rows HF's thinker gets from the processor's 300 s padded inputs, one per prompt token."""
    data = AUDIOS[name]()
    [out] = audio_runner.run([data])
    ref = reference_audio(processor, data)
    want = thinker_audio_rows(thinker, ref["input_features"], ref["feature_attention_mask"])
    features = torch.from_numpy(out.features)[None]
    got = thinker_audio_rows(thinker, features, torch.ones(1, features.shape[-1], dtype=torch.long))
    assert got.shape == want.shape == (out.tokens, to.TINY_TEXT_HIDDEN)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_one_second_of_audio_gives_25_tokens(audio_runner) -> None:
    [out] = audio_runner.run([make_audio(1.0)])
    assert out.features.shape == (MEL_BINS, 100)  # 100 frames/s
    assert out.tokens == 25


def test_audio_tokens_is_the_thinkers_output_length(thinker) -> None:
    frames = torch.arange(3, 3001)
    _, want = thinker.audio_tower._get_feat_extract_output_lengths(frames)
    count = Qwen25OmniMediaTokens().audio_tokens
    assert [count(int(n)) for n in frames] == want.tolist()


# --- batched == alone ---------------------------------------------------------------------------


def test_batched_image_rows_equal_rows_alone(image_runner) -> None:
    items = [make() for make in list(IMAGES.values())[:3]]
    batched = image_runner.run(items)
    for item, out in zip(items, batched, strict=True):
        [alone] = image_runner.run([item])
        np.testing.assert_allclose(out.embeddings, alone.embeddings, atol=1e-5, rtol=0)
        assert out.grid_thw.tolist() == alone.grid_thw.tolist() and out.tokens == alone.tokens
    assert len({out.embeddings.shape[0] for out in batched}) == 3  # different lengths in one forward


def test_batched_audio_features_equal_features_alone(audio_runner) -> None:
    items = [make() for make in AUDIOS.values()]
    batched = audio_runner.run(items)
    for item, out in zip(items, batched, strict=True):
        [alone] = audio_runner.run([item])
        np.testing.assert_array_equal(out.features, alone.features)
        assert out.tokens == alone.tokens
    assert len({out.features.shape[1] for out in batched}) == 3


# --- a full Qwen2.5-Omni checkpoint ------------------------------------------------------------


def test_runner_reads_a_full_omni_checkpoint(tiny_omni_checkpoint: Path) -> None:
    full = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni_checkpoint).eval()
    processor = Qwen2_5OmniProcessor.from_pretrained(tiny_omni_checkpoint)
    runner = _runner(tiny_omni_checkpoint, "image")
    for data in (IMAGES["png-100x80"](), IMAGES["png-300x200"]()):
        [out] = runner.run([data])
        want, grid, tokens = reference_image(full.thinker, processor, data)
        assert out.embeddings.shape == want.shape and out.tokens == tokens
        np.testing.assert_allclose(out.embeddings, want, atol=1e-5, rtol=0)
        assert out.grid_thw.tolist() == grid.tolist()
    data = AUDIOS["wav-16k-mono-1s"]()
    [out] = _runner(tiny_omni_checkpoint, "audio").run([data])
    ref = reference_audio(processor, data)
    frames = int(ref["feature_attention_mask"].sum())
    np.testing.assert_allclose(out.features, ref["input_features"][0, :, :frames].numpy(),
                               atol=1e-5, rtol=0)
    assert out.tokens == int((ref["input_ids"] == full.config.thinker_config.audio_token_id).sum())


# --- bad media --------------------------------------------------------------------------------

BAD_IMAGES = {
    "empty": (b"", "empty media"),
    "wav": (make_audio(0.2), "not a decodable image"),
    "random bytes": (np.random.default_rng(0).bytes(2000), "not a decodable image"),
    "truncated png": (make_image(100, 80)[:600], "truncated"),
    "truncated jpeg": (make_image(100, 80, "JPEG")[:400], "truncated"),
    "side over the limit": (make_image(600, 20), "between 1 and 512"),
    "pixel bomb header": (png_header_only(500, 500), "the limit is 200000 pixels"),
    "aspect ratio": (make_image(402, 2), "200x the short side"),
    "too many bytes": (b"\x89PNG" + bytes(300_000), "at most 200000 bytes"),
}


@pytest.fixture(scope="module")
def strict_image_runner(tiny_thinker: Path) -> EncoderRunner:
    return _runner(tiny_thinker, "image", max_image_side=512, max_image_pixels=200_000,
                   max_media_bytes=200_000)


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_bad_image_fails_alone_with_a_media_error(strict_image_runner, name) -> None:
    data, message = BAD_IMAGES[name]
    good = make_image(100, 80)
    first, bad, last = strict_image_runner.run([good, data, good])
    assert isinstance(bad, RequestError), bad
    assert bad.field == "media" and message in bad.message, bad.message
    [alone] = strict_image_runner.run([good])
    for out in (first, last):
        np.testing.assert_allclose(out.embeddings, alone.embeddings, atol=1e-5, rtol=0)


def _nan_wav() -> bytes:
    samples = np.zeros(1600, np.float32)
    samples[10] = np.nan
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _wav_claiming_hours() -> bytes:
    riff = bytearray(make_audio(0.1))
    size = 16000 * 2 * 3600 * 5  # the header says 5 hours of 16 kHz PCM_16
    riff[4:8], riff[40:44] = (size + 36).to_bytes(4, "little"), size.to_bytes(4, "little")
    return bytes(riff)


BAD_AUDIOS = {
    "empty": (b"", "empty media"),
    "png": (make_image(32, 32), "not a decodable audio file"),
    "random bytes": (np.random.default_rng(1).bytes(2000), "not a decodable audio file"),
    "wav without data": (make_audio(0.2)[:30], "not a decodable audio file"),
    "zero length": (make_audio(0.0), "zero length"),
    "too short for one token": (make_audio(0.01), "send at least 20 ms"),
    "too long": (make_audio(2.5), "at most 2 s"),
    "nan samples": (_nan_wav(), "NaN"),
    "cut-off wav": (make_audio(0.5)[:3000], "truncated audio file: its header announces 16000"),
    "header claiming hours": (_wav_claiming_hours(), "announces 576000000 bytes of samples "
                                                     "(18000.00 s), the file holds 3200"),
    "too many bytes": (make_audio(1.9, rate=48000, channels=2), "at most 300000 bytes"),
}


@pytest.fixture(scope="module")
def strict_audio_runner(tiny_thinker: Path) -> EncoderRunner:
    return _runner(tiny_thinker, "audio", max_audio_seconds=2, max_media_bytes=300_000)


@pytest.mark.parametrize("name", list(BAD_AUDIOS))
def test_bad_audio_fails_alone_with_a_media_error(strict_audio_runner, name) -> None:
    data, message = BAD_AUDIOS[name]
    good = make_audio(0.5)
    first, bad, last = strict_audio_runner.run([good, data, good])
    assert isinstance(bad, RequestError), bad
    assert bad.field == "media" and message in bad.message, bad.message
    [alone] = strict_audio_runner.run([good])
    for out in (first, last):
        np.testing.assert_array_equal(out.features, alone.features)
        assert out.tokens == alone.tokens


# --- the Triton adapter, with a stand-in for triton_python_backend_utils -----------------------------


class _Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = {t.name: t.array for t in output_tensors or ()}
        self.error = error


class _Error:
    INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = ("INVALID_ARG", "UNAVAILABLE", "INTERNAL",
                                                     "CANCELLED")

    def __init__(self, message: str, code: str):
        self.message, self.code = message, code


class _Metric:
    def __init__(self, **kwargs):
        self.values: list[float] = []

    def increment(self, value: float) -> None:
        self.values.append(value)

    observe = increment


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

    def __init__(self, name: str, description: str, kind: str):
        self.name = name

    def Metric(self, **kwargs) -> _Metric:  # pb_utils spelling
        return _Metric(**kwargs)


class _Request:
    def __init__(self, media: bytes | None, wanted: tuple[str, ...] = (), cancelled: bool = False):
        self.inputs = {} if media is None else {"media": np.array([[media]], dtype=np.object_)}
        self.wanted = wanted
        self.cancelled = cancelled

    def is_cancelled(self) -> bool:
        return self.cancelled

    def requested_output_names(self) -> list[str]:
        return list(self.wanted)


@pytest.fixture()
def make_adapter(monkeypatch, tiny_thinker: Path, tmp_path: Path):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.Tensor, fake.InferenceResponse, fake.TritonError, fake.MetricFamily = (
        _Tensor, _Response, _Error, _Family)
    fake.get_input_tensor_by_name = lambda request, name: (
        _Tensor(name, request.inputs[name]) if name in request.inputs else None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    spec = importlib.util.spec_from_file_location("omni_encoder_model",
                                                  ROOT / "backends" / "omni_encoder" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def make(modality: str):
        repo = tmp_path / modality
        repo.mkdir()
        (repo / "engine.json").write_text(json.dumps({"model": str(tiny_thinker), "modality": modality}))
        model = module.TritonPythonModel()
        model.initialize({"model_name": f"{modality}_encoder", "model_repository": str(repo)})
        return model

    return make


def test_adapter_answers_each_image_with_its_rows_or_its_error(make_adapter, image_runner) -> None:
    adapter = make_adapter("image")
    good = make_image(100, 80)
    responses = adapter.execute([_Request(good), _Request(b"nope"), _Request(None),
                                 _Request(make_image(64, 48, "JPEG", seed=1), wanted=("embeddings",))])
    [want] = image_runner.run([good])
    first, bad, missing, only_rows = responses
    assert first.error is None and set(first.tensors) == {"embeddings", "grid_thw"}
    assert first.tensors["embeddings"].shape == (1, *want.embeddings.shape)
    np.testing.assert_allclose(first.tensors["embeddings"][0], want.embeddings, atol=1e-5, rtol=0)
    assert first.tensors["grid_thw"].tolist() == [want.grid_thw.tolist()]
    assert bad.error.code == _Error.INVALID_ARG and bad.error.message.startswith("media:")
    assert missing.error.code == _Error.INVALID_ARG
    assert set(only_rows.tensors) == {"embeddings"}
    assert adapter._items.values == [1, 1] and adapter._execute._batch.values == [4]
    assert adapter._tokens.values == [want.tokens, 4]


def test_adapter_answers_each_audio_clip_with_its_features(make_adapter, audio_runner) -> None:
    adapter = make_adapter("audio")
    clips = [make_audio(1.0), make_audio(0.5, seed=2, fmt="FLAC")]
    responses = adapter.execute([_Request(clips[0]), _Request(make_image(32, 32)), _Request(clips[1])])
    first, bad, last = responses
    assert bad.error.code == _Error.INVALID_ARG and bad.error.message.startswith("media:")
    for response, clip in ((first, clips[0]), (last, clips[1])):
        [want] = audio_runner.run([clip])
        assert response.error is None and set(response.tensors) == {"features"}
        got = response.tensors["features"]
        assert got.dtype == np.float32 and got.shape == (1, MEL_BINS, want.features.shape[1])
        np.testing.assert_array_equal(got[0], want.features)
    assert adapter._tokens.values == [25, 12]  # 100 and 50 frames
    assert adapter._items.values == [1, 1] and adapter._execute._batch.values == [3]


def test_adapter_computes_nothing_for_a_request_cancelled_in_the_queue(make_adapter) -> None:
    adapter = make_adapter("audio")
    clip = make_audio(1.0)
    first, cancelled = adapter.execute([_Request(clip), _Request(make_audio(2.0), cancelled=True)])
    assert first.error is None and set(first.tensors) == {"features"}
    assert cancelled.error.code == _Error.CANCELLED and "cancelled" in cancelled.error.message
    assert adapter._tokens.values == [25]  # only the first clip was encoded

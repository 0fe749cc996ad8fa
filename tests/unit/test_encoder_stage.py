"""The omni_encoder stage on the tiny Qwen2.5-Omni thinker (CPU, no server).

The encoder's rows must be the HF thinker's own image/audio features for the
same media, alone or batched; every bad item must fail alone with a
RequestError naming `media`; and the rows, scattered into the placeholder
positions of a prompt, must drive the exported Qwen2ForCausalLM the way the
thinker itself is driven (audio: same greedy tokens; image: same input
embeddings, positions differ, see test_image_prompt_embeds_...).
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
    AutoTokenizer,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2ForCausalLM,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omni_serve.encoder.config import EncoderStageConfig
from omni_serve.encoder.runner import EncoderOutput, EncoderRunner
from omni_serve.errors import RequestError
from omni_tools import tiny_omni as to

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 8


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
def thinker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("omni") / "thinker"
    to.build_omni_thinker(out)
    return out


@pytest.fixture(scope="module")
def thinker(thinker_dir: Path) -> Qwen2_5OmniThinkerForConditionalGeneration:
    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(thinker_dir).eval()


@pytest.fixture(scope="module")
def lm(thinker_dir: Path) -> Qwen2ForCausalLM:
    out = thinker_dir.parent / "lm"
    to.export_thinker_lm(thinker_dir, out)
    return Qwen2ForCausalLM.from_pretrained(out).eval()


def _runner(thinker_dir: Path, modality: str, **limits) -> EncoderRunner:
    return EncoderRunner(EncoderStageConfig(model=str(thinker_dir), modality=modality, **limits))


@pytest.fixture(scope="module")
def image_runner(thinker_dir: Path) -> EncoderRunner:
    return _runner(thinker_dir, "image")


@pytest.fixture(scope="module")
def audio_runner(thinker_dir: Path) -> EncoderRunner:
    return _runner(thinker_dir, "audio")


# --- references: the HF thinker's own feature functions ------------------------------------------


def reference_image(thinker, thinker_dir: Path, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    processor = Qwen2VLImageProcessorPil.from_pretrained(thinker_dir)
    batch = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    with torch.no_grad():
        rows = thinker.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    return torch.cat(rows).numpy(), batch["image_grid_thw"][0].numpy()


def reference_audio_inputs(thinker_dir: Path, data: bytes) -> dict[str, torch.Tensor]:
    """Features as Qwen2_5OmniProcessor makes them (zero-padded to 300 s), from a 16 kHz mono wave."""
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    wave = samples.mean(axis=1)
    if rate != 16000:
        g = np.gcd(rate, 16000)
        wave = resample_poly(wave, 16000 // g, rate // g).astype(np.float32)
    fe = WhisperFeatureExtractor.from_pretrained(thinker_dir)
    batch = fe(wave, sampling_rate=16000, padding="max_length", return_attention_mask=True,
               return_tensors="pt")
    return {"input_features": batch["input_features"], "feature_attention_mask": batch["attention_mask"]}


def reference_audio(thinker, thinker_dir: Path, data: bytes) -> np.ndarray:
    inputs = reference_audio_inputs(thinker_dir, data)
    with torch.no_grad():
        return thinker.get_audio_features(inputs["input_features"],
                                          inputs["feature_attention_mask"]).last_hidden_state.numpy()


# --- config -----------------------------------------------------------------------------------


def test_config_rejects_unknown_keys_and_bad_limits() -> None:
    with pytest.raises(ValidationError, match="extra"):
        EncoderStageConfig(model="m", modality="image", max_side=3)
    with pytest.raises(ValidationError, match="min_image_side"):
        EncoderStageConfig(model="m", modality="image", min_image_side=100, max_image_side=50)
    with pytest.raises(ValidationError, match="modality"):
        EncoderStageConfig(model="m", modality="video")


def test_runner_rejects_audio_limit_beyond_the_feature_extractor(thinker_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_audio_seconds"):
        _runner(thinker_dir, "audio", max_audio_seconds=301)


# --- embeddings == the thinker's features ----------------------------------------------------------

IMAGES = {
    "png-100x80": lambda: make_image(100, 80, "PNG"),
    "jpeg-64x48": lambda: make_image(64, 48, "JPEG", seed=1),
    "png-rgba-30x200": lambda: make_image(30, 200, "PNG", mode="RGBA", seed=2),
    "jpeg-gray-300x300": lambda: make_image(300, 300, "JPEG", mode="L", seed=3),
}


@pytest.mark.parametrize("name", list(IMAGES))
def test_image_rows_equal_the_thinker_image_features(image_runner, thinker, thinker_dir, name) -> None:
    data = IMAGES[name]()
    [out] = image_runner.run([data])
    want, grid = reference_image(thinker, thinker_dir, data)
    assert isinstance(out, EncoderOutput)
    assert out.embeddings.dtype == np.float32 and out.embeddings.shape == want.shape
    assert out.embeddings.shape[1] == to.TINY_TEXT_HIDDEN
    np.testing.assert_allclose(out.embeddings, want, atol=1e-5, rtol=0)
    assert out.grid_thw.dtype == np.int64 and out.grid_thw.tolist() == grid.tolist()
    assert out.embeddings.shape[0] == int(np.prod(grid)) // 4  # 2x2 patches merge into one token


def test_image_token_counts() -> None:
    """100x80 -> 112x84 (multiples of 28) -> 4x3 merged tokens; 64x48 -> 56x56 -> 2x2."""
    processor = Qwen2VLImageProcessorPil(min_pixels=to.TINY_MIN_PIXELS, max_pixels=to.TINY_MAX_PIXELS)
    assert processor.get_number_of_image_patches(80, 100) // 4 == 12
    assert processor.get_number_of_image_patches(48, 64) // 4 == 4
    assert processor.get_number_of_image_patches(2000, 2000) // 4 <= 32


AUDIOS = {
    "wav-16k-mono-1s": lambda: make_audio(1.0),
    "wav-44k1-stereo-1.5s": lambda: make_audio(1.5, rate=44100, channels=2, seed=1),
    "flac-16k-mono-0.5s": lambda: make_audio(0.5, seed=2, fmt="FLAC"),
}


@pytest.mark.parametrize("name", list(AUDIOS))
def test_audio_rows_equal_the_thinker_audio_features(audio_runner, thinker, thinker_dir, name) -> None:
    data = AUDIOS[name]()
    [out] = audio_runner.run([data])
    want = reference_audio(thinker, thinker_dir, data)
    assert isinstance(out, EncoderOutput) and out.grid_thw is None
    assert out.embeddings.dtype == np.float32 and out.embeddings.shape == want.shape
    np.testing.assert_allclose(out.embeddings, want, atol=1e-5, rtol=0)


def test_one_second_of_audio_gives_25_tokens(audio_runner) -> None:
    [out] = audio_runner.run([make_audio(1.0)])
    assert out.embeddings.shape == (25, to.TINY_TEXT_HIDDEN)


# --- batched == alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("modality", ["image", "audio"])
def test_batched_rows_equal_rows_alone(image_runner, audio_runner, modality) -> None:
    runner = image_runner if modality == "image" else audio_runner
    makers = list(IMAGES.values() if modality == "image" else AUDIOS.values())[:3]
    items = [make() for make in makers]
    batched = runner.run(items)
    for item, out in zip(items, batched, strict=True):
        [alone] = runner.run([item])
        np.testing.assert_allclose(out.embeddings, alone.embeddings, atol=1e-5, rtol=0)
        assert (out.grid_thw is None) == (alone.grid_thw is None)
    assert len({out.embeddings.shape[0] for out in batched}) == 3  # different lengths in one forward


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
def strict_image_runner(thinker_dir: Path) -> EncoderRunner:
    return _runner(thinker_dir, "image", max_image_side=512, max_image_pixels=200_000,
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


BAD_AUDIOS = {
    "empty": (b"", "empty media"),
    "png": (make_image(32, 32), "not a decodable audio file"),
    "random bytes": (np.random.default_rng(1).bytes(2000), "not a decodable audio file"),
    "wav without data": (make_audio(0.2)[:30], "not a decodable audio file"),
    "zero length": (make_audio(0.0), "zero length"),
    "too short for one token": (make_audio(0.01), "send at least 20 ms"),
    "too long": (make_audio(2.5), "at most 2 s"),
    "nan samples": (_nan_wav(), "NaN"),
    "too many bytes": (make_audio(1.9, rate=48000, channels=2), "at most 300000 bytes"),
}


@pytest.fixture(scope="module")
def strict_audio_runner(thinker_dir: Path) -> EncoderRunner:
    return _runner(thinker_dir, "audio", max_audio_seconds=2, max_media_bytes=300_000)


@pytest.mark.parametrize("name", list(BAD_AUDIOS))
def test_bad_audio_fails_alone_with_a_media_error(strict_audio_runner, name) -> None:
    data, message = BAD_AUDIOS[name]
    good = make_audio(0.5)
    first, bad, last = strict_audio_runner.run([good, data, good])
    assert isinstance(bad, RequestError), bad
    assert bad.field == "media" and message in bad.message, bad.message
    [alone] = strict_audio_runner.run([good])
    for out in (first, last):
        np.testing.assert_allclose(out.embeddings, alone.embeddings, atol=1e-5, rtol=0)


# --- prompt_embeds into the exported LM == the thinker itself --------------------------------------


def _prompt_ids(thinker_dir: Path, bos: str, placeholder: str, eos: str, rows: int,
                text: str) -> torch.Tensor:
    """ChatML user turn with bos + rows x placeholder + eos, as Qwen2_5OmniProcessor expands it."""
    tok = AutoTokenizer.from_pretrained(thinker_dir)
    media = bos + placeholder * rows + eos
    return tok(f"<|im_start|>user\n{media}{text}<|im_end|>\n<|im_start|>assistant\n",
               return_tensors="pt").input_ids


def _prompt_embeds(lm, ids: torch.Tensor, rows: np.ndarray, token_id: int) -> torch.Tensor:
    with torch.no_grad():
        embeds = lm.get_input_embeddings()(ids).clone()
    mask = ids[0] == token_id
    assert int(mask.sum()) == rows.shape[0]
    embeds[0, mask] = torch.from_numpy(rows)
    return embeds


def _thinker_input_embeds(thinker, **inputs) -> torch.Tensor:
    """The inputs_embeds the thinker hands its text model (placeholders already replaced)."""
    seen = {}

    def hook(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach().clone()

    handle = thinker.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            thinker(**inputs)
    finally:
        handle.remove()
    return seen["embeds"]


def test_audio_prompt_embeds_generate_the_thinker_tokens(audio_runner, thinker, thinker_dir, lm) -> None:
    data = make_audio(1.0, seed=3)
    [out] = audio_runner.run([data])
    cfg = thinker.config
    ids = _prompt_ids(thinker_dir, to.AUDIO_BOS_TOKEN, to.AUDIO_TOKEN, to.AUDIO_EOS_TOKEN,
                      out.embeddings.shape[0], "what did you hear in the audio?")
    mask = torch.ones_like(ids)
    audio = reference_audio_inputs(thinker_dir, data)
    want = thinker.generate(input_ids=ids, attention_mask=mask, **audio, max_new_tokens=NEW_TOKENS,
                            do_sample=False)[0, ids.shape[1]:]
    embeds = _prompt_embeds(lm, ids, out.embeddings, cfg.audio_token_id)
    got = lm.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                      do_sample=False)[0]
    assert got.tolist() == want.tolist()
    # the rows matter: the bare placeholders generate something else
    bare = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                       do_sample=False)[0, ids.shape[1]:]
    assert bare.tolist() != want.tolist()


def test_image_prompt_embeds_equal_the_thinker_inputs_but_positions_differ(
        image_runner, thinker, thinker_dir, lm) -> None:
    """Qwen2.5-Omni gives image tokens 3D M-RoPE positions (t, h, w) and shifts the text after them.

    A Qwen2ForCausalLM fed prompt_embeds uses 1D positions, so greedy tokens
    differ (measured on the tiny model: from the first new token on). What
    does hold: the embeddings fed are identical, and with the thinker forced
    to 1D positions its logits are the exported LM's exactly.
    """
    data = make_image(100, 80)
    [out] = image_runner.run([data])
    cfg = thinker.config
    ids = _prompt_ids(thinker_dir, to.VISION_BOS_TOKEN, to.IMAGE_TOKEN, to.VISION_EOS_TOKEN,
                      out.embeddings.shape[0], "describe the picture.")
    mask = torch.ones_like(ids)
    processor = Qwen2VLImageProcessorPil.from_pretrained(thinker_dir)
    image = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    embeds = _prompt_embeds(lm, ids, out.embeddings, cfg.image_token_id)

    fed = _thinker_input_embeds(thinker, input_ids=ids, attention_mask=mask, **image)
    torch.testing.assert_close(fed, embeds, atol=1e-5, rtol=0)

    positions, delta = thinker.get_rope_index(ids, image["image_grid_thw"], None, mask)
    assert not torch.equal(positions[0], positions[1])  # image tokens: t != h != w
    assert int(delta) == -(out.embeddings.shape[0] - max(out.grid_thw[1:]) // 2)

    flat = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    with torch.no_grad():
        thinker_1d = thinker(inputs_embeds=embeds, attention_mask=mask, position_ids=flat).logits
        got = lm(inputs_embeds=embeds, attention_mask=mask).logits
        thinker_3d = thinker(input_ids=ids, attention_mask=mask, **image).logits
    torch.testing.assert_close(got, thinker_1d, atol=1e-5, rtol=0)
    gap = (got[0, -1] - thinker_3d[0, -1]).abs().max().item()
    want = thinker.generate(input_ids=ids, attention_mask=mask, **image, max_new_tokens=NEW_TOKENS,
                            do_sample=False)[0, ids.shape[1]:].tolist()
    tokens = lm.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                         do_sample=False)[0].tolist()
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    print(f"image prompt: last-position logit max |diff| {gap:.4f}; first differing new token "
          f"{first_diff}; thinker {want} vs exported LM {tokens}")


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
    INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

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

    def Metric(self, **kwargs) -> _Metric:  # noqa: N802 (pb_utils spelling)
        return _Metric(**kwargs)


class _Request:
    def __init__(self, media: bytes | None, wanted: tuple[str, ...] = ()):
        self.inputs = {} if media is None else {"media": np.array([[media]], dtype=np.object_)}
        self.wanted = wanted

    def requested_output_names(self) -> list[str]:
        return list(self.wanted)


@pytest.fixture()
def adapter(monkeypatch, thinker_dir: Path, tmp_path: Path):
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
    (tmp_path / "engine.json").write_text(json.dumps({"model": str(thinker_dir), "modality": "image"}))
    model = module.TritonPythonModel()
    model.initialize({"model_name": "image_encoder", "model_repository": str(tmp_path)})
    return model


def test_adapter_answers_each_request_with_its_rows_or_its_error(adapter, image_runner) -> None:
    good = make_image(100, 80)
    responses = adapter.execute([_Request(good), _Request(b"nope"), _Request(None),
                                 _Request(make_image(64, 48, "JPEG", seed=1), wanted=("embeddings",))])
    [want] = image_runner.run([good])
    first, bad, missing, only_rows = responses
    assert first.error is None
    assert first.tensors["embeddings"].shape == (1, *want.embeddings.shape)
    np.testing.assert_allclose(first.tensors["embeddings"][0], want.embeddings, atol=1e-5, rtol=0)
    assert first.tensors["grid_thw"].tolist() == [want.grid_thw.tolist()]
    assert bad.error.code == _Error.INVALID_ARG and bad.error.message.startswith("media:")
    assert missing.error.code == _Error.INVALID_ARG
    assert set(only_rows.tensors) == {"embeddings"}
    assert adapter._items.values == [1, 1] and adapter._batch.values == [4]

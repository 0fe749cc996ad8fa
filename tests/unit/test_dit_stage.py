"""Stage logic of the omni_dit diffusion stage: config, request parsing, batched runs (no server).

Runs the tiny random-weight `qwen-image-tiny` pipeline on CPU at 64x64 and
32x32 with 2 steps. Batched and lone runs are compared on uint8 images with a
tolerance of 1 (one rounding step), since batching may reorder float sums.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from omni_serve.contract import DIT
from omni_serve.dit.config import DitStageConfig
from omni_serve.dit.request import DitRequest, group_key, parse_request
from omni_serve.dit.runner import DitRunner, encode_png
from omni_serve.errors import RequestError
from omni_tools import tiny_models as tm

STEPS = 2
TOLERANCE = 1  # max abs difference on uint8, batched vs alone
SHORT = "a red cat"
LONG = "a small blue house next to a tall green tree under a cloudy sky at noon"
CFG = DitStageConfig(model="unused")


def tensors(prompt: str | bytes | None = "a cat", **extra) -> dict[str, np.ndarray | None]:
    out: dict[str, np.ndarray | None] = {}
    if prompt is not None:
        out[DIT.PROMPT] = np.array([prompt.encode() if isinstance(prompt, str) else prompt], dtype=object)
    dtypes = {DIT.HEIGHT: np.int32, DIT.WIDTH: np.int32, DIT.NUM_INFERENCE_STEPS: np.int32,
              DIT.GUIDANCE_SCALE: np.float32, DIT.SEED: np.int64}
    for name, value in extra.items():
        if isinstance(value, str):
            out[name] = np.array([value.encode()], dtype=object)
        else:
            out[name] = np.array([value], dtype=dtypes[name])
    return out


def req(prompt: str = SHORT, size: int = 64, seed: int = 1, negative: str | None = None,
        guidance: float = 4.0) -> DitRequest:
    return DitRequest(prompt=prompt, negative_prompt=negative, height=size, width=size,
                      num_inference_steps=STEPS, guidance_scale=guidance, seed=seed)


# --- config --------------------------------------------------------------------
def test_config_defaults_and_unknown_keys_are_an_error():
    assert CFG.side_multiple == 16 and CFG.dtype == "float32" and CFG.torch_threads == 1
    with pytest.raises(ValidationError, match="extra"):
        DitStageConfig(model="m", steps=3)
    with pytest.raises(ValidationError, match="default_height=100"):
        DitStageConfig(model="m", default_height=100)
    with pytest.raises(ValidationError, match="default_steps=60"):
        DitStageConfig(model="m", default_steps=60)


# --- parse_request -------------------------------------------------------------
def test_defaults_fill_missing_fields():
    r = parse_request(tensors(), CFG)
    assert (r.prompt, r.negative_prompt, r.height, r.width) == ("a cat", None, 64, 64)
    assert (r.num_inference_steps, r.guidance_scale) == (CFG.default_steps, CFG.default_guidance_scale)
    assert isinstance(r.seed, int)


def test_given_fields_are_kept():
    r = parse_request(tensors(**{DIT.NEGATIVE_PROMPT: "blurry", DIT.HEIGHT: 32, DIT.WIDTH: 48,
                                 DIT.NUM_INFERENCE_STEPS: 3, DIT.GUIDANCE_SCALE: 2.5,
                                 DIT.SEED: -7}), CFG)
    assert r == DitRequest("a cat", "blurry", 32, 48, 3, 2.5, -7)


@pytest.mark.parametrize("field,value,message", [
    (DIT.HEIGHT, 100, "must be a multiple of 16 between 16 and 1024, got 100"),
    (DIT.HEIGHT, 1040, "got 1040"),
    (DIT.HEIGHT, 0, "got 0"),
    (DIT.WIDTH, 24, "must be a multiple of 16 between 16 and 1024, got 24"),
    (DIT.WIDTH, 2048, "got 2048"),
    (DIT.WIDTH, -16, "got -16"),
    (DIT.NUM_INFERENCE_STEPS, 0, "must be between 1 and 50, got 0"),
    (DIT.NUM_INFERENCE_STEPS, 51, "must be between 1 and 50, got 51"),
    (DIT.GUIDANCE_SCALE, -0.5, "must be between 0 and 20.0, got -0.5"),
    (DIT.GUIDANCE_SCALE, 20.5, "must be between 0 and 20.0, got 20.5"),
    (DIT.GUIDANCE_SCALE, float("nan"), "must be finite"),
])
def test_each_limit_names_its_field_and_range(field, value, message):
    with pytest.raises(RequestError) as info:
        parse_request(tensors(**{field: value}), CFG)
    assert info.value.field == field
    assert message in str(info.value)
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize("prompt,message", [
    ("", "must not be empty"),
    ("   ", "must not be empty"),
    (b"\xff\xfe", "not valid UTF-8"),
    (None, "is required"),
])
def test_bad_prompt_names_the_prompt(prompt, message):
    with pytest.raises(RequestError, match=message) as info:
        parse_request(tensors(prompt), CFG)
    assert info.value.field == DIT.PROMPT


def test_non_utf8_negative_prompt_names_its_field():
    bad = {**tensors(), DIT.NEGATIVE_PROMPT: np.array([b"\xff"], dtype=object)}
    with pytest.raises(RequestError) as info:
        parse_request(bad, CFG)
    assert info.value.field == DIT.NEGATIVE_PROMPT


def test_wrong_element_count_and_type_name_the_field():
    two = {**tensors(), DIT.HEIGHT: np.array([32, 32], dtype=np.int32)}
    with pytest.raises(RequestError, match="exactly one element") as info:
        parse_request(two, CFG)
    assert info.value.field == DIT.HEIGHT
    as_float = {**tensors(), DIT.SEED: np.array([1.5], dtype=np.float32)}
    with pytest.raises(RequestError, match="must be an integer") as info:
        parse_request(as_float, CFG)
    assert info.value.field == DIT.SEED


def test_missing_seed_is_random():
    seeds = {parse_request(tensors(), CFG).seed for _ in range(4)}
    assert len(seeds) > 1


def test_group_key_separates_what_cannot_share_a_call():
    assert group_key(req(seed=1)) == group_key(req(prompt=LONG, seed=2))
    assert group_key(req(size=64)) != group_key(req(size=32))
    assert group_key(req()) != group_key(req(negative="blurry"))
    assert group_key(req(guidance=4.0)) != group_key(req(guidance=5.0))


# --- pipeline runs ---------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> DitRunner:
    path: Path = tm.ensure_model("qwen-image-tiny", cache=tmp_path_factory.mktemp("tiny-cache"))
    return DitRunner(DitStageConfig(model=str(path), default_steps=STEPS))


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def test_runner_rejects_a_side_multiple_the_pipeline_would_resize(runner):
    multiple = runner.pipe.vae_scale_factor * 2
    assert CFG.side_multiple % multiple == 0
    with pytest.raises(ValueError, match=f"multiple of {multiple}"):
        DitRunner(DitStageConfig(model=runner.cfg.model, side_multiple=multiple // 2,
                                 default_height=multiple, default_width=multiple))


@pytest.mark.parametrize("negative", [None, "blurry"], ids=["plain", "true-cfg"])
def test_batched_run_matches_each_request_alone(runner, negative):
    # Prompts (and negative prompts) of different token lengths share one call.
    batch = [req(SHORT, seed=11, negative=negative),
             req(LONG, seed=12, negative=None if negative is None else "low quality, ugly, dark")]
    batched = runner.run(batch)
    for image, one in zip(batched, batch, strict=True):
        assert isinstance(image, np.ndarray) and image.dtype == np.uint8
        assert image.shape == (64, 64, 3)
        (alone,) = runner.run([one])
        assert max_diff(image, alone) <= TOLERANCE
    assert max_diff(batched[0], batched[1]) > TOLERANCE


def test_mixed_sizes_split_into_groups_in_request_order(runner, monkeypatch):
    calls: list[int] = []
    real = runner._call
    monkeypatch.setattr(runner, "_call", lambda group: calls.append(len(group)) or real(group))
    out = runner.run([req(size=64, seed=1), req(size=32, seed=2), req(prompt=LONG, size=64, seed=3)])
    assert sorted(calls) == [1, 2]
    assert [o.shape for o in out] == [(64, 64, 3), (32, 32, 3), (64, 64, 3)]


class FailOnPrompt:
    """Wraps the pipeline: any call whose batch contains `bad` raises."""

    def __init__(self, pipe, bad: str):
        self.pipe, self.bad = pipe, bad

    def __call__(self, *, prompt, **kw):
        if self.bad in prompt:
            raise RuntimeError(f"boom on {self.bad!r}")
        return self.pipe(prompt=prompt, **kw)

    def __getattr__(self, name):
        return getattr(self.pipe, name)


def test_a_failing_request_does_not_fail_its_batch_mates(runner, monkeypatch):
    good = [req(SHORT, seed=5), req(LONG, seed=6)]
    expected = runner.run(good)
    monkeypatch.setattr(runner, "pipe", FailOnPrompt(runner.pipe, "poison"))
    out = runner.run([good[0], req("poison", seed=7), good[1]])
    assert isinstance(out[1], RuntimeError) and "poison" in str(out[1])
    for got, want in zip((out[0], out[2]), expected, strict=True):
        assert isinstance(got, np.ndarray)
        assert max_diff(got, want) <= TOLERANCE


def test_encode_png_round_trips():
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, size=(32, 48, 3), dtype=np.uint8)
    image = Image.open(io.BytesIO(encode_png(arr)))
    assert image.format == "PNG" and image.size == (48, 32) and image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(image), arr)

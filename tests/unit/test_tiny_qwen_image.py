"""omni_tools.tiny_models: the tiny random-weight Qwen-Image pipeline (CPU, no server).

Builds `qwen-image-tiny` into a temporary cache and reloads it with
`QwenImagePipeline.from_pretrained`, the path a real checkpoint takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from PIL import Image

from omni_tools import tiny_models as tm
from omni_tools.model_cache import MARKER_FILE

NAME = "qwen-image-tiny"
SIZE = 64
CALL = {"height": SIZE, "width": SIZE, "num_inference_steps": 2, "true_cfg_scale": 1.0}
SHORT = "a red cat"
LONG = "a small blue house next to a tall green tree under a cloudy sky at noon"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tm.ensure_model(NAME, cache=tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="module")
def pipe(model_path: Path) -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(model_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _gen(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)


def _np(pipe: QwenImagePipeline, prompt: str | list[str], generator, **kw) -> np.ndarray:
    return pipe(prompt, generator=generator, output_type="np", **CALL, **kw).images


def test_registered_and_built(model_path: Path) -> None:
    assert NAME in tm.TINY_MODELS
    marker = json.loads((model_path / MARKER_FILE).read_text())
    assert marker["name"] == NAME
    index = json.loads((model_path / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    for part in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (model_path / part).is_dir(), part
    size = sum(f.stat().st_size for f in model_path.rglob("*") if f.is_file())
    assert size < 10 * 2**20


def test_reloaded_components(pipe: QwenImagePipeline) -> None:
    assert type(pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(pipe.tokenizer).__name__ == "Qwen2Tokenizer"
    assert pipe.text_encoder.config.text_config.hidden_size == 16
    assert pipe.transformer.config.joint_attention_dim == 16
    assert pipe.vae.config.z_dim == 4
    assert pipe.scheduler.config.use_dynamic_shifting
    assert pipe.scheduler.config.shift_terminal == pytest.approx(0.02)


def test_template_drop_lines_up(pipe: QwenImagePipeline) -> None:
    """The pipeline drops exactly the system part of its template, not prompt tokens."""
    drop = pipe.prompt_template_encode_start_idx
    assert pipe.prompt_template_encode == tm.QWEN_IMAGE_TEMPLATE
    assert len(tm.qwen_image_template_prefix_ids(pipe.tokenizer)) == drop
    for prompt in (SHORT, LONG):
        # What remains after the drop: the prompt plus the template's tail.
        tail = pipe.tokenizer(f"{prompt}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        with torch.no_grad():
            embeds, mask = pipe._get_qwen_prompt_embeds(prompt, device=torch.device("cpu"))
        assert embeds.shape[1] == len(tail)
        assert int(mask.sum()) == len(tail)


def test_pil_image_of_requested_size(pipe: QwenImagePipeline) -> None:
    image = pipe(SHORT, generator=_gen(0), **CALL).images[0]
    assert isinstance(image, Image.Image)
    assert image.size == (SIZE, SIZE)
    assert image.mode == "RGB"


def test_output_is_finite_and_not_flat(pipe: QwenImagePipeline) -> None:
    image = _np(pipe, SHORT, _gen(0))
    assert image.shape == (1, SIZE, SIZE, 3)
    assert np.isfinite(image).all()
    assert image.std() > 1e-3


def test_same_seed_same_image(pipe: QwenImagePipeline) -> None:
    a = _np(pipe, SHORT, _gen(7))
    b = _np(pipe, SHORT, _gen(7))
    np.testing.assert_array_equal(a, b)


def test_different_seed_different_image(pipe: QwenImagePipeline) -> None:
    a = _np(pipe, SHORT, _gen(7))
    b = _np(pipe, SHORT, _gen(8))
    assert np.abs(a - b).max() > 1e-3


def test_different_prompt_different_image(pipe: QwenImagePipeline) -> None:
    a = _np(pipe, SHORT, _gen(7))
    b = _np(pipe, LONG, _gen(7))
    assert np.abs(a - b).max() > 1e-4


@pytest.mark.parametrize(
    "prompts",
    [pytest.param((SHORT, "a green dog"), id="same-length"), pytest.param((SHORT, LONG), id="mixed")],
)
def test_batched_matches_alone(pipe: QwenImagePipeline, prompts: tuple[str, str]) -> None:
    """One generator per prompt: a batched call gives each prompt's lone image."""
    lengths = [len(pipe.tokenizer(p)["input_ids"]) for p in prompts]
    if prompts[1] == LONG:
        assert lengths[0] != lengths[1]
    seeds = (11, 12)
    batched = _np(pipe, list(prompts), [_gen(s) for s in seeds])
    assert batched.shape == (2, SIZE, SIZE, 3)
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        alone = _np(pipe, prompt, _gen(seed))
        assert np.abs(batched[i] - alone[0]).max() <= 1e-5
    assert np.abs(batched[0] - batched[1]).max() > 1e-4

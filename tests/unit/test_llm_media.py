"""A multimodal thinker request's media: parsed per field, checked against the checkpoint's
shapes, handed to vLLM as its Qwen2.5-Omni `multi_modal_data` (no engine here)."""
from __future__ import annotations

import numpy as np
import pytest

from omni_serve import families
from omni_serve.contract import LLM
from omni_serve.errors import RequestError
from omni_serve.llm.media import MediaShapes, multi_modal_data
from omni_serve.llm.request import parse_request

TOKENS = families.get("qwen2_5_omni").media_tokens
SHAPES = MediaShapes(hidden_size=8, merge=2, mel_bins=4, tokens=TOKENS)
PROMPT = "<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>hi"


def tensors(prompt=PROMPT, **media):
    out = {LLM.TEXT_INPUT: np.array([prompt.encode()], dtype=object)}
    out.update(media)
    return out


def both(**overrides):
    media = {LLM.IMAGE_EMBEDS: np.ones((3, 8), np.float32),  # grid 1 x 2 x 6 / 2**2 = 3 rows
             LLM.IMAGE_GRID_THW: np.array([[1, 2, 6]], np.int64),
             LLM.AUDIO_FEATURES: np.ones((4, 30), np.float32),
             LLM.AUDIO_FEATURE_LENGTHS: np.array([30], np.int64)}
    media.update(overrides)
    return {k: v for k, v in media.items() if v is not None}


def data(prompt=PROMPT, **overrides):
    req = parse_request("r", tensors(prompt, **both(**overrides)))
    return multi_modal_data(req.media, req.prompt, SHAPES, "llm")


def test_media_become_vllms_fields():
    mm = data()
    assert mm["image"]["image_embeds"].shape == (3, 8)
    assert mm["image"]["image_grid_thw"].tolist() == [[1, 2, 6]]
    assert mm["audio"]["input_audio_features"].shape == (4, 30)
    assert mm["audio"]["audio_feature_lengths"].tolist() == [30]
    assert mm["audio"]["feature_attention_mask"].tolist() == [[1] * 30]


def test_two_clips_get_a_mask_each():
    prompt = PROMPT.replace("<|audio_eos|>", "<|audio_eos|><|audio_bos|><|AUDIO|><|audio_eos|>")
    mm = data(prompt, **{LLM.AUDIO_FEATURES: np.ones((4, 50), np.float32),
                         LLM.AUDIO_FEATURE_LENGTHS: np.array([30, 20], np.int64)})
    mask = mm["audio"]["feature_attention_mask"]
    assert mask.shape == (2, 30) and mask.sum(-1).tolist() == [30, 20]


@pytest.mark.parametrize("overrides, field, message", [
    ({LLM.IMAGE_GRID_THW: None}, LLM.IMAGE_GRID_THW, "is required with image_embeds"),
    ({LLM.AUDIO_FEATURE_LENGTHS: np.array([29])}, LLM.AUDIO_FEATURE_LENGTHS,
     "sum to 29 frames but audio_features has 30"),
    ({LLM.IMAGE_EMBEDS: np.ones((3, 8), np.float64)}, LLM.IMAGE_EMBEDS, "must be FP32"),
    ({LLM.IMAGE_EMBEDS: np.full((3, 8), np.nan, np.float32)}, LLM.IMAGE_EMBEDS, "must be finite"),
    ({LLM.IMAGE_GRID_THW: np.array([[1, 0, 6]])}, LLM.IMAGE_GRID_THW, "must be >= 1"),
    ({LLM.IMAGE_GRID_THW: np.array([1.0, 2.0, 6.0])}, LLM.IMAGE_GRID_THW, "must be integers"),
])
def test_a_malformed_field_is_named(overrides, field, message):
    with pytest.raises(RequestError, match=message) as info:
        parse_request("r", tensors(**both(**overrides)))
    assert info.value.field == field


@pytest.mark.parametrize("prompt, overrides, field, message", [
    (PROMPT, {LLM.IMAGE_EMBEDS: np.ones((4, 8), np.float32)}, LLM.IMAGE_EMBEDS,
     r"has 4 rows but image_grid_thw \[\[1, 2, 6\]\] makes 3"),
    (PROMPT, {LLM.IMAGE_EMBEDS: np.ones((3, 5), np.float32)}, LLM.IMAGE_EMBEDS,
     "rows must be 8 wide"),
    (PROMPT, {LLM.AUDIO_FEATURES: np.ones((3, 30), np.float32)}, LLM.AUDIO_FEATURES,
     "must have 4 mel bins"),
    ("<|IMAGE|><|IMAGE|><|AUDIO|>hi", {}, LLM.IMAGE_GRID_THW,
     "names 1 images but text_input has 2 <|IMAGE|> placeholders"),
    ("<|IMAGE|>hi", {}, LLM.AUDIO_FEATURE_LENGTHS, "names 1 clips but text_input has 0"),
    # a grid vLLM cannot place: h // merge == 0 killed the engine (M-RoPE of no positions)
    (PROMPT, {LLM.IMAGE_GRID_THW: np.array([[1, 1, 12]], np.int64)}, LLM.IMAGE_GRID_THW,
     r"h and w must be multiples of the vision merge size 2, got \[1, 1, 12\]"),
    (PROMPT, {LLM.IMAGE_GRID_THW: np.array([[1, 2, 3]], np.int64)}, LLM.IMAGE_GRID_THW,
     "multiples of the vision merge size 2"),
    # (2**62 + 1) * 2 * 8 wraps to 16 in int64: 4 rows would have passed
    (PROMPT, {LLM.IMAGE_EMBEDS: np.ones((4, 8), np.float32),
              LLM.IMAGE_GRID_THW: np.array([[2**62 + 1, 2, 8]], np.int64)}, LLM.IMAGE_EMBEDS,
     "has 4 rows but image_grid_thw"),
    # under 3 frames a clip has no audio token: vLLM failed with an anonymous TypeError
    (PROMPT, {LLM.AUDIO_FEATURES: np.ones((4, 2), np.float32),
              LLM.AUDIO_FEATURE_LENGTHS: np.array([2], np.int64)}, LLM.AUDIO_FEATURE_LENGTHS,
     "each clip needs at least 3 frames"),
])
def test_media_that_do_not_fit_the_checkpoint_are_refused_before_the_engine(prompt, overrides,
                                                                            field, message):
    with pytest.raises(RequestError, match=message) as info:
        data(prompt, **overrides)
    assert info.value.field == field


def test_a_text_only_model_refuses_media():
    req = parse_request("r", tensors(**both()))
    with pytest.raises(RequestError, match="stage llm serves a text-only model"):
        multi_modal_data(req.media, req.prompt, None, "llm")


def test_shapes_come_from_a_full_qwen25_omni_config():
    from transformers import Qwen2_5OmniConfig

    shapes = MediaShapes.from_hf_config(Qwen2_5OmniConfig())
    assert shapes == MediaShapes(hidden_size=3584, merge=2, mel_bins=128, tokens=TOKENS)
    from transformers import Qwen2Config

    assert MediaShapes.from_hf_config(Qwen2Config()) is None

"""The tiny Qwen3-Omni checkpoints load and run in transformers as the hub's folders do.

Where it runs: in the pytest process (CPU, fp32, no server). What flows through it: the
folders `omni-build-tiny qwen3-omni-tiny` / `qwen3-omni-thinking-tiny` write
(omni_tools.tiny_qwen3_omni, built once into the model cache), read with transformers'
Auto classes and `Qwen3OmniMoeForConditionalGeneration`; speech through
tests/qwen3_reference.py, the helper the Qwen3 goldens compare the served pipeline to.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import omni_tools.tiny_models as tm
from omni_tools import tiny_qwen3_omni as q3
from tests import qwen3_reference

torch.set_num_threads(1)

SEED = 0
TEXT_CHAT = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": [{"type": "text", "text": "Tell me about the weather today."}]}]


@pytest.fixture(scope="module")
def instruct() -> Path:
    return tm.ensure_model("qwen3-omni-tiny")


@pytest.fixture(scope="module")
def thinking() -> Path:
    return tm.ensure_model("qwen3-omni-thinking-tiny")


def _tensor_names(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# --- the folder --------------------------------------------------------------------------------


def test_instruct_folder_has_the_hub_files(instruct: Path) -> None:
    files = {p.name for p in instruct.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "chat_template.json",
            "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert "chat_template.jinja" not in files  # the hub keeps the template in chat_template.json
    assert json.loads((instruct / "generation_config.json").read_text()) == q3.TALKER_GENERATION_DEFAULTS
    config = _config(instruct)
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert config["enable_audio_output"] is True
    names = _tensor_names(instruct)
    assert {n.split(".")[0] for n in names} == {"thinker", "talker", "code2wav"}


def test_thinking_folder_has_no_talker_and_the_same_thinker(instruct: Path, thinking: Path) -> None:
    assert _config(thinking)["enable_audio_output"] is False
    names = _tensor_names(thinking)
    assert names and all(n.startswith("thinker.") for n in names)
    assert names == {n for n in _tensor_names(instruct) if n.startswith("thinker.")}
    with safe_open(str(instruct / "model.safetensors"), "pt") as a, \
            safe_open(str(thinking / "model.safetensors"), "pt") as b:
        for name in ("thinker.lm_head.weight", "thinker.model.layers.0.mlp.experts.0.gate_proj.weight"):
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def test_loads_with_from_pretrained_without_missing_or_unexpected_weights(instruct: Path) -> None:
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        instruct, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    processor = AutoProcessor.from_pretrained(instruct)
    assert type(processor).__name__ == "Qwen3OmniMoeProcessor"
    assert type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor"
    tok, thinker = processor.tokenizer, model.config.thinker_config
    assert tok.convert_tokens_to_ids(tok.image_token) == thinker.image_token_id
    assert tok.convert_tokens_to_ids(tok.audio_token) == thinker.audio_token_id
    assert tok.convert_tokens_to_ids(tok.video_token) == thinker.video_token_id
    assert tok.convert_tokens_to_ids(q3.TTS_PAD) == model.config.tts_pad_token_id
    # The rope index finds turns by the single token after <|im_start|>.
    for role in ("system", "user", "assistant"):
        assert tok.convert_ids_to_tokens(getattr(model.config, f"{role}_token_id")) == role


def test_thinking_folder_loads_without_a_talker(thinking: Path) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        thinking, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not model.has_talker and not hasattr(model, "talker")


def test_chat_template_renders_system_and_user_with_image_and_audio(instruct: Path) -> None:
    from transformers import AutoProcessor, AutoTokenizer

    processor = AutoProcessor.from_pretrained(instruct)
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                             {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>"
                    "What is this?<|im_end|>\n<|im_start|>assistant\n")
    tokenizer = AutoTokenizer.from_pretrained(instruct)  # the template is the tokenizer's too
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    # The processor expands each placeholder to as many tokens as the towers return rows.
    image = Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8))
    audio = np.zeros(16000, dtype=np.float32)
    inputs = processor(text=text, images=[image], audio=[audio], return_tensors="pt")
    ids = inputs["input_ids"][0]
    merge = processor.image_processor.merge_size ** 2
    assert int((ids == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()) \
        == int(inputs["image_grid_thw"].prod()) // merge
    assert int((ids == processor.tokenizer.convert_tokens_to_ids("<|audio_pad|>")).sum()) == 13  # 1 s


# --- the architecture's quirks ----------------------------------------------------------------


def test_config_keeps_the_real_structure(instruct: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(instruct)
    text, talker = config.thinker_config.text_config, config.talker_config
    assert text.head_dim * text.num_attention_heads != text.hidden_size
    assert text.num_experts_per_tok > 1 and text.num_experts > text.num_experts_per_tok
    assert text.rope_parameters["mrope_interleaved"] and text.rope_parameters["interleaved"]
    assert 2 * sum(text.rope_parameters["mrope_section"]) == text.head_dim
    assert text.tie_word_embeddings is False and config.thinker_config.tie_word_embeddings is False
    assert text.hidden_size % 32 == 0 and text.head_dim in (32, 64, 80, 96, 112, 128)  # vLLM CPU
    assert config.thinker_config.vision_config.deepstack_visual_indexes
    assert talker.num_code_groups == talker.code_predictor_config.num_code_groups == 16
    assert set(talker.speaker_id) == {"chelsie", "ethan", "aiden"}
    # transformers suppresses the talker's top 1024 ids but codec eos: every special id and voice
    # lives there, every code below it, and the codebook is Code2Wav's.
    vocab = talker.text_config.vocab_size
    specials = [talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id,
                talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id,
                *talker.speaker_id.values()]
    assert all(vocab - 1024 <= i < vocab for i in specials)
    assert vocab - 1024 == talker.code_predictor_config.vocab_size == config.code2wav_config.codebook_size
    assert talker.accept_hidden_layer <= text.num_hidden_layers
    upsample = np.prod(config.code2wav_config.upsample_rates + config.code2wav_config.upsampling_ratios)
    assert upsample == q3.SAMPLES_PER_FRAME == 1920


def test_talker_has_the_gated_shared_expert_and_towers_their_deepstack(instruct: Path) -> None:
    names = _tensor_names(instruct)
    assert "talker.model.layers.0.mlp.shared_expert_gate.weight" in names
    assert "talker.model.layers.0.mlp.shared_expert.gate_proj.weight" in names
    assert "thinker.model.layers.0.self_attn.q_norm.weight" in names
    # experts one by one, as the hub's files hold them (transformers fuses them on load)
    assert {f"thinker.model.layers.0.mlp.experts.{e}.up_proj.weight"
            for e in range(q3.TINY_TEXT["num_experts"])} <= names
    depth = len(q3.TINY_VISION["deepstack_visual_indexes"])
    assert {f"thinker.visual.merger_list.{i}.ln_q.weight" for i in range(depth)} <= names
    groups = {n.split(".")[3] for n in names if n.startswith("talker.code_predictor.lm_head.")}
    assert len(groups) == 15  # the code predictor completes each 16-code frame


# --- transformers' speech -----------------------------------------------------------------------


def test_generate_is_repeatable_and_gives_1920_samples_a_frame(instruct: Path) -> None:
    run = dict(speaker="ethan", seed=SEED, max_new_tokens=8, talker_max_new_tokens=10)
    reply, codes, wave = qwen3_reference.reference(instruct, TEXT_CHAT, **run)
    again = qwen3_reference.reference(instruct, TEXT_CHAT, **run)
    assert reply == again[0]
    np.testing.assert_array_equal(codes, again[1])
    np.testing.assert_array_equal(wave, again[2])
    assert len(reply) >= 4  # a real reply: the talker reads text, not only <|im_end|>
    tokenizer = qwen3_reference.load(str(instruct))[1].tokenizer
    stops = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id}
    assert all(i < len(tokenizer) and (i in stops or i not in tokenizer.all_special_ids)
               for i in reply), reply  # text, as a trained thinker writes (quiet_non_text_rows)
    assert codes.dtype == np.int64 and codes.shape[1] == 16 and codes.shape[0] > 1
    assert codes.min() >= 0 and codes.max() < q3.TINY_CODEBOOK
    assert wave.dtype == np.float32 and float(wave.std()) > 1e-3
    # Code2Wav is causal: one more frame adds 1920 samples and leaves the earlier ones alone;
    # the causal convolutions hold back the same tail at every length.
    model, _ = qwen3_reference.load(str(instruct))
    with torch.no_grad():
        one = model.code2wav(torch.from_numpy(codes[:1].T[None]))[0, 0].numpy()
        two = model.code2wav(torch.from_numpy(codes[:2].T[None]))[0, 0].numpy()
    assert two.size - one.size == q3.SAMPLES_PER_FRAME
    np.testing.assert_allclose(two[:one.size], one, atol=1e-5)
    held_back = q3.SAMPLES_PER_FRAME - one.size
    assert wave.size == codes.shape[0] * q3.SAMPLES_PER_FRAME - held_back


def test_voices_differ(instruct: Path) -> None:
    run = dict(seed=SEED, max_new_tokens=8, talker_max_new_tokens=6)
    _, ethan, _ = qwen3_reference.reference(instruct, TEXT_CHAT, speaker="ethan", **run)
    _, aiden, _ = qwen3_reference.reference(instruct, TEXT_CHAT, speaker="aiden", **run)
    assert ethan.shape != aiden.shape or (ethan != aiden).any()

"""omni_tools.tiny_omni: the tiny Qwen2.5-Omni thinker and the full tiny checkpoint (CPU, no server).

The thinker checkpoint must be the real architecture, tiny, with a tokenizer,
chat template and preprocessor config laid out as Qwen2.5-Omni's. The full
checkpoint (`build_omni_checkpoint`, what vLLM serves the thinker from and
every omni stage reads its part of) must be a Qwen2_5OmniForConditionalGeneration
that transformers loads with no missing or unexpected weights, float32 in
every part, with `build_omni_thinker`'s thinker, the Token2Wav it was given,
voices in `spk_dict.pt`, and a Qwen2_5OmniProcessor on torchvision.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoTokenizer,
    PreTrainedModel,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniToken2WavModel,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

from omni_tools import tiny_omni as to

torch.set_num_threads(1)

PROMPT = "<|im_start|>user\nwhat is the capital of france?<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def thinker(tiny_thinker: Path) -> Qwen2_5OmniThinkerForConditionalGeneration:
    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tiny_thinker).eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_thinker: Path) -> torch.Tensor:
    return AutoTokenizer.from_pretrained(tiny_thinker)(PROMPT, return_tensors="pt").input_ids


@pytest.fixture(scope="module")
def full_model(tiny_omni_checkpoint: Path) -> Qwen2_5OmniForConditionalGeneration:
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni_checkpoint).eval()


# --- the tiny thinker -------------------------------------------------------------------


def test_thinker_is_the_real_architecture_and_tiny(thinker, tiny_thinker: Path) -> None:
    cfg = thinker.config
    assert cfg.model_type == "qwen2_5_omni_thinker"
    assert cfg.text_config.hidden_size == to.TINY_TEXT_HIDDEN
    assert cfg.vision_config.out_hidden_size == cfg.audio_config.output_dim == to.TINY_TEXT_HIDDEN
    assert cfg.audio_config.num_mel_bins == 128
    head_dim = cfg.text_config.hidden_size // cfg.text_config.num_attention_heads
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) * 2 == head_dim == 64
    size = sum(f.stat().st_size for f in tiny_thinker.rglob("*") if f.is_file())
    assert size < 10 * 2**20


def test_tokenizer_special_ids_match_the_config(thinker, tiny_thinker: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_thinker)
    cfg = thinker.config
    ids = tok.convert_tokens_to_ids
    assert ids(to.IMAGE_TOKEN) == cfg.image_token_id
    assert ids(to.AUDIO_TOKEN) == cfg.audio_token_id
    assert ids(to.VIDEO_TOKEN) == cfg.video_token_id
    assert ids(to.VISION_BOS_TOKEN) == cfg.vision_start_token_id
    assert ids(to.VISION_EOS_TOKEN) == cfg.vision_end_token_id
    assert ids(to.AUDIO_BOS_TOKEN) == cfg.audio_start_token_id
    assert ids(to.AUDIO_EOS_TOKEN) == cfg.audio_end_token_id
    assert tok.image_token == to.IMAGE_TOKEN and tok.audio_token == to.AUDIO_TOKEN  # processor attributes
    assert max(ids(list(to.OMNI_SPECIAL_TOKENS.values()))) < cfg.text_config.vocab_size
    # placeholders are single special tokens, never split or merged with text
    text = f"a{to.AUDIO_BOS_TOKEN}{to.AUDIO_TOKEN}{to.AUDIO_TOKEN}{to.AUDIO_EOS_TOKEN}b"
    assert tok(text).input_ids[1:5] == [cfg.audio_start_token_id, cfg.audio_token_id, cfg.audio_token_id,
                                        cfg.audio_end_token_id]
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == "ab"


def test_chat_template_renders_media_placeholders(tiny_thinker: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_thinker)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                             {"type": "text", "text": "what is this?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>"
                    "<|audio_bos|><|AUDIO|><|audio_eos|>what is this?<|im_end|>\n<|im_start|>assistant\n")


def test_preprocessor_configs_load_from_the_checkpoint(tiny_thinker: Path) -> None:
    image = AutoImageProcessor.from_pretrained(tiny_thinker)
    assert type(image) is Qwen2VLImageProcessor  # the torchvision one, as vLLM and the processor use
    assert image.size["shortest_edge"] == to.TINY_MIN_PIXELS
    assert image.size["longest_edge"] == to.TINY_MAX_PIXELS
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (14, 2, 2)
    audio = WhisperFeatureExtractor.from_pretrained(tiny_thinker)
    assert (audio.feature_size, audio.sampling_rate, audio.hop_length) == (128, 16000, 160)
    assert audio.n_samples == to.TINY_AUDIO_CHUNK_SECONDS * 16000


def test_thinker_greedy_tokens_vary(thinker, prompt_ids) -> None:
    out = thinker.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                           max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt_ids.shape[1]:]
    assert len(out) == NEW_TOKENS
    assert len(set(out.tolist())) > 2  # wide init: greedy output is not one repeated token


# --- the full Qwen2.5-Omni checkpoint ----------------------------------------------------


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_full_config_is_qwen2_5_omni_and_float32_everywhere(tiny_omni_checkpoint: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_omni_checkpoint)
    assert type(config) is Qwen2_5OmniConfig and config.model_type == "qwen2_5_omni"
    assert config.architectures == ["Qwen2_5OmniForConditionalGeneration"]
    parts = {"config": config, "thinker_config": config.thinker_config,
             "thinker_config.text_config": config.thinker_config.text_config,
             "talker_config": config.talker_config, "token2wav_config": config.token2wav_config}
    assert {name: _dtype_name(part.dtype) for name, part in parts.items()} == dict.fromkeys(parts, "float32")
    # as written on disk, where vLLM reads the text config's dtype for dtype="auto"
    raw = json.loads((tiny_omni_checkpoint / "config.json").read_text())
    on_disk = {"config": raw["dtype"], "thinker_config": raw["thinker_config"]["dtype"],
               "thinker_config.text_config": raw["thinker_config"]["text_config"]["dtype"],
               "talker_config": raw["talker_config"]["dtype"],
               "token2wav_config": raw["token2wav_config"]["dtype"]}
    assert on_disk == dict.fromkeys(parts, "float32")
    assert config.enable_audio_output is True


def test_full_checkpoint_has_the_hub_layout(tiny_omni_checkpoint: Path, tiny_thinker: Path) -> None:
    for name in ("config.json", "model.safetensors", "spk_dict.pt", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert (tiny_omni_checkpoint / name).is_file(), name
    with safe_open(tiny_omni_checkpoint / "model.safetensors", "pt") as f:
        prefixes = {name.split(".", 1)[0] for name in f.keys()}
    assert prefixes == {"thinker", "talker", "token2wav"}
    assert (json.loads((tiny_omni_checkpoint / "preprocessor_config.json").read_text())
            == json.loads((tiny_thinker / "preprocessor_config.json").read_text()))
    size = sum(f.stat().st_size for f in tiny_omni_checkpoint.rglob("*") if f.is_file())
    assert size < 20 * 2**20


def test_full_model_loads_with_no_missing_or_unexpected_weights(tiny_omni_checkpoint: Path) -> None:
    # PreTrainedModel's own loader: Qwen2_5Omni's override cannot return the loading info
    _, info = PreTrainedModel.from_pretrained.__func__(
        Qwen2_5OmniForConditionalGeneration, tiny_omni_checkpoint, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []


def test_full_model_parts_are_float32(full_model) -> None:
    for part in (full_model.thinker, full_model.talker, full_model.token2wav):
        assert {p.dtype for p in part.parameters()} == {torch.float32}, type(part).__name__


def test_spk_dict_holds_the_voices_with_thinker_bos_tokens(tiny_omni_checkpoint: Path,
                                                           tiny_token2wav_dir: Path, full_model) -> None:
    speakers = torch.load(tiny_omni_checkpoint / "spk_dict.pt", weights_only=True)
    assert set(speakers) == {"Chelsie", "Ethan"}
    voices = load_file(str(tiny_token2wav_dir / "speakers.safetensors"))
    config = full_model.config
    vocab = config.thinker_config.text_config.vocab_size
    tokens = len(AutoTokenizer.from_pretrained(tiny_omni_checkpoint))
    talker_text_ids = {config.talker_config.tts_text_start_token_id,
                       config.talker_config.tts_text_end_token_id,
                       config.talker_config.tts_text_pad_token_id}
    bos = {}
    for name, voice in speakers.items():
        assert set(voice) == {"cond", "ref_mel", "bos_token"}, name
        torch.testing.assert_close(voice["cond"], voices[f"{name}.cond"], atol=0, rtol=0)
        torch.testing.assert_close(voice["ref_mel"], voices[f"{name}.ref_mel"], atol=0, rtol=0)
        bos[name] = int(voice["bos_token"])
        # the talker embeds it with the thinker's embedding table: inside the vocabulary,
        # yet no text token, and none of the talker's own tts_text ids
        assert tokens <= bos[name] < vocab, (name, bos[name])
        assert bos[name] not in talker_text_ids
    assert len(set(bos.values())) == 2
    assert {name: int(v["bos_token"]) for name, v in full_model.speaker_map.items()} == bos


def test_full_thinker_weights_are_build_omni_thinkers(full_model, thinker) -> None:
    want = thinker.state_dict()
    got = full_model.thinker.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_full_token2wav_weights_are_the_given_ones(full_model, tiny_token2wav_dir: Path) -> None:
    want = Qwen2_5OmniToken2WavModel.from_pretrained(tiny_token2wav_dir).state_dict()
    got = full_model.token2wav.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_full_processor_is_qwen2_5_omni_on_torchvision(tiny_omni_checkpoint: Path, full_model) -> None:
    processor = Qwen2_5OmniProcessor.from_pretrained(tiny_omni_checkpoint)
    assert type(processor.image_processor) is Qwen2VLImageProcessor
    assert type(processor.feature_extractor) is WhisperFeatureExtractor
    cfg = full_model.config.thinker_config
    image = Image.new("RGB", (100, 80), (200, 30, 90))
    batch = processor(text=f"{to.VISION_BOS_TOKEN}{to.IMAGE_TOKEN}{to.VISION_EOS_TOKEN}hi", images=[image],
                      return_tensors="pt")
    assert batch["image_grid_thw"].tolist() == [[1, 6, 8]]  # 100x80 -> 112x84 -> 8x6 patches
    assert int((batch["input_ids"] == cfg.image_token_id).sum()) == 12  # one per 2x2 merged patches


def test_full_thinker_generates_varying_tokens_as_the_thinker(full_model, thinker, prompt_ids) -> None:
    kw = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "attention_mask": torch.ones_like(prompt_ids)}
    got = full_model.thinker.generate(input_ids=prompt_ids, **kw)[0, prompt_ids.shape[1]:]
    want = thinker.generate(input_ids=prompt_ids, **kw)[0, prompt_ids.shape[1]:]
    assert got.tolist() == want.tolist()
    assert len(set(got.tolist())) > 2  # not one repeated id

"""omni_tools.tiny_omni: the tiny Qwen2.5-Omni thinker and its export as a Qwen2ForCausalLM (CPU, no server).

The exported LM must be the thinker's language model exactly: same logits on
text, same greedy tokens, from a thinker-only and from a full Qwen2.5-Omni
(`thinker.`-prefixed, sharded) checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoTokenizer,
    Qwen2_5OmniConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2ForCausalLM,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omni_tools import tiny_omni as to

torch.set_num_threads(1)

PROMPT = "<|im_start|>user\nwhat is the capital of france?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("omni") / "thinker"
    to.build_omni_thinker(out)
    return out


@pytest.fixture(scope="module")
def lm_dir(thinker_dir: Path) -> Path:
    out = thinker_dir.parent / "lm"
    to.export_thinker_lm(thinker_dir, out)
    return out


@pytest.fixture(scope="module")
def thinker(thinker_dir: Path) -> Qwen2_5OmniThinkerForConditionalGeneration:
    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(thinker_dir).eval()


@pytest.fixture(scope="module")
def lm(lm_dir: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(lm_dir).eval()


@pytest.fixture(scope="module")
def prompt_ids(thinker_dir: Path) -> torch.Tensor:
    return AutoTokenizer.from_pretrained(thinker_dir)(PROMPT, return_tensors="pt").input_ids


# --- the tiny thinker -------------------------------------------------------------------


def test_thinker_is_the_real_architecture_and_tiny(thinker, thinker_dir: Path) -> None:
    cfg = thinker.config
    assert cfg.model_type == "qwen2_5_omni_thinker"
    assert cfg.text_config.hidden_size == to.TINY_TEXT_HIDDEN
    assert cfg.vision_config.out_hidden_size == cfg.audio_config.output_dim == to.TINY_TEXT_HIDDEN
    assert cfg.audio_config.num_mel_bins == 128
    head_dim = cfg.text_config.hidden_size // cfg.text_config.num_attention_heads
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) * 2 == head_dim == 64
    size = sum(f.stat().st_size for f in thinker_dir.rglob("*") if f.is_file())
    assert size < 10 * 2**20


def test_tokenizer_special_ids_match_the_config(thinker, thinker_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(thinker_dir)
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


def test_chat_template_renders_media_placeholders(thinker_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(thinker_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                             {"type": "text", "text": "what is this?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>"
                    "<|audio_bos|><|AUDIO|><|audio_eos|>what is this?<|im_end|>\n<|im_start|>assistant\n")


def test_preprocessor_configs_load_from_the_checkpoint(thinker_dir: Path) -> None:
    image = Qwen2VLImageProcessorPil.from_pretrained(thinker_dir)
    assert image.size["shortest_edge"] == to.TINY_MIN_PIXELS
    assert image.size["longest_edge"] == to.TINY_MAX_PIXELS
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (14, 2, 2)
    audio = WhisperFeatureExtractor.from_pretrained(thinker_dir)
    assert (audio.feature_size, audio.sampling_rate, audio.hop_length) == (128, 16000, 160)


# --- the exported LM --------------------------------------------------------------------


def test_export_writes_a_plain_qwen2_checkpoint(thinker, lm_dir: Path) -> None:
    config = json.loads((lm_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert "mrope_section" not in json.dumps(config)
    theta = thinker.config.text_config.rope_parameters["rope_theta"]
    assert config["rope_parameters"]["rope_theta"] == theta
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is False
    with safe_open(lm_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    thinker_names = {n for n in thinker.state_dict() if n.startswith("model.") or n == "lm_head.weight"}
    assert names == thinker_names
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (lm_dir / name).is_file(), name


def test_exported_lm_gives_the_thinker_logits_on_text(thinker, lm, prompt_ids) -> None:
    with torch.no_grad():
        want = thinker(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids)).logits
        got = lm(input_ids=prompt_ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_exported_lm_greedy_tokens_equal_the_thinker_and_vary(thinker, lm, prompt_ids) -> None:
    kw = {"max_new_tokens": 8, "do_sample": False, "attention_mask": torch.ones_like(prompt_ids)}
    want = thinker.generate(input_ids=prompt_ids, **kw)[0, prompt_ids.shape[1]:]
    got = lm.generate(input_ids=prompt_ids, **kw)[0, prompt_ids.shape[1]:]
    assert got.tolist() == want.tolist()
    assert len(set(got.tolist())) > 2  # wide init: greedy output is not one repeated token


def _full_omni_checkpoint(thinker_dir: Path, out: Path) -> None:
    """The tiny thinker as a full Qwen2.5-Omni checkpoint: thinker_config, `thinker.` keys, 2 shards."""
    out.mkdir()
    with safe_open(thinker_dir / "model.safetensors", "pt") as f:
        tensors = {f"thinker.{n}": f.get_tensor(n) for n in f.keys()}
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        file = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    thinker_config = json.loads((thinker_dir / "config.json").read_text())
    Qwen2_5OmniConfig(thinker_config=thinker_config).save_pretrained(out)
    AutoTokenizer.from_pretrained(thinker_dir).save_pretrained(out)


def test_export_reads_a_full_omni_checkpoint_and_shards(thinker_dir: Path, lm, prompt_ids,
                                                        tmp_path: Path) -> None:
    full = tmp_path / "omni"
    _full_omni_checkpoint(thinker_dir, full)
    out = tmp_path / "lm"
    to.export_thinker_lm(full, out, max_shard_bytes=2**20)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not any(n.startswith(("thinker.", "visual.", "audio_tower.")) for n in index["weight_map"])
    sharded = Qwen2ForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(sharded(input_ids=prompt_ids).logits, lm(input_ids=prompt_ids).logits,
                                   atol=0, rtol=0)


def test_export_rejects_a_non_omni_checkpoint(lm_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="thinker"):
        to.export_thinker_lm(lm_dir, tmp_path / "out")

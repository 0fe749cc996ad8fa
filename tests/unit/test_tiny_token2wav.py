"""The tiny Qwen2.5-Omni Token2Wav checkpoint: it loads the way a real one does and keeps the real timing.

Builds the checkpoint once (under a second) and decodes with the library's own
`Qwen2_5OmniToken2WavModel.forward`, so these tests say nothing about the stage.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omni_tools import tiny_token2wav as tt

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("token2wav")
    tt.build_token2wav(out)
    return out


@pytest.fixture(scope="module")
def model(folder):
    from transformers import Qwen2_5OmniToken2WavModel

    return Qwen2_5OmniToken2WavModel.from_pretrained(folder).eval()


def test_folder_holds_a_checkpoint_and_two_voices(folder):
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", tt.SPEAKERS_FILE, tt.SPEAKERS_INDEX} <= names
    assert sum(p.stat().st_size for p in folder.iterdir()) < 2_000_000


def test_config_keeps_the_real_codec_and_timing_layout(model):
    dit, voc = model.config.dit_config, model.config.bigvgan_config
    assert dit.num_embeds == 512 + 1  # as 8193 for the real 8192 codes
    assert model.code2wav_dit_model.text_embed.codec_embed.num_embeddings == 512 + 2
    assert dit.repeats == 2 and dit.block_size == 24 and dit.mel_dim == 80
    assert list(voc.upsample_rates) == [5, 3, 2, 2, 2, 2] and math.prod(voc.upsample_rates) == 240
    assert dit.num_hidden_layers == 2 and dit.hidden_size == 32


def test_speakers_file_has_cond_and_ref_mel_per_voice(folder, model):
    index = json.loads((folder / tt.SPEAKERS_INDEX).read_text())
    assert index == {"speakers": ["Chelsie", "Ethan"], "default": "Chelsie", "sample_rate": 24000}
    tensors = load_file(str(folder / tt.SPEAKERS_FILE))
    assert sorted(tensors) == ["Chelsie.cond", "Chelsie.ref_mel", "Ethan.cond", "Ethan.ref_mel"]
    dit = model.config.dit_config
    for name in index["speakers"]:
        assert tensors[f"{name}.cond"].shape == (1, dit.enc_emb_dim)
        assert tensors[f"{name}.ref_mel"].shape == (1, tt.REF_MEL_FRAMES, dit.mel_dim)
    assert not torch.equal(tensors["Chelsie.cond"], tensors["Ethan.cond"])


def test_library_forward_gives_480_samples_per_code_of_audible_audio(folder, model):
    voices = load_file(str(folder / tt.SPEAKERS_FILE))
    codes = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    with torch.no_grad():
        wave = model(codes, voices["Ethan.cond"], voices["Ethan.ref_mel"], num_steps=3)
    assert wave.shape == (20 * 480,)
    assert torch.isfinite(wave).all() and wave.abs().max() <= 1.0
    assert 0.02 < wave.pow(2).mean().sqrt() < 0.5  # neither silent nor clipped


def test_builds_are_identical(folder, tmp_path):
    tt.build_token2wav(tmp_path)
    for name in ("model.safetensors", tt.SPEAKERS_FILE):
        a, b = load_file(str(folder / name)), load_file(str(tmp_path / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="codec_vocab=1"):
        tt.build_token2wav(tmp_path, codec_vocab=1)
    voice = {"cond": torch.zeros(1, 4), "ref_mel": torch.zeros(1, 8, 80)}
    with pytest.raises(ValueError, match="'Nobody' is not one of"):
        tt.write_speakers(tmp_path, {"A": voice}, default="Nobody")

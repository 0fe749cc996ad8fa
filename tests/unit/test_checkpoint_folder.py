"""`omni-gen-repo --preset omni-chat --model DIR`: a Qwen2.5-Omni folder as the hub ships it,
checked (model type, the parts the stages need) and put into the preset."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from omni_tools import checkpoint
from omni_tools import tiny_models as tm
from omni_tools.gen_repo import main


@pytest.fixture(scope="module")
def omni_dir() -> Path:
    return tm.ensure_model("qwen2.5-omni-tiny")


def _copy_without(src: Path, out: Path, prefix: str | None = None, drop_file: str | None = None) -> Path:
    out.mkdir()
    for path in src.iterdir():
        if path.is_file() and path.name != drop_file and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not (prefix and k.startswith(prefix))},
              str(out / "model.safetensors"))
    return out


def run(argv, capsys) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_every_stage_reads_its_part_of_the_one_folder(omni_dir, tmp_path, capsys):
    code, text = run(["--preset", "omni-chat", "--model", omni_dir, "-o", tmp_path / "repo"], capsys)
    assert code == 0, text
    repo = tmp_path / "repo"
    for stage in ("llm", "image_encoder", "audio_encoder"):
        engine = json.loads((repo / stage / "engine.json").read_text())
        assert engine["model"] == str(omni_dir), stage
    # the tiny model's own talker is not the checkpoint's: left out with the audio decoder, roles too
    assert not (repo / "talker").exists() and not (repo / "audio_decoder").exists()
    roles = json.loads((repo / "omni" / "engine.json").read_text())["stages"]
    assert "talker" not in roles and "audio_decoder" not in roles
    assert roles["thinker"] == "llm" and roles["image_encoder"] == "image_encoder"


def test_a_folder_of_another_model_is_refused_naming_its_type(omni_dir, capsys):
    code, text = run(["--preset", "omni-chat", "--model", omni_dir / "talker", "--check"], capsys)
    assert code == 2
    assert "model_type is 'qwen2'; omni-chat serves a Qwen2.5-Omni checkpoint" in text


@pytest.mark.parametrize("prefix, drop, message", [
    ("thinker.visual.", None, "no thinker.visual.* weights, which the image_encoder stage needs"),
    ("thinker.audio_tower.", None,
     "no thinker.audio_tower.* weights, which the audio_encoder stage needs"),
    (None, "preprocessor_config.json", "no preprocessor_config.json, which the image_encoder"),
])
def test_a_folder_missing_a_part_is_refused_naming_it(omni_dir, tmp_path, capsys, prefix, drop,
                                                      message):
    folder = _copy_without(omni_dir, tmp_path / "ckpt", prefix, drop)
    code, text = run(["--preset", "omni-chat", "--model", folder, "--check"], capsys)
    assert code == 2 and message in text, text


def test_model_needs_a_preset(omni_dir, tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("pipeline: x\nstages: {}\n")
    code, text = run([spec, "--model", omni_dir, "--check"], capsys)
    assert code == 2 and "--model goes with --preset" in text


def _preset_with_the_checkpoint_talker(omni_dir: Path) -> dict:
    """omni-chat's stages, its talker also reading the preset's own checkpoint (as the real talker will)."""
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "model_repository" / "specs"
                           / "omni-chat.yaml").read_text())
    data["stages"]["talker"]["model"] = data["stages"]["llm"]["model"]
    return data


def test_the_audio_decoder_reads_the_checkpoint_token2wav_and_voices(omni_dir, tmp_path):
    data, problems = checkpoint.point_preset_at(_preset_with_the_checkpoint_talker(omni_dir), omni_dir)
    assert problems == [] and data["stages"]["audio_decoder"]["model"] == str(omni_dir)
    assert data["stages"]["omni"]["engine_args"]["stages"]["audio_decoder"] == "audio_decoder"
    folder = _copy_without(omni_dir, tmp_path / "ckpt", "token2wav.", "spk_dict.pt")
    _, problems = checkpoint.point_preset_at(_preset_with_the_checkpoint_talker(omni_dir), folder)
    assert problems == [f"{folder}: no token2wav.* weights, which the audio_decoder stage needs",
                        f"{folder}: no spk_dict.pt, which the audio_decoder stage needs"]

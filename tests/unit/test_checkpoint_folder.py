"""`omni-gen-repo --preset omni-chat --model DIR`: a Qwen2.5-Omni folder as the hub ships it,
checked (model type, the parts the stages need) and put into the preset."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

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
    # the tiny model's own speech path is not the checkpoint's: left out, and so its roles
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

"""`omni-gen-repo --preset omni-chat --model DIR`: a Qwen2.5-Omni folder as the hub ships it,
checked (model type, the parts the stages need) and put into the preset."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from omni_tools import checkpoint, gen_repo
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


SPEECH_STAGES = ("talker", "audio_decoder")


def test_every_stage_reads_its_part_of_the_one_folder(omni_dir, tmp_path, capsys):
    code, text = run(["--preset", "omni-chat", "--model", omni_dir, "-o", tmp_path / "repo"], capsys)
    assert code == 0, text
    repo = tmp_path / "repo"
    for stage in ("llm", "image_encoder", "audio_encoder", "talker", "audio_decoder"):
        engine = json.loads((repo / stage / "engine.json").read_text())
        assert engine["model"] == str(omni_dir), stage
    assert "backend: \"omni_talker\"" in (repo / "talker" / "config.pbtxt").read_text()
    omni = json.loads((repo / "omni" / "engine.json").read_text())
    assert omni["stages"]["talker"] == "talker" and omni["stages"]["audio_decoder"] == "audio_decoder"
    assert omni["stages"]["thinker"] == "llm" and omni["stages"]["image_encoder"] == "image_encoder"
    # the chunk context of the folder's own Token2Wav (dit_context_codes of the tiny default)
    assert (omni["left_context_codes"], omni["right_context_codes"], omni["align_codes"]) == (
        21, 32, 12)


def test_the_decoder_context_comes_from_the_checkpoint_or_its_token2wav_folder(omni_dir, tmp_path):
    want = {"left_context_codes": 21, "right_context_codes": 32, "align_codes": 12}
    assert gen_repo._decoder_context(omni_dir) == want  # token2wav_config of the whole model
    assert gen_repo._decoder_context(omni_dir / "token2wav") == want  # a Token2Wav's own config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert gen_repo._decoder_context(tmp_path) == {}  # no DiT: the orchestrator's defaults
    assert gen_repo._decoder_context(tmp_path / "missing") == {}


def test_a_folder_of_another_model_is_refused_naming_its_type_and_the_families(omni_dir, tmp_path,
                                                                                capsys):
    folder = tmp_path / "qwen2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    code, text = run(["--preset", "omni-chat", "--model", folder, "--check"], capsys)
    assert code == 2
    assert "model_type 'qwen2' is not a model family this server serves" in text
    assert "supported: qwen2_5_omni (Qwen2.5-Omni: model_type qwen2_5_omni" in text


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


def _preset() -> dict:
    return yaml.safe_load((Path(__file__).resolve().parents[2] / "model_repository" / "specs"
                           / "omni-chat.yaml").read_text())


def test_the_speech_stages_read_the_checkpoints_talker_token2wav_and_voices(omni_dir):
    data, problems = checkpoint.point_preset_at(_preset(), omni_dir)
    assert problems == []
    for stage in SPEECH_STAGES:
        assert data["stages"][stage]["model"] == str(omni_dir)
        assert data["stages"]["omni"]["engine_args"]["stages"][stage] == stage


@pytest.mark.parametrize("prefix, drop", [
    ("token2wav.", None), ("talker.", None), (None, "spk_dict.pt"), ("token2wav.", "spk_dict.pt"),
])
def test_a_folder_without_the_speech_parts_serves_text_only(omni_dir, tmp_path, prefix, drop):
    folder = _copy_without(omni_dir, tmp_path / "ckpt", prefix, drop)
    data, problems = checkpoint.point_preset_at(_preset(), folder)
    assert problems == []
    roles = data["stages"]["omni"]["engine_args"]["stages"]
    for stage in SPEECH_STAGES:  # both go, with their roles: audio out fails as "no talker"
        assert stage not in data["stages"] and stage not in roles
    assert data["stages"]["llm"]["model"] == str(folder)
    assert roles["thinker"] == "llm" and roles["audio_encoder"] == "audio_encoder"


def test_a_text_only_folder_generates_a_repository_without_speech(omni_dir, tmp_path, capsys):
    folder = _copy_without(omni_dir, tmp_path / "ckpt", "token2wav.", None)
    code, text = run(["--preset", "omni-chat", "--model", folder, "-o", tmp_path / "repo"], capsys)
    assert code == 0, text
    repo = tmp_path / "repo"
    assert not (repo / "talker").exists() and not (repo / "audio_decoder").exists()
    omni = json.loads((repo / "omni" / "engine.json").read_text())
    assert not set(SPEECH_STAGES) & set(omni["stages"])
    assert "left_context_codes" not in omni and "voices" not in omni
    # the user is told, with what is missing
    assert "note: audio_decoder, talker left out, the repository serves text" in text
    assert "no token2wav.* weights, which the audio_decoder stage needs" in text


def test_a_folder_missing_the_thinker_reports_the_speech_parts_too(omni_dir, tmp_path):
    # not a text-only export: every missing part is named, nothing is quietly left out
    folder = _copy_without(omni_dir, tmp_path / "ckpt", None, "tokenizer_config.json")
    (folder / "spk_dict.pt").unlink()
    data, problems = checkpoint.point_preset_at(_preset(), folder)
    assert f"{folder}: no tokenizer_config.json, which the thinker stage needs" in problems
    assert f"{folder}: no spk_dict.pt, which the audio_decoder stage needs" in problems
    assert all(stage in data["stages"] for stage in SPEECH_STAGES)


def test_a_qwen3_omni_folder_leaves_out_the_stages_its_family_does_without(tmp_path, capsys):
    """Qwen3-Omni's thinker takes images, audio and video raw (no encoder stages); its talker and
    Code2Wav speak, with Code2Wav's chunk context and the talker's speakers in the
    orchestrator's engine.json."""
    from omni_serve.families.qwen3_omni_moe.code2wav_context import chunk_context

    folder = tm.ensure_model("qwen3-omni-tiny")
    code, text = run(["--preset", "omni-chat", "--model", folder, "-o", tmp_path / "repo"], capsys)
    assert code == 0, text
    repo = tmp_path / "repo"
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == [
        "audio_decoder", "llm", "omni", "talker", "text_to_image"]
    omni = json.loads((repo / "omni" / "engine.json").read_text())
    assert omni["family"] == "qwen3_omni_moe"
    assert omni["stages"] == {"thinker": "llm", "talker": "talker", "audio_decoder": "audio_decoder",
                              "image_generator": "text_to_image"}
    config = json.loads((Path(folder) / "config.json").read_text())
    context = chunk_context(config)
    assert (omni["left_context_codes"], omni["right_context_codes"], omni["align_codes"]) == (
        context.left, 0, 1)
    assert omni["voices"] == list(config["talker_config"]["speaker_id"])
    for stage in ("llm", "talker", "audio_decoder"):
        assert json.loads((repo / stage / "engine.json").read_text())["model"] == str(folder)
    # its thinker takes a request's video (the Qwen2.5-Omni preset's takes none)
    assert json.loads((repo / "llm" / "engine.json").read_text())["limit_mm_per_prompt"] == {
        "image": 1, "audio": 16, "video": 1}


def test_a_qwen3_omni_thinking_folder_serves_text_without_the_speech_stages(tmp_path, capsys):
    folder = tm.ensure_model("qwen3-omni-thinking-tiny")  # enable_audio_output false, no talker
    code, text = run(["--preset", "omni-chat", "--model", folder, "-o", tmp_path / "repo"], capsys)
    assert code == 0, text
    repo = tmp_path / "repo"
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["llm", "omni", "text_to_image"]
    assert "note: audio_decoder, talker left out, the repository serves text" in text
    assert "no talker.* weights, which the talker stage needs" in text


def test_a_built_in_tiny_checkpoint_is_named_tiny_colon_name(tmp_path, capsys):
    """`make serve MODEL=tiny:qwen3-omni-tiny`: the folder is built once and every stage
    reads it; an unknown name is an error naming --model."""
    code, text = run(["--preset", "omni-chat", "--model", "tiny:qwen3-omni-tiny",
                      "-o", tmp_path / "repo"], capsys)
    assert code == 0, text
    folder = tm.ensure_model("qwen3-omni-tiny")
    for stage in ("llm", "talker", "audio_decoder"):
        engine = json.loads((tmp_path / "repo" / stage / "engine.json").read_text())
        assert engine["model"] == str(folder)
    code, text = run(["--preset", "omni-chat", "--model", "tiny:no-such-model",
                      "-o", tmp_path / "other"], capsys)
    assert code == 2 and "--model" in text and "no-such-model" in text

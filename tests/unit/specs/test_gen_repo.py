"""omni-gen-repo: the configs it builds, the files it writes, and what it refuses to do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from omni_serve.contract import CONTRACTS, ENGINE_ARGS_FILE, LLM_CONTRACT
from omni_tools import gen_repo
from omni_tools import spec as spec_mod
from omni_tools.gen_repo import (
    GENERATOR_VERSION,
    MANIFEST_FILE,
    RepoError,
    build_model_config,
    generate,
    main,
)
from omni_tools.spec import SpecError, load_preset, load_spec

try:  # the real builder, kept before the autouse fixture below replaces it
    import omni_tools.tiny_models as REAL_TINY_MODELS
except ImportError:
    REAL_TINY_MODELS = None
from .conftest import REAL_ENGINE_ARG_NAMES


def stage_data(model: str = "tiny:qwen2-tiny", **extra) -> dict:
    return {"backend": "omni_llm", "model": model,
            "engine_args": {"max_model_len": 2048, "enforce_eager": True}, **extra}


def write_spec(folder: Path, stages: dict | None = None, name: str = "spec.yaml",
               **top) -> Path:
    data = {"pipeline": "text-chat", "stages": stages or {"llm": stage_data()}, **top}
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- config.pbtxt --------------------------------------------------------------

def test_the_llm_config_takes_its_tensors_from_the_contract():
    config = build_model_config("llm", load_preset("text-chat").stages["llm"])
    DataType = model_config_pb2.DataType
    inputs = [(t.name, DataType.Name(t.data_type), tuple(t.dims), t.optional)
              for t in config.input]
    outputs = [(t.name, DataType.Name(t.data_type), tuple(t.dims)) for t in config.output]
    assert inputs == [(t.name, t.data_type, t.dims, t.optional) for t in LLM_CONTRACT.inputs]
    assert outputs == [(t.name, t.data_type, t.dims) for t in LLM_CONTRACT.outputs]


def test_the_llm_config_is_a_decoupled_unbatched_omni_llm_model():
    config = build_model_config("chat", load_preset("text-chat").stages["llm"])
    assert config.name == "chat"
    assert config.backend == "omni_llm"
    assert config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled is True
    (group,) = config.instance_group
    assert (group.count, model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)) == (
        1, "KIND_MODEL")
    assert list(group.gpus) == []


def test_gpu_instances_list_their_gpus(tmp_path):
    stage = stage_data(instances={"count": 2, "kind": "KIND_GPU", "gpus": [0, 3]})
    spec = load_spec(write_spec(tmp_path, {"llm": stage}))
    (group,) = build_model_config("llm", spec.stages["llm"]).instance_group
    assert (group.count, group.kind, list(group.gpus)) == (
        2, model_config_pb2.ModelInstanceGroup.KIND_GPU, [0, 3])


def test_every_known_backend_has_a_contract():
    assert set(CONTRACTS) >= {"omni_llm"}


# --- generated files -----------------------------------------------------------

def test_generate_writes_config_engine_json_and_version_dir(tmp_path, fake_tiny_models):
    spec = load_preset("text-chat")
    out = tmp_path / "repo"
    generate(spec, out)
    assert files_under(out) == {MANIFEST_FILE, "llm", "llm/config.pbtxt",
                                f"llm/{ENGINE_ARGS_FILE}", "llm/1"}
    assert list((out / "llm" / "1").iterdir()) == []
    assert fake_tiny_models.built == ["qwen2-tiny"]


def test_config_pbtxt_parses_back_to_the_built_proto(tmp_path):
    spec = load_preset("text-chat")
    out = tmp_path / "repo"
    generate(spec, out)
    parsed = text_format.Parse((out / "llm" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert parsed == build_model_config("llm", spec.stages["llm"])
    assert [t.name for t in parsed.input] == [t.name for t in LLM_CONTRACT.inputs]
    assert [t.name for t in parsed.output] == [t.name for t in LLM_CONTRACT.outputs]


def test_engine_json_is_the_absolute_model_path_then_the_engine_args(tmp_path, model_dir,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_spec(write_spec(model_dir.parent, {"llm": stage_data("chat-model")}))
    out = tmp_path / "repo"
    generate(spec, out)
    text = (out / "llm" / ENGINE_ARGS_FILE).read_text()
    assert json.loads(text) == {"model": str(model_dir.resolve()), "max_model_len": 2048,
                                "enforce_eager": True}
    assert list(json.loads(text)) == ["model", "max_model_len", "enforce_eager"]
    assert text.endswith("}\n") and "\n  " in text  # pretty-printed


def test_a_tiny_model_resolves_to_the_built_checkpoint(tmp_path, fake_tiny_models):
    out = tmp_path / "repo"
    generate(load_spec(write_spec(tmp_path)), out)
    model = Path(json.loads((out / "llm" / ENGINE_ARGS_FILE).read_text())["model"])
    assert model.is_absolute() and (model / "config.json").is_file()
    assert model.name == "qwen2-tiny"


def test_the_manifest_records_the_spec_and_generator(tmp_path):
    out = tmp_path / "repo"
    generate(load_preset("text-chat"), out)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["generator"] == "omni-gen-repo"
    assert manifest["generator_version"] == GENERATOR_VERSION
    assert manifest["pipeline"] == "text-chat"
    assert manifest["spec"] == "preset text-chat"
    assert manifest["stages"] == ["llm"]


def test_generate_leaves_no_temporary_folders_beside_the_output(tmp_path):
    generate(load_preset("text-chat"), tmp_path / "repo")
    generate(load_preset("text-chat"), tmp_path / "repo")
    assert sorted(os.listdir(tmp_path)) == ["repo"]


# --- nothing written on failure --------------------------------------------------

def test_nothing_is_written_when_the_spec_became_invalid(tmp_path, fake_tiny_models):
    spec = load_spec(write_spec(tmp_path))
    spec.stages["llm"].engine_args["max_modle_len"] = 1
    with pytest.raises(SpecError, match=r"stages\.llm\.engine_args\.max_modle_len"):
        generate(spec, tmp_path / "repo")
    assert sorted(os.listdir(tmp_path)) == ["spec.yaml"]
    assert fake_tiny_models.built == []


def test_nothing_is_written_when_the_model_dir_vanished(tmp_path, model_dir):
    spec = load_spec(write_spec(tmp_path, {"llm": stage_data(str(model_dir))}))
    (model_dir / "config.json").unlink()
    with pytest.raises(SpecError, match=r"stages\.llm\.model: .*has no config\.json"):
        generate(spec, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_nothing_is_written_when_a_tiny_model_fails_to_build(tmp_path, fake_tiny_models,
                                                            model_dir):
    def broken(name):
        raise RuntimeError("out of disk")

    fake_tiny_models.ensure_model = broken
    stages = {"a": stage_data(str(model_dir)), "b": stage_data()}
    spec = load_spec(write_spec(tmp_path, stages, entry="a"))
    with pytest.raises(RuntimeError, match="out of disk"):
        generate(spec, tmp_path / "repo")
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "spec.yaml"]


def test_a_failed_write_leaves_the_previous_output_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "repo"
    generate(load_preset("text-chat"), out)
    before = {p: (out / p).read_bytes() for p in files_under(out) if (out / p).is_file()}

    def half_write(root, plans, manifest, source):
        (root / "llm").mkdir()
        (root / "llm" / "config.pbtxt").write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(gen_repo, "_write_tree", half_write)
    with pytest.raises(OSError, match="disk full"):
        generate(load_preset("text-chat"), out)
    assert {p: (out / p).read_bytes() for p in before} == before
    assert sorted(os.listdir(tmp_path)) == ["repo"]


# --- the output folder ---------------------------------------------------------

def test_a_foreign_non_empty_folder_is_refused(tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RepoError, match=r"not empty and was not written by omni-gen-repo.*--force"):
        generate(load_preset("text-chat"), out)
    assert os.listdir(out) == ["notes.txt"]


def test_force_writes_into_a_foreign_folder_and_keeps_other_entries(tmp_path):
    out = tmp_path / "repo"
    (out / "llm").mkdir(parents=True)
    (out / "llm" / "old.txt").write_text("old")
    (out / "notes.txt").write_text("mine")
    generate(load_preset("text-chat"), out, force=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "llm" / "old.txt").exists()
    assert (out / "llm" / "config.pbtxt").is_file()


def test_an_empty_existing_folder_is_used(tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    generate(load_preset("text-chat"), out)
    assert (out / "llm" / "config.pbtxt").is_file()


def test_a_file_as_output_is_refused(tmp_path):
    (tmp_path / "repo").write_text("")
    with pytest.raises(RepoError, match="is not a directory"):
        generate(load_preset("text-chat"), tmp_path / "repo")


def test_a_previous_output_is_replaced_and_its_stale_stages_removed(tmp_path, model_dir):
    out = tmp_path / "repo"
    two = {"a": stage_data(str(model_dir)), "b": stage_data(str(model_dir))}
    generate(load_spec(write_spec(tmp_path, two, entry="a")), out)
    (out / "notes.txt").write_text("added by hand")

    one = {"a": stage_data(str(model_dir), engine_args={"max_model_len": 512})}
    generate(load_spec(write_spec(tmp_path, one, name="one.yaml")), out)
    assert sorted(os.listdir(out)) == [MANIFEST_FILE, "a", "notes.txt"]
    assert json.loads((out / "a" / ENGINE_ARGS_FILE).read_text())["max_model_len"] == 512
    assert json.loads((out / MANIFEST_FILE).read_text())["stages"] == ["a"]


def test_a_previous_output_does_not_overwrite_a_foreign_entry_without_force(tmp_path, model_dir):
    out = tmp_path / "repo"
    generate(load_spec(write_spec(tmp_path, {"a": stage_data(str(model_dir))})), out)
    (out / "b").mkdir()
    stages = {"a": stage_data(str(model_dir)), "b": stage_data(str(model_dir))}
    with pytest.raises(RepoError, match=r"repo/b exists and was not written by omni-gen-repo"):
        generate(load_spec(write_spec(tmp_path, stages, name="two.yaml", entry="a")), out)
    assert os.listdir(out / "b") == []


# --- command line --------------------------------------------------------------

def test_cli_writes_a_preset(tmp_path, capsys):
    code, out, err = run_cli(["--preset", "text-chat", "-o", tmp_path / "repo"], capsys)
    assert code == 0, err
    assert (tmp_path / "repo" / "llm" / "config.pbtxt").is_file()
    assert f"wrote {tmp_path / 'repo'}" in out


def test_cli_writes_a_spec_file(tmp_path, capsys):
    code, _, err = run_cli([write_spec(tmp_path), "-o", tmp_path / "repo"], capsys)
    assert code == 0, err
    assert (tmp_path / "repo" / "llm" / ENGINE_ARGS_FILE).is_file()


def test_cli_check_validates_and_writes_nothing(tmp_path, capsys, monkeypatch, fake_tiny_models):
    spec_path = write_spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["--check", spec_path], capsys)
    assert code == 0, err
    assert out.startswith("OK")
    assert sorted(os.listdir(tmp_path)) == ["spec.yaml"]
    assert fake_tiny_models.built == []


def test_cli_check_reports_problems_with_exit_code_2(tmp_path, capsys):
    spec_path = write_spec(tmp_path, {"llm": stage_data(max_batch_size=4)})
    code, out, err = run_cli(["--check", spec_path], capsys)
    assert code == 2
    assert out == ""
    assert err.startswith(f"omni-gen-repo: error: {spec_path}: 1 problem\n")
    assert "  stages.llm.max_batch_size: must be 0 for backend omni_llm" in err


def test_cli_check_runs_the_stage_config_classes_as_generation_does(tmp_path, capsys,
                                                                   fake_tiny_models):
    """One validator: a value the DiT stage's own config refuses fails --check, not only
    generation (issue 14), and no tiny model is built for it."""
    spec_path = write_spec(tmp_path, {"dit": {
        "backend": "omni_dit", "model": "tiny:qwen2-tiny",
        "engine_args": {"default_height": 100, "max_side": 512}}})
    code, out, err = run_cli(["--check", spec_path], capsys)
    assert code == 2 and out == ""
    assert ("stages.dit.engine_args: default_height=100 must be a multiple of 16 between 16 and "
            "max_side=512") in err
    assert fake_tiny_models.built == []


def test_cli_reports_a_bad_spec_with_exit_code_2_and_writes_nothing(tmp_path, capsys):
    spec_path = write_spec(tmp_path, {"llm": stage_data(engine_args={"max_modle_len": 1})})
    code, _, err = run_cli([spec_path, "-o", tmp_path / "repo"], capsys)
    assert code == 2
    assert "stages.llm.engine_args.max_modle_len: unknown vLLM engine argument; " \
           "did you mean max_model_len?" in err
    assert "Traceback" not in err
    assert not (tmp_path / "repo").exists()


def test_cli_refuses_a_foreign_folder_with_exit_code_2(tmp_path, capsys):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "notes.txt").write_text("mine")
    code, _, err = run_cli(["--preset", "text-chat", "-o", tmp_path / "repo"], capsys)
    assert code == 2
    assert err.startswith("omni-gen-repo: error: ") and "--force" in err
    code, _, err = run_cli(["--preset", "text-chat", "-o", tmp_path / "repo", "--force"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("argv, message", [
    (["--preset", "text-chat"], "-o/--output DIR is required"),
    ([], "give either a spec file or --preset NAME"),
    (["spec.yaml", "--preset", "text-chat", "-o", "x"], "give either a spec file or --preset"),
    (["--check", "--preset", "text-chat", "-o", "x"], "--check writes nothing"),
    (["--preset", "nope", "-o", "x"], "unknown preset 'nope'; presets: "),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_cli_usage_errors_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert "omni-gen-repo: error: " in err and message in err
    assert os.listdir(tmp_path) == []


def test_cli_lists_presets(capsys):
    code, out, _ = run_cli(["--list-presets"], capsys)
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert names == ["omni-chat", "text-chat", "text-to-image"]


def test_the_cli_process_exits_2_without_a_traceback(tmp_path):
    spec_path = write_spec(tmp_path, {"llm": {"backend": "omni_llm", "model": "missing"}})
    argv = [sys.executable, "-m", "omni_tools.gen_repo", str(spec_path),
            "-o", str(tmp_path / "repo")]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("omni-gen-repo: error: ")
    assert "stages.llm.model: model directory" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- with the real vLLM and tiny-model builder ------------------------------------

def test_the_preset_generates_with_the_real_tiny_model_and_vllm_accepts_it(tmp_path,
                                                                          monkeypatch):
    if REAL_TINY_MODELS is None or REAL_ENGINE_ARG_NAMES() is None:
        pytest.skip("omni_tools.tiny_models or vLLM is not importable")
    monkeypatch.setitem(sys.modules, "omni_tools.tiny_models", REAL_TINY_MODELS)
    monkeypatch.setattr(spec_mod, "vllm_engine_arg_names", REAL_ENGINE_ARG_NAMES)
    from vllm.engine.arg_utils import AsyncEngineArgs

    out = tmp_path / "repo"
    generate(load_preset("text-chat"), out)
    engine = json.loads((out / "llm" / ENGINE_ARGS_FILE).read_text())
    assert (Path(engine["model"]) / "config.json").is_file()
    config = AsyncEngineArgs(**engine).create_engine_config()
    assert config.model_config.max_model_len == 2048
    assert config.scheduler_config.max_num_seqs == 64

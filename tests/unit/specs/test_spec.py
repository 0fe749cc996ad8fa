"""Pipeline specs: what loads, and that every bad spec names the key and what is allowed."""
from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from omni_serve.contract import CONTRACTS
from omni_tools import spec as spec_mod
from omni_tools.spec import SpecError, list_presets, load_preset, load_spec, parse_spec

from .conftest import REAL_ENGINE_ARG_NAMES


def base_spec(model: str = "tiny:qwen2-tiny") -> dict:
    return {
        "pipeline": "text-chat",
        "stages": {
            "llm": {
                "backend": "omni_llm",
                "model": model,
                "engine_args": {"max_model_len": 2048, "enforce_eager": True},
                "instances": {"count": 1, "kind": "KIND_MODEL"},
            }
        },
    }


def write_spec(tmp_path: Path, data: dict | str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def problems_of(tmp_path: Path, data: dict | str) -> list[str]:
    with pytest.raises(SpecError) as excinfo:
        load_spec(write_spec(tmp_path, data))
    return excinfo.value.problems


def only_problem(tmp_path: Path, data: dict | str) -> str:
    problems = problems_of(tmp_path, data)
    assert len(problems) == 1, problems
    return problems[0]


# --- specs that load -----------------------------------------------------------

def test_the_text_chat_preset_loads_with_one_llm_stage():
    spec = load_preset("text-chat")
    assert spec.pipeline == "text-chat"
    assert list(spec.stages) == ["llm"]
    assert spec.entry == "llm"
    stage = spec.stages["llm"]
    assert stage.backend == "omni_llm"
    assert stage.model == "tiny:qwen2-tiny"
    assert stage.engine_args == {"max_model_len": 2048, "enforce_eager": True,
                                 "max_num_seqs": 64, "dtype": "float32"}
    assert stage.effective_max_batch_size == 0
    assert spec.source == "preset text-chat"


def test_the_preset_engine_args_are_real_vllm_engine_args():
    names = REAL_ENGINE_ARG_NAMES()
    if names is None:
        pytest.skip("vLLM is not importable")
    stage = load_preset("text-chat").stages["llm"]
    assert set(stage.engine_args) <= names


def test_the_engine_arg_names_read_from_vllms_source_are_its_dataclass_fields():
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    REAL_ENGINE_ARG_NAMES.cache_clear()
    want = frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))
    assert REAL_ENGINE_ARG_NAMES() == want and "max_model_len" in want


def test_dataclass_field_names_follows_bases_and_skips_class_and_init_vars():
    source = """
from dataclasses import InitVar, dataclass
from typing import ClassVar
@dataclass
class Base:
    a: int = 1
    shared: ClassVar[int] = 0
    def method(self) -> None:
        x: int = 2
@dataclass
class Child(Base):
    b: "str | None" = None
    c: InitVar[int] = 0
class Foreign(dict):
    d: int = 0
"""
    assert spec_mod.dataclass_field_names(source, "Child") == {"a", "b"}
    with pytest.raises(KeyError, match="dict"):
        spec_mod.dataclass_field_names(source, "Foreign")
    with pytest.raises(KeyError):
        spec_mod.dataclass_field_names(source, "Missing")


def test_list_presets_finds_text_chat():
    assert "text-chat" in list_presets()


def test_an_unknown_preset_lists_the_presets():
    with pytest.raises(SpecError, match=r"unknown preset 'nope'; presets: .*text-chat"):
        load_preset("nope")


def test_backend_choices_match_the_stage_contracts():
    assert set(typing.get_args(spec_mod.Backend)) == set(CONTRACTS)


def test_defaults_are_one_model_instance_and_the_only_stage_as_entry(tmp_path):
    data = base_spec()
    del data["stages"]["llm"]["instances"], data["stages"]["llm"]["engine_args"]
    spec = load_spec(write_spec(tmp_path, data))
    stage = spec.stages["llm"]
    assert (stage.instances.count, stage.instances.kind, stage.instances.gpus) == (
        1, "KIND_MODEL", [])
    assert stage.engine_args == {}
    assert spec.entry == "llm"


def test_a_relative_model_path_is_relative_to_the_spec_file(tmp_path, model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    spec_path = write_spec(model_dir.parent, base_spec("chat-model"))
    spec = load_spec(spec_path)
    assert spec.base_dir == model_dir.parent.resolve()


def test_env_vars_and_home_are_expanded_in_model_paths(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("MODELS", str(model_dir.parent))
    load_spec(write_spec(tmp_path, base_spec("$MODELS/chat-model")))
    monkeypatch.setenv("HOME", str(model_dir.parent))
    load_spec(write_spec(tmp_path, base_spec("~/chat-model")))


def test_gpus_are_allowed_with_kind_gpu(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["instances"] = {"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}
    assert load_spec(write_spec(tmp_path, data)).stages["llm"].instances.gpus == [0, 1]


def test_max_batch_size_zero_is_accepted_for_omni_llm(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["max_batch_size"] = 0
    assert load_spec(write_spec(tmp_path, data)).stages["llm"].effective_max_batch_size == 0


def test_engine_args_are_not_checked_when_vllm_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(spec_mod, "vllm_engine_arg_names", lambda: None)
    data = base_spec()
    data["stages"]["llm"]["engine_args"] = {"some_future_arg": 1}
    assert load_spec(write_spec(tmp_path, data)).stages["llm"].engine_args == {
        "some_future_arg": 1}


def test_parse_spec_validates_data_that_is_already_parsed(model_dir):
    spec = parse_spec(base_spec("chat-model"), base_dir=model_dir.parent)
    assert spec.stages["llm"].model == "chat-model"


# --- every problem names its key and what is allowed -----------------------------

def test_an_unknown_top_level_key_lists_the_allowed_keys(tmp_path):
    data = base_spec() | {"stagse": {}}
    assert only_problem(tmp_path, data) == (
        "stagse: unknown key; allowed keys here: pipeline, description, servers, stages, entry, "
        "video_limits")


def test_an_unknown_stage_key_lists_the_allowed_keys(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["batching"] = "dynamic"
    assert only_problem(tmp_path, data) == (
        "stages.llm.batching: unknown key; allowed keys here: "
        "backend, model, engine_args, instances, max_batch_size, max_queue_delay_us, "
        "preserve_ordering, queue, server, env, metrics")


def test_an_unknown_instances_key_lists_the_allowed_keys(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["instances"]["devices"] = [0]
    assert only_problem(tmp_path, data) == (
        "stages.llm.instances.devices: unknown key; allowed keys here: count, kind, gpus")


def test_an_unknown_engine_arg_suggests_the_close_match(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["engine_args"] = {"max_modle_len": 2048}
    assert only_problem(tmp_path, data) == (
        "stages.llm.engine_args.max_modle_len: unknown vLLM engine argument; "
        "did you mean max_model_len?")


def test_an_engine_arg_with_no_close_match_points_at_async_engine_args(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["engine_args"] = {"zzz": 1}
    problem = only_problem(tmp_path, data)
    assert problem.startswith("stages.llm.engine_args.zzz: unknown vLLM engine argument")
    assert "AsyncEngineArgs" in problem


def test_model_inside_engine_args_is_refused(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["engine_args"]["model"] = "/models/x"
    problem = only_problem(tmp_path, data)
    assert problem.startswith("stages.llm.engine_args.model: not allowed here")
    assert "`model` key" in problem


def test_an_engine_arg_that_is_not_json_is_refused(tmp_path):
    text = yaml.safe_dump(base_spec(), sort_keys=False).replace(
        "enforce_eager: true", "enforce_eager: true\n      seed: 2024-01-01")
    problem = only_problem(tmp_path, text)
    assert problem.startswith("stages.llm.engine_args.seed: value of type date is not "
                              "JSON-serializable")


@pytest.mark.parametrize("count, fragment", [
    (0, "greater than or equal to 1 (got 0)"),
    ("two", "valid integer (got 'two')"),
    (True, "valid integer (got True)"),
])
def test_a_bad_instance_count_is_refused(tmp_path, count, fragment):
    data = base_spec()
    data["stages"]["llm"]["instances"]["count"] = count
    problem = only_problem(tmp_path, data)
    assert problem.startswith("stages.llm.instances.count: ")
    assert fragment in problem


def test_a_bad_instance_kind_lists_the_kinds(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["instances"]["kind"] = "KIND_TPU"
    assert only_problem(tmp_path, data) == (
        "stages.llm.instances.kind: Input should be 'KIND_MODEL', 'KIND_CPU', 'KIND_GPU' "
        "or 'KIND_AUTO' (got 'KIND_TPU')")


def test_gpus_without_kind_gpu_are_refused(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["instances"]["gpus"] = [0]
    assert only_problem(tmp_path, data) == (
        "stages.llm.instances.gpus: only allowed with kind KIND_GPU (kind is KIND_MODEL); "
        "set kind: KIND_GPU or remove gpus")


def test_a_negative_gpu_id_is_refused(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["instances"] = {"kind": "KIND_GPU", "gpus": [-1]}
    assert only_problem(tmp_path, data).startswith("stages.llm.instances.gpus[0]: ")


def test_a_missing_model_path_is_refused(tmp_path):
    problem = only_problem(tmp_path, base_spec(str(tmp_path / "no-such-model")))
    assert problem.startswith(f"stages.llm.model: model directory {tmp_path / 'no-such-model'} "
                              "does not exist")
    assert "config.json" in problem and "tiny:<name>" in problem


def test_a_model_path_without_config_json_is_refused(tmp_path):
    (tmp_path / "empty-model").mkdir()
    problem = only_problem(tmp_path, base_spec("empty-model"))
    assert problem.startswith(f"stages.llm.model: model directory {tmp_path / 'empty-model'} "
                              "has no config.json")


def test_a_model_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "model.bin").write_text("")
    problem = only_problem(tmp_path, base_spec("model.bin"))
    assert problem.startswith("stages.llm.model: model path ")
    assert "is not a directory" in problem


def test_an_unset_env_var_in_a_model_path_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("OMNI_TEST_UNSET", raising=False)
    problem = only_problem(tmp_path, base_spec("$OMNI_TEST_UNSET/model"))
    assert problem.startswith("stages.llm.model: environment variable OMNI_TEST_UNSET is not set")


def test_an_unknown_tiny_model_lists_the_tiny_models(tmp_path):
    assert only_problem(tmp_path, base_spec("tiny:llama-huge")) == (
        "stages.llm.model: unknown built-in tiny model 'llama-huge'; known: tiny:qwen2-tiny")


def test_max_batch_size_other_than_zero_is_refused_for_omni_llm(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["max_batch_size"] = 8
    problem = only_problem(tmp_path, data)
    assert problem.startswith("stages.llm.max_batch_size: must be 0 for backend omni_llm (got 8)")
    assert "batches requests continuously" in problem


def test_an_unknown_backend_lists_the_backends(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["backend"] = "vllm"
    assert only_problem(tmp_path, data) == (
        "stages.llm.backend: Input should be 'omni_llm', 'omni_talker', 'omni_dit', 'omni_encoder', "
        "'omni_audio' or 'omni_orchestrator' (got 'vllm')")


def test_a_missing_required_key_is_named(tmp_path):
    data = base_spec()
    del data["stages"]["llm"]["backend"]
    assert only_problem(tmp_path, data) == "stages.llm.backend: required key is missing"


def test_an_entry_naming_a_missing_stage_lists_the_stages(tmp_path):
    data = base_spec() | {"entry": "chat"}
    assert only_problem(tmp_path, data) == "entry: no stage named 'chat'; stages: llm"


def test_several_stages_need_an_entry(tmp_path):
    data = base_spec()
    data["stages"]["llm2"] = data["stages"]["llm"]
    assert only_problem(tmp_path, data) == (
        "entry: required with several stages; one of: llm, llm2")


def test_a_bad_pipeline_name_says_what_is_allowed(tmp_path):
    data = base_spec() | {"pipeline": "Text_Chat"}
    assert only_problem(tmp_path, data).startswith("pipeline: must match [a-z0-9-]+")


def test_a_bad_stage_name_says_what_is_allowed(tmp_path):
    data = base_spec()
    data["stages"] = {"my llm": data["stages"]["llm"]}
    data["entry"] = "my llm"
    assert "stages.my llm: stage name must match [A-Za-z0-9_-]+ (it becomes the Triton model " \
           "name)" in problems_of(tmp_path, data)


def test_a_spec_without_stages_is_refused(tmp_path):
    data = base_spec() | {"stages": {}}
    assert only_problem(tmp_path, data) == "stages: at least one stage is required"


def test_a_spec_that_is_not_a_mapping_is_refused(tmp_path):
    assert "the spec must be a mapping" in only_problem(tmp_path, "- llm\n- dit\n")


def test_bad_yaml_names_the_line(tmp_path):
    text = "pipeline: text-chat\nstages:\n  llm: [unclosed\n"
    problem = only_problem(tmp_path, text)
    assert problem.startswith("line 4, column 1: invalid YAML")


def test_a_duplicate_yaml_key_is_refused(tmp_path):
    text = "pipeline: text-chat\npipeline: other\nstages: {}\n"
    problem = only_problem(tmp_path, text)
    assert problem.startswith("line 2, column 1: invalid YAML")
    assert "duplicate key 'pipeline'" in problem


def test_an_unreadable_spec_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(tmp_path / "missing.yaml")


def test_all_problems_are_reported_at_once_one_line_each(tmp_path):
    data = base_spec() | {"extra": 1}
    data["stages"]["llm"]["engine_args"]["max_modle_len"] = 1
    data["stages"]["llm"]["instances"]["count"] = 0
    with pytest.raises(SpecError) as excinfo:
        load_spec(write_spec(tmp_path, data))
    error = excinfo.value
    assert isinstance(error, ValueError)
    assert [p.split(":")[0] for p in error.problems] == [
        "stages.llm.engine_args.max_modle_len", "stages.llm.instances.count", "extra"]
    lines = str(error).splitlines()
    assert lines[0] == f"{tmp_path / 'spec.yaml'}: 3 problems"
    assert [line.strip() for line in lines[1:]] == error.problems


def test_triton_batched_backends_need_a_batch_size_of_at_least_one(tmp_path):
    data = base_spec()
    stage = data["stages"]["llm"]
    stage["backend"] = "omni_dit"
    stage["max_batch_size"] = 0
    stage["engine_args"] = {}
    problems = problems_of(tmp_path, data)
    assert any(p.startswith("stages.llm.max_batch_size: must be at least 1 for backend omni_dit")
               for p in problems), problems


def test_queue_delay_is_refused_for_the_engine_batched_llm(tmp_path):
    data = base_spec()
    data["stages"]["llm"]["max_queue_delay_us"] = 100
    assert only_problem(tmp_path, data).startswith(
        "stages.llm.max_queue_delay_us: not used by backend omni_llm")

"""An orchestrator whose thinker role names several omni_llm engines (session affinity)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_serve.contract import ENGINE_ARGS_FILE
from omni_tools import gen_repo
from omni_tools.spec import parse_spec
from tests.unit.specs.test_spec import problems_of as problems


def _checkpoint(root: Path, name: str) -> str:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return str(path)


def engines_spec(root: Path, thinker) -> dict:
    lm = _checkpoint(root, "lm")
    return {
        "pipeline": "engines",
        "stages": {
            "llm_a": {"backend": "omni_llm", "model": lm, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
            "llm_b": {"backend": "omni_llm", "model": lm, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
            "enc": {"backend": "omni_encoder", "model": lm, "engine_args": {"modality": "image"}},
            "omni": {"backend": "omni_orchestrator",
                     "engine_args": {"stages": {"thinker": thinker}}},
        },
        "entry": "omni",
    }


def test_a_list_of_thinkers_reaches_the_engine_json(tmp_path):
    spec = parse_spec(engines_spec(tmp_path, ["llm_a", "llm_b"]), base_dir=tmp_path)
    gen_repo.generate(spec, tmp_path / "repo")
    engine = json.loads((tmp_path / "repo" / "omni" / ENGINE_ARGS_FILE).read_text())
    assert engine["stages"]["thinker"] == ["llm_a", "llm_b"]
    assert "remote" not in engine


def test_thinkers_on_other_servers_are_each_remote(tmp_path):
    data = engines_spec(tmp_path, ["llm_a", "llm_b"])
    data["servers"] = {"front": {}, "a": {"grpc_url": "host-a:8001"}, "b": {"grpc_url": "host-b:8001"}}
    for name, server in (("llm_a", "a"), ("llm_b", "b"), ("enc", "front"), ("omni", "front")):
        data["stages"][name]["server"] = server
    gen_repo.generate(parse_spec(data, base_dir=tmp_path), tmp_path / "repo")
    engine = json.loads((tmp_path / "repo" / "front" / "omni" / ENGINE_ARGS_FILE).read_text())
    assert {model: remote["url"] for model, remote in engine["remote"].items()} == {
        "llm_a": "host-a:8001", "llm_b": "host-b:8001"}


def test_a_remote_thinker_engine_needs_its_server_url(tmp_path):
    data = engines_spec(tmp_path, ["llm_a", "llm_b"])
    data["servers"] = {"front": {}, "b": {}}
    for name, server in (("llm_a", "front"), ("llm_b", "b"), ("enc", "front"), ("omni", "front")):
        data["stages"][name]["server"] = server
    assert problems(tmp_path, data) == [
        "servers.b.grpc_url: required: stage 'llm_b' (thinker) on server 'b' is called by 'omni' "
        "on server 'front'"]


WHERE = "stages.omni.engine_args.stages"


@pytest.mark.parametrize("roles,expected", [
    ({"thinker": []}, [f"{WHERE}.thinker: an empty list; name at least one omni_llm stage"]),
    ({"thinker": ["llm_a", "nope"]},
     [f"{WHERE}.thinker[1]: no stage named 'nope'; stages: llm_a, llm_b, enc, omni"]),
    ({"thinker": ["llm_a", "enc"]},
     [f"{WHERE}.thinker[1]: stage 'enc' has backend omni_encoder; the thinker role needs omni_llm"]),
    ({"thinker": ["llm_a", "llm_a"]}, [f"{WHERE}.thinker[1]: stage 'llm_a' is named twice"]),
    ({"thinker": ["llm_a", 3]}, [f"{WHERE}.thinker[1]: must be a stage name (got 3)"]),
    ({"thinker": "llm_a", "image_encoder": ["enc"]},
     [f"{WHERE}.image_encoder: one stage name (only the thinker role takes a list)"]),
])
def test_bad_thinker_lists_name_the_key(tmp_path, roles, expected):
    data = engines_spec(tmp_path, None)
    data["stages"]["omni"]["engine_args"]["stages"] = roles
    assert problems(tmp_path, data) == expected


@pytest.mark.parametrize("roles", [
    {"thinker": []}, {"thinker": ["llm_a", "llm_a"]}, {"thinker": ["llm_a", 3]},
    {"thinker": "llm_a", "image_encoder": ["enc"]}, {"thinker": "llm_a", "painter": "enc"},
    {"image_encoder": "enc"},
])
def test_the_spec_and_the_orchestrator_apply_one_set_of_role_rules(tmp_path, roles):
    """Issue 14: the orchestrator's config is the single validator of its roles; the spec
    check reports the very same problems, at the spec's path."""
    from pydantic import ValidationError

    from omni_serve.orchestrator.config import OrchestratorConfig

    data = engines_spec(tmp_path, None)
    data["stages"]["omni"]["engine_args"]["stages"] = roles
    from_spec = [p.removeprefix(f"{WHERE}.").replace("[1]", ".1") for p in problems(tmp_path, data)]
    with pytest.raises(ValidationError) as info:
        OrchestratorConfig.model_validate({"stages": roles})
    assert from_spec and all(problem in str(info.value) for problem in from_spec), from_spec

"""`servers.<name>.shared_memory*` in a spec -> the orchestrator's `remote` entry."""
from __future__ import annotations

import json

import pytest

from omni_serve.contract import ENGINE_ARGS_FILE
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_tools import gen_repo
from omni_tools.spec import SpecError, parse_spec


def split(tmp_path, **engine_server) -> dict:
    lm = tmp_path / "lm"
    lm.mkdir(exist_ok=True)
    (lm / "config.json").write_text("{}")
    return {
        "pipeline": "shm-test",
        "servers": {"front": {}, "engine": {"grpc_url": "127.0.0.1:9001", **engine_server}},
        "stages": {
            "llm": {"backend": "omni_llm", "model": str(lm), "server": "engine"},
            "omni": {"backend": "omni_orchestrator", "server": "front",
                     "engine_args": {"stages": {"thinker": "llm"}}},
        },
        "entry": "omni",
    }


def remote_entry(tmp_path, **engine_server) -> dict:
    gen_repo.generate(parse_spec(split(tmp_path, **engine_server), base_dir=tmp_path),
                      tmp_path / "out")
    engine = json.loads((tmp_path / "out" / "front" / "omni" / ENGINE_ARGS_FILE).read_text())
    OrchestratorConfig.model_validate(engine)  # what the orchestrator reads at load time
    return engine["remote"]


def test_the_defaults_are_not_written(tmp_path):
    assert remote_entry(tmp_path) == {"llm": {"server": "engine", "url": "127.0.0.1:9001"}}


def test_a_servers_shared_memory_settings_reach_the_orchestrator(tmp_path):
    assert remote_entry(tmp_path, shared_memory="system", shared_memory_min_bytes=4096) == {
        "llm": {"server": "engine", "url": "127.0.0.1:9001", "shared_memory": "system",
                "shared_memory_min_bytes": 4096}}


@pytest.mark.parametrize("bad,message", [
    ({"shared_memory": "cuda"}, "servers.engine.shared_memory"),
    ({"shared_memory_min_bytes": 0}, "servers.engine.shared_memory_min_bytes"),
])
def test_bad_settings_are_named(tmp_path, bad, message):
    with pytest.raises(SpecError) as err:
        parse_spec(split(tmp_path, **bad), base_dir=tmp_path)
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems

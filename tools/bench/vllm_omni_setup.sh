#!/usr/bin/env bash
# Set up .venv/vllm-omni: PyPI vllm-omni 0.30.0 for the omni-bench `vllm-omni` scenario.
# Benchmark-only (not part of tools/setup.sh; `make test` does not need it). Idempotent.
#
# The venv reuses .venv's packages (vLLM 0.32 CPU build, torch, transformers, diffusers)
# through a .pth, so .venv itself is not touched (numpy stays as it is there); it holds
# only vllm-omni (--no-deps) and the few pure-Python packages vllm-omni imports on the
# paths we run that .venv lacks. Two more files wire in tools/bench, active only when
# OMNI_VLLM_OMNI_SHIM=<tools/bench> is set (tools/bench/vllm_omni_run.py sets it):
#   zz_omni_shim.pth        installs tools/bench/vllm_omni_shim.py's import hook
#   omni_bench_vllm_omni_cpu-0.1.dist-info   entry point `cpu` of vllm_omni.platform_plugins
#                            -> tools/bench/vllm_omni_cpu_platform.py
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MAIN=$ROOT/.venv
VENV=$MAIN/vllm-omni
[ -x "$MAIN/bin/python" ] || { echo "run tools/setup.sh first ($MAIN missing)" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$MAIN/bin/python" -m venv "$VENV"
MAIN_SP=$("$MAIN/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
SP=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$MAIN_SP')" > "$SP/zz_main_venv.pth"
echo "import os, sys; p = os.environ.get('OMNI_VLLM_OMNI_SHIM'); p and (sys.path.append(p), __import__('vllm_omni_shim').install())" > "$SP/zz_omni_shim.pth"
DI=$SP/omni_bench_vllm_omni_cpu-0.1.dist-info
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: omni-bench-vllm-omni-cpu\nVersion: 0.1\n' > "$DI/METADATA"
printf '[vllm_omni.platform_plugins]\ncpu = vllm_omni_cpu_platform:cpu_omni_platform_plugin\n' > "$DI/entry_points.txt"
: > "$DI/RECORD"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps)
have() { "$VENV/bin/python" - "$1" <<'PY'
import sys, importlib.metadata as m
name, _, want = sys.argv[1].partition("==")
try:
    v = m.version(name)
except m.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if not want or v == want else 1)
PY
}
# vllm-omni itself, then what it imports that .venv lacks (found by importing its
# diffusion and Qwen2.5-Omni paths; its Requires-Dist also pins transformers 5.13/
# diffusers 0.40/accelerate 1.12, which we deliberately do not install: .venv's are used)
for pkg in vllm-omni==0.30.0 aenum==3.1.16 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 \
           prettytable==3.18.0 wcwidth==0.9.4 janus==2.0.0 cache-dit==1.5.0; do
    have "$pkg" || "${PIP[@]}" "$pkg"
done
OMNI_VLLM_OMNI_SHIM=$ROOT/tools/bench "$VENV/bin/python" -W ignore -c \
    "import vllm_omni, vllm_omni.entrypoints.async_omni; print('vllm-omni', vllm_omni.__version__, 'ready in', '$VENV')"
"$MAIN/bin/python" -c "import numpy; print('.venv numpy', numpy.__version__)"

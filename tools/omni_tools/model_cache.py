"""The on-disk cache of locally built models: where it is, and building into it once.

Where it runs: in whichever process asks for a built model (the set-up / user
process running `omni-build-tiny`, the repository generator, tests), often
several at once. Never inside tritonserver: the server only reads the
directories written here.

What flows through it: a model name, a recipe id (a string that changes when
the recipe does) and a builder `fn(out_dir)`; out comes `<cache>/<name>/`, the
builder's files plus a marker (`MARKER_FILE`: name, recipe id, build time).
The cache is `$OMNI_MODEL_CACHE`, else `~/.cache/omni-triton/models`.

How a build stays single and whole: each model has a lock file
`<cache>/.<name>.lock`, held (filelock's `FileLock`, an OS-level lock that
blocks the other processes and threads) for the whole build. The builder
writes into a fresh `<cache>/.<name>.tmp-*` directory, which is renamed to
`<cache>/<name>` only once complete and marked, so a reader sees either no
model, the old one or the finished new one, never a partial one. Whoever
waited on the lock finds the marker of the current recipe and reuses the
build. Leftovers of a killed build are deleted by the next builder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from omni_serve import env as omni_env

logger = logging.getLogger(__name__)

MARKER_FILE = ".omni-tiny-model.json"

Builder = Callable[[Path], None]


def cache_dir() -> Path:
    """The model cache: $OMNI_MODEL_CACHE, else ~/.cache/omni-triton/models."""
    env = os.environ.get(omni_env.MODEL_CACHE.name)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "omni-triton" / "models"


def is_complete(path: Path, name: str, recipe: str) -> bool:
    """Whether `path` holds a finished build of `name` made with `recipe`."""
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("name") == name and marker.get("recipe") == recipe


def _write_marker(path: Path, name: str, recipe: str, seconds: float) -> None:
    marker = {"name": name, "recipe": recipe, "build_seconds": round(seconds, 2)}
    (path / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _remove_stale_tmp(cache: Path, name: str) -> None:
    """Delete leftovers of interrupted builds (caller holds the model's lock)."""
    for stale in cache.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in cache.glob(f".{name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _current_umask() -> int:
    try:  # Linux: read it without the process-wide set-and-restore race
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _make_readable(path: Path) -> None:
    """mkdtemp (and safetensors) create owner-only modes; apply the umask like a plain mkdir."""
    umask = _current_umask()
    path.chmod(0o777 & ~umask)
    for child in path.rglob("*"):
        child.chmod((0o777 if child.is_dir() else 0o666) & ~umask)


def _install(tmp: Path, target: Path) -> None:
    """Move a finished build to target with renames (replacing an old build)."""
    if target.exists():
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.rename(target, old / target.name)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)


def build_once(name: str, recipe: str, build: Builder, *, cache: Path | None = None,
               force: bool = False) -> Path:
    """Build `name` into `<cache>/<name>/` with `build(out_dir)` unless it is built; return the path.

    Reuses a complete build of the same `recipe`; `force=True` rebuilds.
    Safe to call from several processes (and threads) at once: one builds,
    the others wait on the model's lock and then reuse its build.
    """
    cache = Path(cache) if cache is not None else cache_dir()
    target = cache / name
    if not force and is_complete(target, name, recipe):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(cache / f".{name}.lock", mode=0o644):
        # Another process may have finished the build while we waited.
        if not force and is_complete(target, name, recipe):
            return target
        _remove_stale_tmp(cache, name)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{name}.tmp-"))
        try:
            logger.info("building %s into %s", name, target)
            start = time.monotonic()
            build(tmp)
            elapsed = time.monotonic() - start
            _write_marker(tmp, name, recipe, elapsed)
            _make_readable(tmp)
            _install(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("built %s in %.1f s", name, elapsed)
    return target

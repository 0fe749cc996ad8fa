"""Which stage stubs of this tritonserver are alive: a registry in /dev/shm.

Triton 2.51's Python backend does not notice a stub process that died (SIGKILL,
the OOM killer) until the next request reaches that instance ("Stub process
... is not healthy"), keeps reporting the model ready, and never answers the
requests the dead stub was streaming: a caller waits on them for ever.

Runs in every stub process of one server: each stage instance, in its
`initialize`, writes `<dir>/<model>/<instance>` = "pid start-time", with
`<dir>` = /dev/shm/omni_stubs_<tritonserver pid> (every stub of a server has
it as parent). A stub that ends normally removes its entry (`unregister`, and
at exit); one that is killed leaves it behind, pointing at a process that is
gone or a zombie. The orchestrator (same server) reads the registry while it
waits on a stage (`StubWatch.dead`), so a request whose stage died fails in
well under a second instead of waiting out its timeout.
"""
from __future__ import annotations

import atexit
import os
import shutil
import time
from pathlib import Path

PREFIX = "omni_stubs_"


def registry_dir(server_pid: int | None = None) -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    return base / f"{PREFIX}{os.getppid() if server_pid is None else server_pid}"


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/<pid>/stat), None when it is gone or a
    zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)"
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def register(args: dict, directory: Path | None = None) -> Path:
    """Record this process as its instance of its model (call in initialize with Triton's
    args)."""
    model = args["model_name"]
    instance = args.get("model_instance_name") or f"{model}_{os.getpid()}"
    directory = directory or registry_dir()
    _remove_stale_dirs(directory.parent)
    entry = directory / model / instance
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{instance}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()} {_start_time(os.getpid())}")
    os.replace(tmp, entry)
    atexit.register(unregister, entry)
    return entry


def unregister(entry: Path) -> None:
    """Remove this process's entry (a normal end: finalize, exit)."""
    try:
        pid = int(entry.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if pid == os.getpid():  # a reloaded instance of the same name may own it now
        entry.unlink(missing_ok=True)


def _remove_stale_dirs(base: Path) -> None:
    """Registries of servers that are gone."""
    try:
        dirs = [d for d in base.iterdir() if d.name.startswith(PREFIX)]
    except OSError:
        return
    for d in dirs:
        pid = d.name[len(PREFIX):]
        if pid.isdigit() and _start_time(int(pid)) is None:
            shutil.rmtree(d, ignore_errors=True)


class StubWatch:
    """The orchestrator's view of the registry (cached for `ttl_s` per model)."""

    def __init__(self, directory: Path | None = None, ttl_s: float = 0.2):
        self.directory = directory or registry_dir()
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, list[tuple[str, int]]]] = {}

    def dead(self, model: str) -> list[tuple[str, int]]:
        """(instance, pid) of each registered stub of `model` that is no longer running."""
        now = time.monotonic()
        cached = self._cache.get(model)
        if cached and now - cached[0] < self.ttl_s:
            return cached[1]
        found = []
        try:
            entries = [e for e in (self.directory / model).iterdir() if not e.name.startswith(".")]
        except OSError:
            entries = []
        for entry in entries:
            try:
                pid_text, started = entry.read_text().split()
                pid = int(pid_text)
            except (OSError, ValueError):
                continue
            if _start_time(pid) != started:
                found.append((entry.name, pid))
        self._cache[model] = (now, found)
        return found

    def forget(self, model: str) -> None:
        """Drop the dead entries of `model` (it was unloaded: no stub of it runs)."""
        for instance, _ in self.dead(model):
            (self.directory / model / instance).unlink(missing_ok=True)
        self._cache.pop(model, None)

"""Generate a repository and serve it with a real tritonserver, for the integration tests.

One way to do it for every fixture: `omni-gen-repo` (the venv's console script, the
user's path) writes the repository, `serving` starts a TritonServer on free ports and
always stops it, printing where its log is.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from omni_tools.server import TritonServer


def gen_repo(args: Sequence[str | Path], out: Path) -> Path:
    """`omni-gen-repo ARGS -o OUT` (a spec file, or --preset NAME [--model DIR])."""
    cli = Path(sys.prefix) / "bin" / "omni-gen-repo"
    subprocess.run([str(cli), *map(str, args), "-o", str(out)], check=True, timeout=600)
    return out


@contextlib.contextmanager
def serving(repo: Path, log_dir: Path, *, extra_args: Sequence[str] = (),
            timeout: float = 300.0) -> Iterator[TritonServer]:
    """A started tritonserver for `repo`, stopped on exit (log in `log_dir`)."""
    server = TritonServer(repo, log_path=log_dir / "tritonserver.log", extra_args=list(extra_args))
    server.start(timeout=timeout)
    try:
        yield server
    finally:
        server.stop()
        print(f"\ntritonserver log: {server.log_path}")


def outliving(procs: Sequence[psutil.Process], timeout_s: float = 30.0) -> list[str]:
    """Those of `procs` still running after `timeout_s` (a zombie counts as ended), by
    pid and name; polls, returns as soon as none is left."""
    def running(proc: psutil.Process) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [f"{p.pid} {p.name()}" for p in procs if running(p)]


def stub_of(server: TritonServer, model: str) -> psutil.Process:
    """The live Python stub of `model` (one instance) under `server`."""
    (stub,) = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if p.status() != psutil.STATUS_ZOMBIE
               and f"/{model}/1/model.py" in " ".join(p.cmdline())]
    return stub

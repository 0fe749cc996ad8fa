"""Generate a repository and serve it with a real tritonserver, for the integration tests.

One way to do it for every fixture: `omni-gen-repo` (the venv's console script, the
user's path) writes the repository, `serving` starts a TritonServer on free ports and
always stops it, printing where its log is. On the session's servers (explicit model
control, conftest.py) a module borrows models with `loaded`, and a test that breaks a
model leaves it serving again with `restoring`.
"""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import tritonclient.grpc as grpcclient

from omni_serve import env
from omni_tools.server import TritonServer

# OMNI_TEST_DEVICE=gpu serves every repository of the integration tests on the GPU
# (`omni-gen-repo --device gpu`, tools/gpu_smoke.sh); cpu, the default, as the specs say.
TEST_DEVICE = env.TEST_DEVICE.get().strip().lower() or "cpu"


def device_args() -> list[str]:
    """The omni-gen-repo arguments for OMNI_TEST_DEVICE (ValueError for an unknown one)."""
    if TEST_DEVICE not in ("cpu", "gpu"):
        raise ValueError(f"OMNI_TEST_DEVICE={TEST_DEVICE!r}: use cpu or gpu")
    return ["--device", TEST_DEVICE] if TEST_DEVICE == "gpu" else []


def gen_repo(args: Sequence[str | Path], out: Path) -> Path:
    """`omni-gen-repo ARGS -o OUT` (a spec file, or --preset NAME [--model DIR]), on the
    OMNI_TEST_DEVICE."""
    cli = Path(sys.prefix) / "bin" / "omni-gen-repo"
    subprocess.run([str(cli), *map(str, args), *device_args(), "-o", str(out)], check=True,
                   timeout=600)
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


def processes_of(server: TritonServer, model: str) -> list[psutil.Process]:
    """The live stub(s) of `model` under `server` and everything they started."""
    def live(procs: list[psutil.Process]) -> list[psutil.Process]:
        alive = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:  # ended meanwhile
                pass
        return alive

    found = []
    for proc in live(psutil.Process(server.proc.pid).children(recursive=True)):
        try:
            if f"/{model}/1/model.py" in " ".join(proc.cmdline()):
                found += [proc, *live(proc.children(recursive=True))]
        except psutil.NoSuchProcess:
            pass
    return found


@contextlib.contextmanager
def loaded(server: TritonServer, repo: Path, models: Sequence[str | Sequence[str]],
           timeout_s: float = 60.0) -> Iterator[TritonServer]:
    """`models` of the generated `repo` copied into the repository of `server` (explicit
    model control) and loaded in that order, a group (a tuple of names) at once; on exit
    unloaded in the reverse order, each group at once, their processes ended and their
    folders removed, so the server is as it was. Triton loads several models at once
    (`--model-load-thread-count`), and engines pinned to other cores load side by side;
    an orchestrator may load with its stages (it reaches them per request, not at load)."""
    groups = [(m,) if isinstance(m, str) else tuple(m) for m in models]
    added: list[tuple[str, ...]] = []

    def unload(model: str) -> None:
        procs = processes_of(server, model)
        with grpcclient.InferenceServerClient(server.grpc_url) as own:
            if own.is_model_ready(model):
                own.unload_model(model)
        left = outliving(procs, timeout_s)
        shutil.rmtree(server.repository / model)
        assert not left, f"{model} unloaded, its processes live on: {left}"

    def load(model: str) -> None:
        with grpcclient.InferenceServerClient(server.grpc_url) as own:
            own.load_model(model)

    try:
        with ThreadPoolExecutor(max(len(g) for g in groups)) as pool:
            for group in groups:
                for model in group:
                    shutil.copytree(repo / model, server.repository / model)
                added.append(group)
                for done in [pool.submit(load, model) for model in group]:
                    done.result()
        yield server
    finally:
        with ThreadPoolExecutor(max([len(g) for g in added], default=1)) as pool:
            for group in reversed(added):
                for done in [pool.submit(unload, model) for model in group]:
                    done.result()


@contextlib.contextmanager
def restoring(server: TritonServer, *models: str) -> Iterator[TritonServer]:
    """For a test that breaks `models` on a shared server (explicit model control): on exit
    each is loaded again unless it serves with a fresh stub or its processes untouched, so
    the next test finds it as the session started it, whether this one passed or not."""
    before = {model: {p.pid for p in processes_of(server, model)} for model in models}
    try:
        yield server
    finally:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            for model in models:
                now = {p.pid for p in processes_of(server, model)}
                intact = now == before[model] or not now & before[model]
                if not (intact and client.is_model_ready(model)):
                    print(f"\nloading {model} again on the shared server")
                    client.load_model(model)

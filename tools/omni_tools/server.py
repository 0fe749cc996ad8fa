"""Start and stop a real tritonserver process (used by tests, benchmarks and `make serve`).

Runs in the caller's process; the server is a child process in its own
process group, stopped with SIGTERM (then SIGKILL) so no stub or vLLM
engine process outlives it.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def metric_sample(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels`, in Prometheus text.

    `name` is the sample's name as the text writes it (`..._total`,
    `..._count`, `..._sum`, or a counter without `_total`, such as Triton's
    `nv_inference_count`, which the parser renames `nv_inference_count_total`);
    KeyError when no sample matches.
    """
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        names = {name, name + "_total"} if family.type == "counter" else {name}
        for sample in family.samples:
            if sample.name in names and labels.items() <= sample.labels.items():
                return sample.value
    raise KeyError(f"no sample {name} with labels {labels} in the metrics")


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int, exclude: set[int] | None = None) -> list[int]:
    """`n` distinct free ports (all held open together while picking, so none repeats)."""
    exclude = exclude or set()
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
            port = s.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def tritonserver_bin() -> str:
    """The venv's tritonserver wrapper (see tools/assemble_backends.py)."""
    cand = Path(sys.prefix) / "bin" / "tritonserver"
    if cand.exists():
        return str(cand)
    found = shutil.which("tritonserver")
    if not found:
        raise FileNotFoundError("tritonserver not found; run `make setup` first")
    return found


class TritonServer:
    """One tritonserver on free (or given) ports; a context manager."""

    def __init__(self, repository: str | Path, *, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None,
                 log_path: str | Path | None = None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None):
        self.repository = Path(repository)
        given = {p for p in (http_port, grpc_port, metrics_port) if p}
        picked = iter(free_ports(3, exclude=given))
        self.http_port = http_port or next(picked)
        self.grpc_port = grpc_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = extra_args or []
        self.env = env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 300.0, attempts: int = 2) -> TritonServer:
        """Start and wait until every model is ready and the endpoints answer.

        A start that fails is tried again (up to `attempts` in all) on fresh
        ports: Triton binds its ports only after loading every model, so on a
        busy machine another process can take a port picked minutes earlier,
        and on an overloaded one a vLLM engine's start has been seen to stall.
        """
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(timeout)
            except (RuntimeError, TimeoutError) as e:
                if attempt == attempts:
                    raise
                log.warning("tritonserver start %d/%d failed (%s); retrying on new ports",
                            attempt, attempts, str(e).splitlines()[0])
                picked = iter(free_ports(3))
                self.http_port, self.grpc_port, self.metrics_port = (
                    next(picked), next(picked), next(picked))
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> TritonServer:
        cmd = [tritonserver_bin(), f"--model-repository={self.repository}",
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}", "--allow-metrics=true",
               *self.extra_args]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}; "
                                   f"log: {self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    ready = r.status == 200
                if ready:  # the metrics endpoint comes up last
                    with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                        if r.status == 200:
                            return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout}s; log: {self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return "(no log)"

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM to its process group) without waiting: several
        servers stopped at once each `terminate()`, then each `stop()`."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class OpenAIFrontend:
    """One `omni-openai` process (the venv's console script) on a free port; a context manager."""

    def __init__(self, triton_grpc_url: str, *, port: int | None = None,
                 log_path: str | Path | None = None, extra_args: Sequence[str] = ()):
        self.triton_grpc_url = triton_grpc_url
        self.port = port or free_port()
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = list(extra_args)  # more omni-openai flags
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> OpenAIFrontend:
        cli = Path(sys.prefix) / "bin" / "omni-openai"
        cmd = [str(cli), "--triton-url", self.triton_grpc_url, "--host", "127.0.0.1",
               "--port", str(self.port), *self.extra_args]
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omni-openai exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2):
                    return self
            except urllib.error.HTTPError:
                return self  # it answers (Triton may be down: that is the caller's test)
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"omni-openai not answering after {timeout}s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> OpenAIFrontend:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

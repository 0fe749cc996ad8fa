"""A killed tritonserver leaves no stub or vLLM engine process behind.

Its own server: the test SIGKILLs it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from omni_tools.server import TritonServer

pytestmark = pytest.mark.integration


def test_sigkilled_server_takes_its_stub_and_engine_down(tmp_path):
    repo = tmp_path / "repo"
    cli = Path(sys.prefix) / "bin" / "omni-gen-repo"
    subprocess.run([str(cli), "--preset", "text-chat", "-o", str(repo)], check=True, timeout=600)
    server = TritonServer(repo, log_path=tmp_path / "tritonserver.log").start()
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert "triton_python_backend_stub" in names and any(
            "VLLM" in p.name() or "VLLM" in " ".join(p.cmdline()) for p in children), names
        os.kill(server.proc.pid, signal.SIGKILL)  # no finalize(): the stub must notice alone
        server.proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(p.is_running() and p.status() != "zombie"
                                                  for p in children):
            time.sleep(0.5)
        alive = [p for p in children if p.is_running() and p.status() != "zombie"]
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        server.stop()

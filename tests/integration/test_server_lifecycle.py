"""A killed tritonserver leaves no stub or vLLM engine process behind.

The server is conftest.default_mode_server (a vLLM engine and a DiT, Triton's default
model-control mode), which test_overload used before; the test SIGKILLs it, and a
later user of it gets a fresh one.
"""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

pytestmark = pytest.mark.integration


def test_sigkilled_server_takes_its_stubs_and_engine_down(default_mode_server):
    server = default_mode_server.get()
    children = psutil.Process(server.proc.pid).children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) for p in children)
    assert "triton_python_backend_stub" in names and any(
        "VLLM" in p.name() or "VLLM" in " ".join(p.cmdline()) for p in children), names
    os.kill(server.proc.pid, signal.SIGKILL)  # no finalize(): the stubs must notice alone
    server.proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.is_running() and p.status() != "zombie"
                                              for p in children):
        time.sleep(0.5)
    alive = [p for p in children if p.is_running() and p.status() != "zombie"]
    assert not alive, [" ".join(p.cmdline()) for p in alive]

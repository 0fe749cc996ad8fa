"""A stage reads its tritonserver's model-control mode from the server's command line,
and only `explicit` lets a model whose engine died unload itself."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from omni_serve.server_args import may_unload_itself, model_control_mode, server_argv


@pytest.mark.parametrize("argv, mode", [
    (["tritonserver", "--model-repository=/r"], "none"),  # Triton's default
    (["tritonserver", "--model-repository=/r", "--model-control-mode=explicit"], "explicit"),
    (["tritonserver", "--model-control-mode", "explicit", "--load-model=llm"], "explicit"),
    (["tritonserver", "--model_control_mode=poll"], "poll"),  # Triton takes underscores too
    (["tritonserver", "--model-control-mode=EXPLICIT"], "explicit"),
    (["tritonserver", "--model-control-mode"], "none"),  # malformed: the safe reading
    ([], "none"),  # not readable
])
def test_the_model_control_mode_comes_from_the_server_command_line(argv, mode):
    assert model_control_mode(argv) == mode


@pytest.mark.parametrize("mode, allowed", [("explicit", True), ("none", False), ("poll", False)])
def test_only_explicit_model_control_lets_a_model_unload_itself(mode, allowed):
    assert may_unload_itself(mode) is allowed


def test_the_command_line_is_read_from_the_parent_process():
    """What a stub does with its tritonserver: here a real process stands in for it."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()",
                             "--model-repository=/r", "--model-control-mode=explicit"],
                            stdin=subprocess.PIPE)
    try:
        # until its exec has set its arguments up (Popen returns a moment before)
        deadline = time.monotonic() + 10
        while server_argv(proc.pid) == [""] and time.monotonic() < deadline:
            time.sleep(0.01)
        argv = server_argv(proc.pid)
        assert argv[-3:] == ["--model-repository=/r", "--model-control-mode=explicit", ""]
        assert model_control_mode(argv) == "explicit"
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    # this test process has no such flag, nor does its parent (not a tritonserver)
    assert model_control_mode() == "none"
    assert server_argv(2 ** 22 + 1) == []  # no such process

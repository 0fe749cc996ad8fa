"""omni_serve.llm.engine_fork: a stage's stub forks its CPU engine core, which then starts
as a spawned one would; no other fork of the stub is touched."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from omni_serve import env
from omni_serve.llm import engine_fork


@pytest.mark.parametrize(("setting", "is_cpu", "expected"), [
    (None, True, True), ("1", True, True), ("0", True, False), (None, False, False)])
def test_only_a_cpu_engine_is_forked_unless_turned_off(monkeypatch, setting, is_cpu, expected):
    monkeypatch.delenv(env.VLLM_ENGINE_FORK.name, raising=False)
    if setting is not None:
        monkeypatch.setenv(env.VLLM_ENGINE_FORK.name, setting)
    assert engine_fork.enabled(is_cpu=is_cpu) is expected


# In a fresh interpreter: forks from the arming thread inside and after the window, and
# from another thread inside it; each child reports what it started with.
CHILD = textwrap.dedent("""
    import ctypes, json, os, threading
    import vllm.plugins
    from omni_serve.llm import engine_fork

    vllm.plugins.plugins_loaded = True  # the stub has loaded them making the engine's config
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # as vLLM's CPU platform sets it

    def fork() -> dict:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            sig = ctypes.c_int()
            ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
            os.write(write, json.dumps({"pdeathsig": sig.value,
                                        "plugins_loaded": vllm.plugins.plugins_loaded}).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        return json.loads(os.read(read, 4096))

    out = {}
    def stage_loop():  # the stage's engine-loop thread
        with engine_fork.forking():
            out["method"] = os.environ["VLLM_WORKER_MULTIPROC_METHOD"]
            out["engine_core"] = fork()
            other = threading.Thread(target=lambda: out.update(other_thread=fork()))
            other.start()
            other.join()
        out["after"] = fork()
        out["method_after"] = os.environ["VLLM_WORKER_MULTIPROC_METHOD"]
    loop = threading.Thread(target=stage_loop)
    loop.start()
    loop.join()
    print(json.dumps(out))
""")


def test_the_engine_core_fork_starts_as_a_spawned_one_and_no_other_fork_is_touched():
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["method"] == "fork" and out["method_after"] == "spawn"
    # dies with the stub, and loads vLLM's plugins again as a spawned engine core does
    assert out["engine_core"] == {"pdeathsig": 9, "plugins_loaded": False}
    untouched = {"pdeathsig": 0, "plugins_loaded": True}
    assert out["other_thread"] == untouched and out["after"] == untouched

"""omni_serve.llm.worker_fork: a CPU engine core forks its worker with the worker's settings."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from omni_serve.llm.worker_fork import is_engine_core, omp_cpus


@pytest.mark.parametrize(("environ", "cpus"), [
    ({"GOMP_CPU_AFFINITY": "0"}, [0]),
    ({"GOMP_CPU_AFFINITY": "2 3 1"}, [2, 3, 1]),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5]"}, [4, 5]),
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}, [0, 1]),
    ({"OMP_NUM_THREADS": "2"}, []),
    ({"GOMP_CPU_AFFINITY": " "}, []),
])
def test_omp_cpus_reads_each_runtimes_setting(environ, cpus):
    assert omp_cpus(environ) == cpus


def test_only_vllms_engine_core_process_names_count():
    assert is_engine_core("EngineCore") and is_engine_core("EngineCore_DP1")
    assert not is_engine_core("MainProcess") and not is_engine_core("VllmWorker-0")
    assert not is_engine_core()  # the pytest process


CHILD = textwrap.dedent("""
    import ctypes, json, multiprocessing, os, signal, sys
    import torch
    from omni_serve.llm import worker_fork
    multiprocessing.current_process().name = sys.argv[1]
    worker_fork.register()
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    os.environ.update(OMP_NUM_THREADS="1", GOMP_CPU_AFFINITY="0")  # as vLLM sets them
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        sig = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        os.write(write, json.dumps({"cpus": sorted(os.sched_getaffinity(0)),
                                    "threads": torch.get_num_threads(),
                                    "pdeathsig": sig.value}).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print(json.dumps({"method": method, "child": json.loads(os.read(read, 4096))}))
""")


def _run(name: str, **env: str) -> dict:
    import os

    res = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **env})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_an_engine_core_forks_a_worker_bound_as_vllm_binds_a_spawned_one():
    out = _run("EngineCore")
    assert out["method"] == "fork"
    assert out["child"] == {"cpus": [0], "threads": 1, "pdeathsig": 9}  # SIGKILL


def test_elsewhere_or_turned_off_nothing_changes():
    for out in (_run("MainProcess"), _run("EngineCore", OMNI_VLLM_WORKER_FORK="0")):
        assert out["method"] != "fork" and out["child"]["pdeathsig"] == 0

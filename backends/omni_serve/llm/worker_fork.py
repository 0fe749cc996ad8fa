"""A vLLM general plugin: on CPU, the engine core forks its worker instead of spawning it.

Runs in vLLM's engine-core process (vLLM loads `vllm.general_plugins` entry points
there; pyproject.toml registers `register`), and, through an at-fork hook, in the
worker it forks. In every other process it does nothing.

vLLM's CPU platform starts every process with `spawn`, so a worker process imports
vLLM and torch again before it loads the model: 10 s of CPU on a 2-core host, one
after the engine core's own, at every engine start. Forked from the engine core,
which has imported them already, the worker starts at once (tiny Qwen2 text-chat
server start: 24.5-25.5 s spawned, 18.5-19.5 s forked, the same throughput).
vLLM's GPU platforms fork their workers the same way.

What a spawned worker gets at its start a forked one must be given here:
- its OpenMP threads and cores: vLLM sets them for the worker as environment variables
  (OMP_NUM_THREADS and GOMP_CPU_AFFINITY, KMP_AFFINITY or OMP_PLACES) around its start,
  and the OpenMP runtime reads them only when it is loaded, in the engine core long
  before. The child applies them itself: without that, the forked worker computed on
  both cores with two threads, and a tiny Qwen2 decoded 20% slower at 8 streams;
- its death with its parent (omni_serve.llm.parent_death): Linux does not carry a
  PR_SET_PDEATHSIG request across fork;
- its plugins: vLLM loads them once per process, and a forked child inherits "loaded".
  The child marks them unloaded, so the worker loads them as a spawned one does, after
  vLLM has set up its logging (omni_serve.llm.startup_failure's handler would be gone).

`OMNI_VLLM_WORKER_FORK=0` keeps vLLM's spawn.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import re
from collections.abc import Mapping

from omni_serve import env

log = logging.getLogger("vllm.omni_worker_fork")

METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def is_engine_core(name: str | None = None) -> bool:
    """Whether this process is a vLLM engine core (by the process name vLLM gives it)."""
    name = multiprocessing.current_process().name if name is None else name
    return name == "EngineCore" or name.startswith("EngineCore_DP")


def omp_cpus(environ: Mapping[str, str]) -> list[int]:
    """The cores vLLM's OpenMP settings in `environ` name for a worker (GOMP_CPU_AFFINITY
    "0 1", KMP_AFFINITY "...proclist=[0,1]" or OMP_PLACES "{0,1}"), in order; [] if none."""
    for name, pattern in (("GOMP_CPU_AFFINITY", r"(.*)"), ("KMP_AFFINITY", r"proclist=\[([^\]]*)\]"),
                          ("OMP_PLACES", r"\{([^}]*)\}")):
        match = re.search(pattern, environ.get(name, ""))
        if match and match.group(1).strip():
            return [int(c) for c in re.split(r"[\s,]+", match.group(1).strip())]
    return []


def as_if_spawned(parent_pid: int) -> None:
    """In a vLLM process right after its parent forked it: what a spawned one has at its
    start, its death with the parent and vLLM's plugins still to load."""
    from omni_serve.llm.parent_death import die_with_parent

    die_with_parent(parent_pid)
    import vllm.plugins

    vllm.plugins.plugins_loaded = False


def in_forked_worker(parent_pid: int) -> None:
    """In the child, right after the engine core forked it: the settings a spawned worker
    would have had (the module docstring)."""
    as_if_spawned(parent_pid)
    cpus = omp_cpus(os.environ)
    if cpus:
        os.sched_setaffinity(0, cpus)
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def register() -> None:
    """Entry point (vllm.general_plugins)."""
    if not is_engine_core() or env.VLLM_WORKER_FORK.get() == "0":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # vLLM's own choice elsewhere
    os.environ[METHOD_ENV] = "fork"
    engine_core = os.getpid()
    os.register_at_fork(after_in_child=lambda: in_forked_worker(engine_core))
    log.info("omni: this engine core forks its workers (pid %d)", engine_core)

"""A vLLM general plugin: vLLM's engine core and workers die with the process that started them.

vLLM loads `vllm.general_plugins` entry points in every process it starts;
pyproject.toml registers `register` there. In a process that multiprocessing
started (vLLM's engine core, started by a stage's Triton stub, and its
workers, started by the engine core) it asks Linux for SIGKILL when the
parent goes (prctl PR_SET_PDEATHSIG). Without it, a stub that is SIGKILLed (an
OOM kill) left its engine core running, re-parented to init and holding the
model and its KV cache, until the server stopped (measured: 73 s in a test
run; for ever in production); an engine core that is killed left its worker.

In any other process (the stub itself, a user's script) it does nothing.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

log = logging.getLogger("vllm.omni_parent_death")

PR_SET_PDEATHSIG = 1


def register() -> None:
    """Entry point (vllm.general_plugins)."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    die_with_parent(parent.pid)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux for SIGKILL when process `parent_pid`, this one's parent, goes (also from a
    forked child, which does not inherit the request: omni_serve.llm.worker_fork)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("omni: prctl(PR_SET_PDEATHSIG) failed (errno %d); this process may "
                    "outlive its parent", ctypes.get_errno())
        return
    if os.getppid() != parent_pid:  # the parent went before the request took effect
        os._exit(1)

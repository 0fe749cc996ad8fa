"""Processes a stage started (vLLM's engine core and its workers), and ending them.

Runs in a stage's stub process. A vLLM engine core that is killed (an OOM kill)
leaves its worker processes re-parented to init: they are no longer this
process's descendants, so whoever must end them keeps a snapshot taken while
the engine lived. psutil.Process remembers each process's start time, so a
recycled pid is never signalled.

The first line of defence is the vLLM plugin omni_serve.llm.parent_death: the kernel
ends each engine process with its parent (PR_SET_PDEATHSIG), even when the stub itself
is killed. This snapshot is the fallback for where vLLM's plugins are turned off
(VLLM_PLUGINS without ours) and the stage's own check at shutdown that nothing is left.
"""
from __future__ import annotations

import psutil


def descendants() -> list[psutil.Process]:
    """Every process this one started, directly or not, as of now."""
    return psutil.Process().children(recursive=True)


def terminate(procs: list[psutil.Process], grace_s: float = 3.0) -> list[psutil.Process]:
    """SIGTERM the ones still running, SIGKILL those alive after `grace_s`; return those."""
    running = [p for p in procs if p.is_running()]
    for proc in running:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(running, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return running

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
When tritonserver itself dies without finalizing the stage, `exit_with_parent`
ends those processes and then the stub.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)


# Python's multiprocessing resource tracker (vLLM starts one in the stub): it ignores
# SIGTERM, so ending it would cost the whole grace period at every unload, and it ends by
# itself once the stub exits, after unlinking whatever shared memory was leaked.
RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def descendants() -> list[psutil.Process]:
    """Every process this one started, directly or not, as of now, but the resource tracker."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if RESOURCE_TRACKER not in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:  # ended meanwhile
            pass
    return found


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


def exit_with_parent(cleanup: Callable[[], None], interval_s: float = 0.1) -> threading.Thread:
    """Exit the stub when tritonserver dies without finalizing us (SIGKILL, crash).

    The stub is re-parented then; without this it and its vLLM engine
    processes would outlive the server and keep their memory and cores.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                log.error("tritonserver (pid %d) is gone; shutting the stage down", parent)
                # Children first: the stub exits by itself about a second
                # after the server dies, and a graceful engine shutdown may
                # not finish before that.
                terminate(descendants(), grace_s=0.5)
                try:
                    cleanup()
                except Exception:
                    log.exception("stage shutdown failed")
                finally:
                    os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread

"""A stage forks its vLLM engine core from its stub instead of spawning it (CPU platform).

Runs in a vLLM-hosted stage's stub while llm/cpu_engine.py's `start` makes the
AsyncLLM, and in the engine core it forks, right after the fork.

vLLM's CPU platform starts every process with `spawn`, so the engine core imports
vLLM and torch again before it builds anything, though the stub that starts it has
imported both already. Forked, it starts at once (a tiny Qwen2 AsyncLLM on the 2-core
host, two starts each: 12.4 and 13.6 s spawned, 6.0 and 6.4 s forked). Its worker is
then forked from it in turn (llm/worker_fork.py).

Why a fork is safe here:
- the stage makes its engine first thing on its engine-loop thread, and the fork
  happens on that thread: it has run no OpenMP parallel region (libgomp keeps a
  thread pool per thread that ran one, and a child using a pool inherited so hangs)
  and holds no lock;
- the child runs only vLLM's engine core: it never touches the stub's Triton IPC,
  and multiprocessing ends it with os._exit, so none of the stub's exit handlers run
  in it;
- the child gets what a spawned one has at its start (worker_fork.as_if_spawned):
  its death with the stub, which Linux does not carry across a fork, and vLLM's
  plugins to load again, which a forked child would inherit as loaded.

Only a fork made on the thread that armed it, while `forking()` is open, is treated
as the engine core's. A worker inside the engine core (OMNI_VLLM_WORKER_IN_ENGINE=1)
keeps the spawn: vLLM gives it its OpenMP cores and threads through the environment,
which the stub's OpenMP runtime, loaded long before, would not read.
`OMNI_VLLM_ENGINE_FORK=0` keeps the spawn too.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from omni_serve import env
from omni_serve.llm.worker_fork import METHOD_ENV, as_if_spawned

_armed: dict[str, int] = {}  # while forking() is open: the arming thread and process


def enabled(is_cpu: bool | None = None) -> bool:
    """Whether this process forks its engine core (CPU platform, not turned off)."""
    if env.VLLM_ENGINE_FORK.get() == "0":
        return False
    if is_cpu is None:
        from vllm.platforms import current_platform

        is_cpu = current_platform.is_cpu()
    return bool(is_cpu)


def _after_fork_in_child() -> None:
    armed = dict(_armed)
    _armed.clear()
    if armed.get("thread") == threading.get_ident():
        as_if_spawned(armed["pid"])


os.register_at_fork(after_in_child=_after_fork_in_child)  # once: a module runs once


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """While open, vLLM's processes started from this thread are forked, not spawned.

    Open it after the engine's config is made (vLLM's CPU platform sets `spawn` then)."""
    _armed.update(thread=threading.get_ident(), pid=os.getpid())
    try:
        with env.set_while(METHOD_ENV, "fork"):
            yield
    finally:
        _armed.clear()

"""A vLLM general plugin: CPU engines wait for each other without spinning.

vLLM loads `vllm.general_plugins` entry points in every process it starts
(the engine core and each worker), so this is the one place that can change
how those processes behave; pyproject.toml registers `register` there.

What it changes: the engine core and its worker hand each step over through
vLLM's shared-memory message queue, whose reader busy-waits with
`os.sched_yield()` for a second after every message. On a GPU host that
costs one spare core per process. On a small CPU host it is two spinning
processes on the cores the model computes on, and on the Linux guests we run
on (EEVDF scheduler) a process spinning in `sched_yield()` starves other
processes' timer wake-ups: while one request was generating, a client's
`time.sleep(0.5)` returned after the whole 4 s reply, so streamed responses
arrived in one burst at the end and a client's cancel went out after the
engine had finished (measured with tools/bench_spin.py; see
docs/benchmarks.md). Sleeping a few microseconds instead of yielding keeps
the hand-over fast (the sleep ends within ~0.1 ms) and lets the kernel run
everyone else.

`OMNI_VLLM_SPIN_SLEEP_US` sets the sleep in microseconds; 0 keeps vLLM's
own `sched_yield()` spin. Default: 50 on the CPU platform, 0 elsewhere.
"""
from __future__ import annotations

import logging
import os
import time

# a child of "vllm": vLLM configures that logger in its engine-core and worker processes
log = logging.getLogger("vllm.omni_spin_sleep")

ENV = "OMNI_VLLM_SPIN_SLEEP_US"
CPU_DEFAULT_US = 50.0


def spin_sleep_us(is_cpu: bool, environ: dict[str, str] | None = None) -> float:
    """The pause between shared-memory polls, in microseconds (0: vLLM's spin)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV, "").strip()
    if not raw:
        return CPU_DEFAULT_US if is_cpu else 0.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also NaN
        raise ValueError(f"{ENV} must be a number of microseconds >= 0, got {raw!r}")
    return value


def make_pause(us: float):
    """A drop-in for vLLM's `sched_yield()` that sleeps `us` microseconds."""
    seconds = us * 1e-6

    def pause() -> None:
        time.sleep(seconds)

    pause.omni_sleep_us = us  # lets tests and logs see what is installed
    return pause


def register() -> None:
    """Entry point (vllm.general_plugins): install the pause where vLLM looks it up."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    us = spin_sleep_us(current_platform.is_cpu())
    if us <= 0:
        return
    import vllm.distributed.device_communicators.shm_broadcast as shm_broadcast  # noqa: PLC0415
    import vllm.distributed.utils as dist_utils  # noqa: PLC0415

    pause = make_pause(us)
    # shm_broadcast imported the function by name, so both module globals are set
    for module in (dist_utils, shm_broadcast):
        if hasattr(module, "sched_yield"):
            module.sched_yield = pause
    log.info("omni: vLLM shared-memory readers sleep %g us between polls (pid %d)",
              us, os.getpid())

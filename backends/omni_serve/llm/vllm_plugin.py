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

A sleeping thread wakes up to its timer slack late (Linux: 50 us by default),
so a 50 us sleep took ~130 us here and a 10 us one ~86 us. The polling thread
therefore sets its own slack (prctl PR_SET_TIMERSLACK, that thread only) to
`OMNI_VLLM_TIMER_SLACK_NS`, default 1000 when it sleeps; 0 leaves the
kernel's default.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable

# a child of "vllm": vLLM configures that logger in its engine-core and worker processes
log = logging.getLogger("vllm.omni_spin_sleep")

ENV = "OMNI_VLLM_SPIN_SLEEP_US"
CPU_DEFAULT_US = 50.0
SLACK_ENV = "OMNI_VLLM_TIMER_SLACK_NS"
DEFAULT_SLACK_NS = 1000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30  # linux/prctl.h


def _setting(environ: dict[str, str] | None, name: str, unit: str) -> float | None:
    """A number >= 0 from the environment; None when unset or blank."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also NaN
        raise ValueError(f"{name} must be a number of {unit} >= 0, got {raw!r}")
    return value


def spin_sleep_us(is_cpu: bool, environ: dict[str, str] | None = None) -> float:
    """The pause between shared-memory polls, in microseconds (0: vLLM's spin)."""
    value = _setting(environ, ENV, "microseconds")
    if value is None:
        return CPU_DEFAULT_US if is_cpu else 0.0
    return value


def timer_slack_ns(environ: dict[str, str] | None = None) -> int:
    """The polling thread's timer slack in nanoseconds (0: the kernel's default)."""
    value = _setting(environ, SLACK_ENV, "nanoseconds")
    return DEFAULT_SLACK_NS if value is None else int(value)


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, or None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def thread_timer_slack_ns() -> int | None:
    """The calling thread's timer slack (for tests and logs); None without prctl."""
    prctl = _prctl()
    return None if prctl is None else prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)


def make_pause(us: float, slack_ns: int = 0):
    """A drop-in for vLLM's `sched_yield()` that sleeps `us` microseconds.

    With `slack_ns`, each thread that calls it first sets its own timer slack
    to that (where prctl exists), so the sleep ends close to `us`.
    """
    seconds = us * 1e-6
    prctl = _prctl() if slack_ns > 0 else None
    done = threading.local()

    def pause() -> None:
        if prctl is not None and not getattr(done, "slack", False):
            done.slack = True
            prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0)
        time.sleep(seconds)

    pause.omni_sleep_us = us  # lets tests and logs see what is installed
    pause.omni_slack_ns = slack_ns if prctl is not None else 0
    return pause


def register() -> None:
    """Entry point (vllm.general_plugins): install the pause where vLLM looks it up."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    us = spin_sleep_us(current_platform.is_cpu())
    slack_ns = timer_slack_ns()
    if us <= 0:
        return
    import vllm.distributed.device_communicators.shm_broadcast as shm_broadcast  # noqa: PLC0415
    import vllm.distributed.utils as dist_utils  # noqa: PLC0415

    pause = make_pause(us, slack_ns)
    # shm_broadcast imported the function by name, so both module globals are set
    for module in (dist_utils, shm_broadcast):
        if hasattr(module, "sched_yield"):
            module.sched_yield = pause
    log.info("omni: vLLM shared-memory readers sleep %g us between polls, timer slack %s "
             "(pid %d)", us, f"{pause.omni_slack_ns} ns" if pause.omni_slack_ns else "default",
             os.getpid())

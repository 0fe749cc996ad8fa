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
engine had finished (measured with `omni-bench spin`; see
docs/benchmarks-notes.md). Sleeping a few microseconds instead of yielding keeps
the hand-over fast (the sleep ends within ~0.1 ms) and lets the kernel run
everyone else.

`OMNI_VLLM_SPIN_SLEEP_US` sets the first sleep of a wait in microseconds (0
keeps vLLM's own `sched_yield()` spin); each further poll of the same wait
sleeps twice as long, up to `OMNI_VLLM_SPIN_SLEEP_MAX_US`, and a message read
starts over. A hand-over that comes quickly (the worker waiting for the next
step's schedule) is still seen within ~0.1 ms, while a reader waiting out a
step's compute wakes a few times instead of every 0.1 ms: with a fixed
50 us, four such readers (two engines) starved other processes on a busy
2-core host, a 100 ms sleep lasting up to 3 s and streamed responses stalling
0.6-1.8 s under four speech requests (`omni-bench cold-start`). Defaults on the
CPU platform: 50 and 1000; elsewhere vLLM's spin.

Doubling all the way wakes a reader late: a 2 ms step is seen at 2.55 ms
(polls at 0.05, 0.15, 0.35, 0.75, 1.55, 2.55 ms), a fifth of a tiny model's
step. `OMNI_VLLM_SPIN_FINE_MS` (off by default) keeps each poll of a wait's
first milliseconds at most 4x the first sleep (200 us), so only a longer wait
backs off to the cap: a tiny model's step 1.25x faster alone (in-process
vLLM, 3.0 -> 2.4 ms a token), but on a loaded 2-core host streams went
silent for 0.3 s instead of 0.04-0.06 s (`omni-bench cold-start`,
docs/benchmarks-notes.md). For hosts with cores to spare.
"""
from __future__ import annotations

import functools
import logging
import os
import time

from omni_serve import env

# a child of "vllm": vLLM configures that logger in its engine-core and worker processes
log = logging.getLogger("vllm.omni_spin_sleep")

ENV = env.VLLM_SPIN_SLEEP_US.name
CPU_DEFAULT_US = 50.0
MAX_ENV = env.VLLM_SPIN_SLEEP_MAX_US.name
CPU_DEFAULT_MAX_US = 1000.0
FINE_ENV = env.VLLM_SPIN_FINE_MS.name
FINE_POLLS = 4  # in a wait's first milliseconds, a poll sleeps at most 4x the first one
CPU_DEFAULT_FINE_MS = 0.0  # off: see the module docstring


def _microseconds(environ: dict[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also NaN
        raise ValueError(f"{name} must be a number of microseconds >= 0, got {raw!r}")
    return value


def spin_sleep_us(is_cpu: bool, environ: dict[str, str] | None = None) -> float:
    """The first pause of a wait between shared-memory polls, in microseconds (0: vLLM's spin)."""
    environ = os.environ if environ is None else environ
    return _microseconds(environ, ENV, CPU_DEFAULT_US if is_cpu else 0.0)


def spin_sleep_max_us(is_cpu: bool, environ: dict[str, str] | None = None) -> float:
    """The longest pause of a wait (never below the first one)."""
    environ = os.environ if environ is None else environ
    return max(spin_sleep_us(is_cpu, environ),
               _microseconds(environ, MAX_ENV, CPU_DEFAULT_MAX_US if is_cpu else 0.0))


def spin_fine_ms(is_cpu: bool, environ: dict[str, str] | None = None) -> float:
    """How long into a wait its sleeps stay at most FINE_POLLS x the first (0: not at all)."""
    environ = os.environ if environ is None else environ
    return _microseconds(environ, FINE_ENV, CPU_DEFAULT_FINE_MS if is_cpu else 0.0)


def make_pause(us: float, max_us: float | None = None, fine_ms: float = 0.0, clock=time.monotonic):
    """A drop-in for vLLM's `sched_yield()`: sleeps `us` microseconds, twice that on the next
    call, up to FINE_POLLS x `us` for the first `fine_ms` of a wait and up to `max_us`
    after, until `pause.reset()` (a message was read) starts over."""
    window = fine_ms * 1e-3
    first = us * 1e-6
    longest = max(us, max_us if max_us is not None else us) * 1e-6
    fine = min(longest, first * FINE_POLLS)
    current = first
    started: float | None = None  # when this wait's first pause came

    def pause() -> None:
        nonlocal current, started
        now = clock()
        if started is None:
            started = now
        cap = fine if now - started < window else longest
        time.sleep(min(current, cap))
        current = min(current * 2, cap)

    def reset() -> None:
        nonlocal current, started
        started = None
        current = first

    pause.reset = reset
    pause.next_us = lambda: current * 1e6  # what the next call sleeps
    pause.omni_sleep_us = us  # lets tests and logs see what is installed
    pause.omni_sleep_max_us = longest * 1e6
    pause.omni_fine_ms = fine_ms
    return pause


def register() -> None:
    """Entry point (vllm.general_plugins): install the pause where vLLM looks it up."""
    from vllm.platforms import current_platform

    is_cpu = current_platform.is_cpu()
    us = spin_sleep_us(is_cpu)
    if us <= 0:
        return
    import vllm.distributed.device_communicators.shm_broadcast as shm_broadcast
    import vllm.distributed.utils as dist_utils

    pause = make_pause(us, spin_sleep_max_us(is_cpu), spin_fine_ms(is_cpu))
    # shm_broadcast imported the function by name, so both module globals are set
    for module in (dist_utils, shm_broadcast):
        if hasattr(module, "sched_yield"):
            module.sched_yield = pause
    _reset_on_read(shm_broadcast.SpinCondition, pause)
    log.info("omni: vLLM shared-memory readers sleep %g us between polls, doubling up to "
             "%g us in a wait's first %g ms and up to %g us after (pid %d)", us,
             us * FINE_POLLS, pause.omni_fine_ms, pause.omni_sleep_max_us, os.getpid())


def _reset_on_read(spin_condition: type, pause) -> None:
    """Start the pause over whenever a reader has read a message (SpinCondition.record_read);
    vLLM's own method is wrapped once, also where this runs again (a forked worker)."""
    record_read = getattr(spin_condition.record_read, "__wrapped__", spin_condition.record_read)

    @functools.wraps(record_read)
    def record_read_and_reset(self) -> None:
        record_read(self)
        pause.reset()

    spin_condition.record_read = record_read_and_reset

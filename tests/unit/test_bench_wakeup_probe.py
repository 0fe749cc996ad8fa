"""wakeup_probe: delays past the interval, the late ones with their runqueue wait, and the
real /proc reader (a fake clock and sleep, no load)."""
from __future__ import annotations

import sys

import pytest

from omni_tools.bench import wakeup_probe


class FakeHost:
    """A clock that each sleep advances by the interval, plus `extra` seconds on given calls;
    the runqueue wait grows by `waited` of that extra."""

    def __init__(self, extra: dict[int, float], waited: float = 1.0):
        self.now, self.calls, self.extra, self.waited, self.wait_ms = 100.0, 0, extra, waited, 5.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        extra = self.extra.get(self.calls, 0.0)
        self.now += seconds + extra
        self.wait_ms += extra * self.waited * 1e3
        self.calls += 1

    def rq_wait(self) -> float:
        return self.wait_ms


def test_a_late_wakeup_is_counted_and_listed_with_its_runqueue_wait():
    host = FakeHost({3: 1.5, 7: 0.4})
    r = wakeup_probe.probe(2.51, 0.02, late_ms=300, clock=host.clock, sleep=host.sleep,
                           rq_wait=host.rq_wait)
    assert r["late_ms_max"] == pytest.approx(1500)
    assert r["over_1s"] == 1
    assert r["late_ms_p50"] == pytest.approx(0, abs=1e-6)
    assert [(x["at_s"], x["late_ms"], x["runqueue_wait_ms"]) for x in r["late"]] == [
        (pytest.approx(0.06), pytest.approx(1500), pytest.approx(1500)),
        (pytest.approx(1.64), pytest.approx(400), pytest.approx(400))]
    # 2.51 s of 20 ms sleeps, the two late ones taking 1.9 s of it: 31 wake-ups, the last
    # one starting at 2.50 s
    assert r["wakeups"] == host.calls == 31


def test_a_timer_that_fires_late_shows_no_runqueue_wait():
    host = FakeHost({0: 0.5}, waited=0.0)
    r = wakeup_probe.probe(0.1, 0.02, clock=host.clock, sleep=host.sleep, rq_wait=host.rq_wait)
    assert r["late"] == [{"at_s": 0.0, "late_ms": pytest.approx(500), "runqueue_wait_ms": 0.0}]


def test_no_runqueue_reader_leaves_the_wait_unknown():
    host = FakeHost({1: 0.5})
    r = wakeup_probe.probe(0.1, 0.02, clock=host.clock, sleep=host.sleep, rq_wait=lambda: None)
    assert r["late"][0]["runqueue_wait_ms"] is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_runqueue_wait_is_read_from_proc_and_never_falls():
    first = wakeup_probe.runqueue_wait_ms()
    sum(range(200_000))
    assert first is not None and first >= 0
    assert wakeup_probe.runqueue_wait_ms() >= first

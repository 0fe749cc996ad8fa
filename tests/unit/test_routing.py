"""Routing over several thinker engines: rendezvous hashing of session ids, least-busy fallback."""
from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from omni_serve.orchestrator.routing import EngineRouter, pick, weight

ENGINES = ("llm_a", "llm_b", "llm_c")
SESSIONS = [f"session-{i}" for i in range(1000)]


def test_a_session_always_gets_the_same_engine():
    first = {s: pick(s, ENGINES) for s in SESSIONS}
    assert all(pick(s, ENGINES) == first[s] for s in SESSIONS)
    # the order the engines are listed in does not matter
    assert all(pick(s, tuple(reversed(ENGINES))) == first[s] for s in SESSIONS)


def test_the_weights_are_fixed_numbers_not_salted_by_the_process():
    # blake2b, not Python's hash(): every orchestrator process (and a client) agrees
    assert weight("abc", "llm_a") == int.from_bytes(
        hashlib.blake2b(b"llm_a\x00abc", digest_size=8).digest(), "big")


def test_sessions_spread_roughly_evenly_over_the_engines():
    counts = Counter(pick(s, ENGINES) for s in SESSIONS)
    assert set(counts) == set(ENGINES)
    # expected 333 each; binomial sd ~15, so +-60 is 4 sd
    assert all(abs(n - 1000 / 3) < 60 for n in counts.values()), counts


def test_adding_an_engine_moves_only_its_share_of_the_sessions():
    before = {s: pick(s, ENGINES) for s in SESSIONS}
    after = {s: pick(s, (*ENGINES, "llm_d")) for s in SESSIONS}
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert all(after[s] == "llm_d" for s in moved)  # only to the new engine
    assert 180 < len(moved) < 320, len(moved)  # ~1/4 of 1000


def test_removing_an_engine_moves_only_its_sessions():
    before = {s: pick(s, ENGINES) for s in SESSIONS}
    after = {s: pick(s, ENGINES[:2]) for s in SESSIONS}
    assert all(after[s] == before[s] for s in SESSIONS if before[s] != "llm_c")


def test_requests_without_a_session_go_to_the_least_busy_engine():
    router = EngineRouter(ENGINES)
    with router.route(None) as first, router.route(None) as second:
        assert {first, second} <= set(ENGINES) and first != second
        third = router.pick(None)
        assert third not in (first, second)  # the idle one
        assert router.in_flight == {first: 1, second: 1, third: 0}
    assert router.in_flight == dict.fromkeys(ENGINES, 0)


def test_the_least_busy_engine_counts_session_requests_too():
    router = EngineRouter(("llm_a", "llm_b"))
    session = next(s for s in SESSIONS if pick(s, ("llm_a", "llm_b")) == "llm_a")
    with router.route(session) as engine:
        assert engine == "llm_a"
        assert router.pick(None) == "llm_b"
        assert router.pick(None) == "llm_b"  # still the only idle one


def test_idle_engines_take_turns():
    router = EngineRouter(ENGINES)
    assert [router.pick(None) for _ in range(6)] == [*ENGINES, *ENGINES]


def test_an_in_flight_count_is_released_when_the_request_fails():
    router = EngineRouter(ENGINES)
    with pytest.raises(RuntimeError), router.route("s") as engine:
        assert router.in_flight[engine] == 1
        raise RuntimeError("stage failed")
    assert router.in_flight[engine] == 0


def test_one_engine_takes_everything():
    router = EngineRouter(("llm",))
    assert router.pick("any") == router.pick(None) == "llm"


@pytest.mark.parametrize("engines", [(), ("a", "a")])
def test_the_engine_list_must_be_usable(engines):
    with pytest.raises(ValueError):
        EngineRouter(engines)


# --- engines found down -------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_down_engine_is_passed_over_until_its_retry_time():
    clock = Clock()
    router = EngineRouter(ENGINES, retry_after_s=10, clock=clock)
    router.mark_down("llm_b")
    assert router.is_down("llm_b") and not router.is_down("llm_a")
    assert "llm_b" not in {router.pick(None) for _ in range(6)}
    clock.now += 9.9
    assert "llm_b" not in {router.pick(None) for _ in range(6)}
    clock.now += 0.2  # its retry time has come: it gets requests again
    assert not router.is_down("llm_b")
    assert "llm_b" in {router.pick(None) for _ in range(3)}


def test_a_down_engines_sessions_go_to_their_next_engine_in_rendezvous_order():
    router = EngineRouter(ENGINES, clock=Clock())
    router.mark_down("llm_c")
    for s in SESSIONS[:300]:
        first = pick(s, ENGINES)
        # the session's second choice when its engine is down; the others stay put
        expected = pick(s, ("llm_a", "llm_b")) if first == "llm_c" else first
        assert router.pick(s) == expected


def test_an_engine_that_answers_is_up_at_once():
    router = EngineRouter(ENGINES, clock=Clock())
    router.mark_down("llm_a")
    router.mark_up("llm_a")
    assert not router.is_down("llm_a")


def test_tried_engines_are_excluded_and_all_down_still_picks_one():
    router = EngineRouter(ENGINES, clock=Clock())
    for engine in ENGINES:
        router.mark_down(engine)
    session = SESSIONS[0]
    # every engine down: the session's own engine is tried anyway (its error reaches the client)
    assert router.pick(session) == pick(session, ENGINES)
    assert router.pick(session, exclude={pick(session, ENGINES)}) == pick(
        session, [e for e in ENGINES if e != pick(session, ENGINES)])
    with pytest.raises(ValueError, match="every engine was tried"):
        router.pick(session, exclude=ENGINES)

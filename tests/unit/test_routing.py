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

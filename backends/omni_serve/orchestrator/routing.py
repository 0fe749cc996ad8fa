"""Which of several LLM engines serves a request (runs on the orchestrator's event loop).

Triton's instance groups give no say over which instance gets a request, so
an orchestrator with several thinker engines names several Triton models
(possibly on several servers) and routes each request itself:

- a request with a session id goes to the engine that rendezvous
  (highest-random-weight) hashing of the id picks: the same engine for every
  turn of a session, so vLLM's prefix cache holds the conversation so far;
  adding an engine moves only about 1/N of the sessions, removing one moves
  only that engine's sessions;
- a request without one goes to the engine with the fewest requests in
  flight from this orchestrator (ties: the next in turn).

Pure Python, no I/O: the weights come from blake2b, not from Python's
salted `hash`, so every orchestrator process (and a client that wants to
know) computes the same engine for a session id.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def weight(session_id: str, engine: str) -> int:
    """The rendezvous weight of `engine` for `session_id` (a 64-bit integer)."""
    digest = hashlib.blake2b(f"{engine}\x00{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick(session_id: str, engines: Sequence[str]) -> str:
    """The engine of `engines` that serves session `session_id` (highest weight wins)."""
    if not engines:
        raise ValueError("no engines to pick from")
    return max(engines, key=lambda engine: (weight(session_id, engine), engine))


class EngineRouter:
    """Routes requests over `engines` and counts the requests each has in flight.

    Not thread-safe: use it from one event loop (the orchestrator's).
    """

    def __init__(self, engines: Sequence[str]):
        if not engines:
            raise ValueError("no engines to route to")
        if len(set(engines)) != len(engines):
            raise ValueError(f"engines must be distinct, got {list(engines)}")
        self.engines: tuple[str, ...] = tuple(engines)
        self.in_flight: dict[str, int] = dict.fromkeys(self.engines, 0)
        self._turn = 0  # where the search for the least busy engine starts

    def pick(self, session_id: str | None) -> str:
        """The engine for a request: its session's, else the least busy one."""
        if len(self.engines) == 1:
            return self.engines[0]
        if session_id is not None:
            return pick(session_id, self.engines)
        n = len(self.engines)
        order = [self.engines[(self._turn + i) % n] for i in range(n)]
        engine = min(order, key=lambda e: self.in_flight[e])  # first of the least busy
        self._turn = (self.engines.index(engine) + 1) % n
        return engine

    @contextmanager
    def route(self, session_id: str | None) -> Iterator[str]:
        """Pick an engine and count the request as in flight on it until the block exits."""
        engine = self.pick(session_id)
        self.in_flight[engine] += 1
        try:
            yield engine
        finally:
            self.in_flight[engine] -= 1

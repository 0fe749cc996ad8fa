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
  flight from this orchestrator (ties: the next in turn);
- an engine that was found down (the orchestrator saw UNAVAILABLE from it
  before it sent anything) is passed over for `retry_after_s`: its sessions
  go to their next engine in rendezvous order (so they, too, stay together),
  and after that time it gets requests again (the first one probes it).

The same router spreads a stage's calls over the replicas of its server
(orchestrator/replicas.py): there the "engines" are the replicas' addresses,
which change as the server's name resolves anew (`replace`), and the session
id comes from `SESSION_ID`, which OmniPipeline.run sets for its request.

Pure Python, no I/O: the weights come from blake2b, not from Python's
salted `hash`, so every orchestrator process (and a client that wants to
know) computes the same engine for a session id.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

# The session id of the request the current task runs (None: no session); each request
# is a task of its own, so this is per request.
SESSION_ID: ContextVar[str | None] = ContextVar("omni_session_id", default=None)


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

    def __init__(self, engines: Sequence[str], *, retry_after_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if not engines:
            raise ValueError("no engines to route to")
        if len(set(engines)) != len(engines):
            raise ValueError(f"engines must be distinct, got {list(engines)}")
        self.engines: tuple[str, ...] = tuple(engines)
        self.in_flight: dict[str, int] = dict.fromkeys(self.engines, 0)
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._down_until: dict[str, float] = {}  # engine -> when it gets requests again
        self._turn = 0  # where the search for the least busy engine starts

    def replace(self, engines: Sequence[str]) -> None:
        """Route over `engines` from now on (a replica set resolved anew). Requests in
        flight on an engine that is gone still count until they end; one that comes
        back keeps no down mark from before."""
        if not engines:
            raise ValueError("no engines to route to")
        if len(set(engines)) != len(engines):
            raise ValueError(f"engines must be distinct, got {list(engines)}")
        self.engines = tuple(engines)
        for engine in self.engines:
            self.in_flight.setdefault(engine, 0)
        for engine in [e for e, n in self.in_flight.items() if not n and e not in self.engines]:
            del self.in_flight[engine]
        self._down_until = {e: t for e, t in self._down_until.items() if e in self.engines}
        self._turn %= len(self.engines)

    # --- health -------------------------------------------------------------------
    def mark_down(self, engine: str) -> None:
        """`engine` did not answer: pass it over for `retry_after_s`."""
        self._down_until[engine] = self._clock() + self.retry_after_s

    def mark_up(self, engine: str) -> None:
        """`engine` answered: route to it again at once."""
        self._down_until.pop(engine, None)

    def is_down(self, engine: str) -> bool:
        return self._clock() < self._down_until.get(engine, float("-inf"))

    # --- picking ------------------------------------------------------------------
    def pick(self, session_id: str | None, exclude: Collection[str] = ()) -> str:
        """The engine for a request: its session's, else the least busy one.

        Engines in `exclude` (already tried for this request) are skipped and
        engines that are down come last; when every engine left is down, the
        preferred one is tried anyway (its error then reaches the client).
        """
        left = [e for e in self.engines if e not in exclude]
        if not left:
            raise ValueError("every engine was tried")
        up = [e for e in left if not self.is_down(e)] or left
        if len(up) == 1:
            return up[0]
        if session_id is not None:
            return pick(session_id, up)  # rendezvous: the next engine in the session's order
        n = len(self.engines)
        order = [e for i in range(n) if (e := self.engines[(self._turn + i) % n]) in up]
        engine = min(order, key=lambda e: self.in_flight[e])  # first of the least busy
        self._turn = (self.engines.index(engine) + 1) % n
        return engine

    @contextmanager
    def route(self, session_id: str | None, exclude: Collection[str] = ()) -> Iterator[str]:
        """Pick an engine and count the request as in flight on it until the block exits."""
        engine = self.pick(session_id, exclude)
        self.in_flight[engine] += 1
        try:
            yield engine
        finally:
            self.in_flight[engine] -= 1
            if not self.in_flight[engine] and engine not in self.engines:
                del self.in_flight[engine]  # gone since (replace)

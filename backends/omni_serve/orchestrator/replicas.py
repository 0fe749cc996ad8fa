"""Replicas of one stage server behind one name (runs on the orchestrator's event loop).

A server's URL may name several replicas (locality.parse_target: `dns:///name:port`,
`ipv4:a:p,b:p`, `host:p,host:p`). gRPC's own `round_robin` over one channel would
spread calls, but it cannot keep a conversation on one replica, nor say which
replica failed, so a ReplicatedStageClient keeps one GrpcStageClient (its own
channels) per address and picks per call with routing.EngineRouter:

- a stream of a request with a session id (routing.SESSION_ID) goes to the replica
  rendezvous hashing picks for it (vLLM's prefix cache keeps the conversation);
  other calls go to the replica with the fewest calls in flight;
- a replica that fails UNAVAILABLE before answering is passed over for
  `retry_after_s` and the call goes on to the next replica (a full one is tried
  next without being marked down); a failure after it answered ends the call,
  UNAVAILABLE naming the replica;
- a `dns:` name is resolved on first use, again `refresh_s` after that, and
  soon after a replica fails: new addresses get clients, the clients of
  addresses gone are closed once their calls have ended.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import numpy as np

from omni_serve.errors import is_overloaded
from omni_serve.orchestrator.grpc_client import GrpcStageClient
from omni_serve.orchestrator.locality import ReplicaTarget, resolve
from omni_serve.orchestrator.pipeline import StageCallError
from omni_serve.orchestrator.routing import SESSION_ID, EngineRouter

log = logging.getLogger(__name__)

# gRPC's DNS resolver asks again at most every 30 s; so does this, and sooner after a failure
REFRESH_S = 30.0
REFRESH_AFTER_FAILURE_S = 1.0


class ReplicatedStageClient:
    """StageClient over the replicas `target` names; `make_client(address)` makes the
    GrpcStageClient of one replica. Create and use it on one event loop."""

    def __init__(self, target: ReplicaTarget, make_client: Callable[[str], GrpcStageClient], *,
                 retry_after_s: float = 10.0, refresh_s: float = REFRESH_S,
                 resolver: Callable[[ReplicaTarget], Awaitable[Sequence[str]]] = resolve,
                 clock: Callable[[], float] = time.monotonic):
        self.target = target
        self.url = target.url
        self.retry_after_s = retry_after_s
        self.refresh_s = refresh_s
        self._make = make_client
        self._resolve = resolver
        self._clock = clock
        self.clients: dict[str, GrpcStageClient] = {}
        self.router: EngineRouter | None = None  # on first use
        self._resolved_at = float("-inf")
        self._refresh_after: float | None = None  # a failure asks for an earlier refresh
        self._resolving: asyncio.Future | None = None
        self._closing: set[asyncio.Task] = set()

    # --- the replica set ------------------------------------------------------------
    async def replicas(self) -> tuple[str, ...]:
        """The addresses calls go to now (resolving the name first if it is time)."""
        now = self._clock()
        due = self._resolved_at + self.refresh_s
        if self._refresh_after is not None:
            due = min(due, self._refresh_after)
        if self.router is None:
            await asyncio.shield(self._resolve_once())  # every caller waits for the first
        elif now >= due:  # the calls go on meanwhile, to the replicas known
            self._resolve_once().add_done_callback(lambda f: f.cancelled() or f.exception())
        if self.router is None:
            raise StageCallError("UNAVAILABLE", f"{self.url} is unavailable: no replica "
                                                "resolved yet")
        return self.router.engines

    def _resolve_once(self) -> asyncio.Future:
        if self._resolving is None or self._resolving.done():
            self._resolving = asyncio.ensure_future(self._refresh())
        return self._resolving

    async def _refresh(self) -> None:
        self._refresh_after = None
        try:
            addresses = tuple(await self._resolve(self.target))
            if not addresses:
                raise OSError("no addresses")
        except OSError as e:
            self._resolved_at = self._clock()
            if self.router is None:
                raise StageCallError("UNAVAILABLE", f"{self.url} is unavailable: its name "
                                                    f"does not resolve ({e})") from e
            log.warning("%s: resolving its replicas failed (%s); calling the %d known",
                        self.url, e, len(self.router.engines))
            return
        self._resolved_at = self._clock()
        self._apply(addresses)

    def _apply(self, addresses: tuple[str, ...]) -> None:
        known = self.router.engines if self.router else ()
        if set(addresses) != set(known):
            log.info("%s: replicas %s", self.url, ", ".join(addresses))
        for a in addresses:
            if a not in self.clients:
                self.clients[a] = self._make(a)
        if self.router is None:
            self.router = EngineRouter(addresses, retry_after_s=self.retry_after_s,
                                       clock=self._clock)
        else:
            self.router.replace(addresses)
        for a in [a for a in self.clients if a not in addresses]:
            self._close_if_idle(a)

    def _close_if_idle(self, address: str) -> None:
        """Close the client of a replica that is gone once no call uses it."""
        if self.router is None or address in self.router.engines \
                or self.router.in_flight.get(address):
            return
        client = self.clients.pop(address, None)
        if client is not None:
            task = asyncio.get_running_loop().create_task(client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _failed(self, address: str, e: StageCallError) -> bool:
        """Note a replica's UNAVAILABLE before it answered; whether it is marked down (a
        full replica is not: it is busy, not gone)."""
        if is_overloaded(e.message):
            return False
        self.router.mark_down(address)
        self._refresh_after = self._clock() + REFRESH_AFTER_FAILURE_S
        return True

    def _named(self, address: str, e: StageCallError) -> StageCallError:
        """`e`, naming the replica when it is UNAVAILABLE (a request's own error, such as
        INVALID_ARG, is the same on every replica and keeps its message)."""
        if e.code != "UNAVAILABLE":
            return e
        return StageCallError(e.code, f"replica {address} of {self.url} is unavailable: "
                                      f"{e.message}")

    def _give_up(self, address: str, e: StageCallError, tried: list[str],
                 answered: bool) -> StageCallError | None:
        """The error to raise for a failed call on `address`, or None to try the next."""
        tried.append(address)
        if answered or e.code != "UNAVAILABLE":
            return self._named(address, e)
        marked = self._failed(address, e)
        if all(a in tried for a in self.router.engines):
            return self._named(address, e)
        log.warning("replica %s of %s: %s; %s", address, self.url, e.message,
                    f"passing it over for {self.retry_after_s:g} s" if marked else "it is full")
        return None

    # --- calls ------------------------------------------------------------------------
    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> dict[str, np.ndarray]:
        await self.replicas()
        tried: list[str] = []
        while True:
            with self.router.route(None, exclude=tried) as address:
                try:
                    out = await self.clients[address].infer(model, inputs, outputs)
                except StageCallError as e:
                    if (error := self._give_up(address, e, tried, answered=False)) is not None:
                        raise error from e
                    continue
                finally:
                    self._after_call(address)
            self.router.mark_up(address)
            return out

    async def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str], *,
                     request_id: str, timeout_s: float,
                     unread: Callable[[dict[str, np.ndarray]], None] | None = None,
                     ) -> AsyncIterator[dict[str, np.ndarray]]:
        await self.replicas()
        session = SESSION_ID.get()
        tried: list[str] = []
        while True:
            with self.router.route(session, exclude=tried) as address:
                answered = False
                try:
                    async with contextlib.aclosing(self.clients[address].stream(
                            model, inputs, outputs, request_id=request_id,
                            timeout_s=timeout_s, unread=unread)) as responses:
                        async for out in responses:
                            if not answered:
                                answered = True
                                self.router.mark_up(address)
                            yield out
                    return
                except StageCallError as e:
                    if (error := self._give_up(address, e, tried, answered)) is not None:
                        raise error from e
                finally:
                    self._after_call(address)

    def _after_call(self, address: str) -> None:
        # the router counts the call until its `with` exits: look once that has happened
        asyncio.get_running_loop().call_soon(self._close_if_idle, address)

    async def unready(self, model: str) -> str | None:
        """None when some replica has `model` ready, else why none has (the name is
        resolved anew first)."""
        try:
            if self.router is None:
                await self.replicas()
            else:
                await asyncio.shield(self._resolve_once())
        except StageCallError as e:
            return e.message
        addresses = self.router.engines
        found = await asyncio.gather(*(self.clients[a].unready(model) for a in addresses))
        if any(why is None for why in found):
            return None
        return "; ".join(why for why in found if why)

    async def close(self) -> None:
        if self._resolving is not None and not self._resolving.done():
            self._resolving.cancel()
        for client in list(self.clients.values()):
            await client.close()
        self.clients.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

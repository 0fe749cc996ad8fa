"""Which server each stage's calls go to (runs on the orchestrator's event loop).

The orchestrator's stages run on this server by default; a spec may place some on
other servers (`remote:` in the orchestrator's config). `stage_client` makes one
GrpcStageClient per server (a ReplicatedStageClient for a server whose URL names
several replicas) and, when some stages are remote, a RoutingStageClient that
sends each model's calls to its server.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from omni_serve.orchestrator.grpc_client import GrpcStageClient
from omni_serve.orchestrator.locality import RemoteEndpoint, parse_target
from omni_serve.orchestrator.replicas import ReplicatedStageClient
from omni_serve.stubs import StubWatch

ServerClient = GrpcStageClient | ReplicatedStageClient


class RoutingStageClient:
    """Sends each model's calls to the server that has it (the local one by default)."""

    def __init__(self, local: GrpcStageClient, remote: dict[str, ServerClient]):
        self.local = local
        self.remote = remote

    def _for(self, model: str) -> ServerClient:
        return self.remote.get(model, self.local)

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> dict[str, np.ndarray]:
        return await self._for(model).infer(model, inputs, outputs)

    def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str], *,
               request_id: str, timeout_s: float,
               unread: Callable[[dict[str, np.ndarray]], None] | None = None,
               ) -> AsyncIterator[dict[str, np.ndarray]]:
        return self._for(model).stream(model, inputs, outputs, request_id=request_id,
                                       timeout_s=timeout_s, unread=unread)

    async def remote_unready(self) -> dict[str, str]:
        """Each remote stage no server (or replica) of it has ready now, and why."""
        models = list(self.remote)
        found = await asyncio.gather(*(self.remote[m].unready(m) for m in models))
        return {m: why for m, why in zip(models, found) if why is not None}

    async def close(self) -> None:
        for client in dict.fromkeys([self.local, *self.remote.values()]):
            await client.close()


def stage_client(local_url: str, remote: dict[str, str | RemoteEndpoint], *,
                 call_timeout_s: float = 300.0, retry_after_s: float = 10.0,
                 watch_stubs: bool = False) -> GrpcStageClient | RoutingStageClient:
    """One gRPC client per server; a router when some stages are remote.

    `call_timeout_s` bounds each unary call; `retry_after_s`: how long a replica that
    did not answer is passed over (a server whose URL names several);
    `watch_stubs`: `local_url` is the server this orchestrator runs in (its stub
    registry tells which stages died).
    """
    local = GrpcStageClient(local_url, call_timeout_s=call_timeout_s,
                            stubs=StubWatch() if watch_stubs else None)
    if not remote:
        return local
    by_endpoint: dict[RemoteEndpoint, ServerClient] = {}
    clients = {}
    for model, where in remote.items():
        ep = RemoteEndpoint(where) if isinstance(where, str) else where
        if ep not in by_endpoint:
            by_endpoint[ep] = _server_client(ep, call_timeout_s, retry_after_s)
        clients[model] = by_endpoint[ep]
    return RoutingStageClient(local, clients)


def _server_client(ep: RemoteEndpoint, call_timeout_s: float,
                   retry_after_s: float) -> ServerClient:
    def one(url: str) -> GrpcStageClient:
        return GrpcStageClient(url, ep.shared_memory, ep.shared_memory_min_bytes,
                               call_timeout_s=call_timeout_s)

    target = parse_target(ep.url)
    if target is None:
        return one(ep.url)
    return ReplicatedStageClient(target, one, retry_after_s=retry_after_s)

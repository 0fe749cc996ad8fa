"""Stages of this server whose Python stub died: failing their calls, taking them down.

Runs on the orchestrator's event loop, inside the GrpcStageClient of this
server (orchestrator/grpc_client.py); stages of other servers have none.
What flows through it: a stage name and the awaitable of a call to it come
in; the call's result goes back, or StageCallError UNAVAILABLE as soon as the
stub registry (omni_serve.stubs) says one of the stage's stubs died, checked
every `STUB_POLL_S`, instead of a wait for responses that never come. The
first such failure unloads the stage where the server allows model control,
so its readiness says so; once a model-control load has registered new stubs,
the stage is forgotten and called again.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from omni_serve.orchestrator.pipeline import StageCallError
from omni_serve.stubs import StubWatch

log = logging.getLogger(__name__)

# How often a call waiting on a stage of this server checks that the stage's stubs live.
STUB_POLL_S = 0.25

T = TypeVar("T")


class StubGuard:
    """Dead-stub checks for the stages in `stubs` (None: no checks), unloading through
    `connect()`, the server's tritonclient asyncio client."""

    def __init__(self, stubs: StubWatch | None, connect: Callable[[], Any]):
        self.stubs = stubs  # this server's stub registry (its own stages only)
        self.taken_down: dict[str, asyncio.Task] = {}  # stage -> task waiting for its return
        self._connect = connect

    async def watched(self, model: str, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, checking every STUB_POLL_S that `model`'s stubs still live."""
        if self.stubs is None:
            return await awaitable
        future = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=STUB_POLL_S)
                if done:
                    return future.result()
                self.check(model)
        finally:
            if not future.done():
                future.cancel()

    def check(self, model: str) -> None:
        """Raise UNAVAILABLE when a stub of `model` died (and take the model down)."""
        if self.stubs is None or not (dead := self.stubs.dead(model)):
            return
        instance, pid = dead[0]
        if model not in self.taken_down:
            log.error("stage %s: its Python stub %s (pid %d) died; its requests fail "
                      "UNAVAILABLE until it is loaded again", model, instance, pid)
            self.taken_down[model] = asyncio.get_running_loop().create_task(
                self._take_down(model))
        raise StageCallError("UNAVAILABLE", (
            f"stage {model} is unavailable: its Python stub {instance} (pid {pid}) died; "
            f"it serves again once the model is loaded again (model-control load, or a "
            f"server restart)"))

    async def _take_down(self, model: str) -> None:
        """Unload `model` where model control allows it, so its readiness tells the truth;
        forget it once it is back (its new stubs registered)."""
        from tritonclient.utils import InferenceServerException

        try:
            await self._connect().unload_model(model)
            self.stubs.forget(model)
            log.error("stage %s unloaded; load it to bring it back", model)
        except InferenceServerException as e:
            log.error("stage %s cannot be unloaded (%s): Triton 2.51 does not restart a dead "
                      "stub; restart the server, or run it with --model-control-mode=explicit "
                      "and load the model again", model, e.message())
        while self.stubs.dead(model):
            await asyncio.sleep(1.0)
        self.taken_down.pop(model, None)

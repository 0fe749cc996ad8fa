"""System shared memory for stage calls to a server on this host (runs in the
orchestrator's stub): which inputs go to a region, and the per-call regions registered
with one server, released however the call ends.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets

import numpy as np

from omni_serve.errors import exc_code

log = logging.getLogger(__name__)

SHM_PREFIX = "omni_shm"  # /dev/shm/omni_shm_<pid>_<token>_<n> while a region is being filled
_ALIGN = 64



def shm_layout(inputs: dict[str, np.ndarray], min_bytes: int) -> tuple[dict[str, int], int]:
    """Which inputs go to shared memory (numeric, at least `min_bytes`): name -> offset, size."""
    offsets: dict[str, int] = {}
    size = 0
    for name, arr in inputs.items():
        arr = np.asarray(arr)
        if arr.dtype == np.object_ or arr.nbytes < min_bytes:
            continue
        offsets[name] = size
        size += -(-arr.nbytes // _ALIGN) * _ALIGN
    return offsets, size


class ShmRegions:
    """Per-call system shared-memory regions registered with one server.

    `place()` makes one region per call, registers it and unlinks its /dev/shm
    name; `release()` unregisters it in the background, retrying while the
    server still holds the request (Triton >= 2.50 refuses to unregister a
    region in use); `close()` unregisters whatever is left.
    """

    def __init__(self, retry_s: float = 30.0):
        self.prefix = f"{SHM_PREFIX}_{os.getpid()}_{secrets.token_hex(3)}"
        self._n = itertools.count()
        self.registered: set[str] = set()  # on the server, not yet unregistered
        self.retry_s = retry_s
        self._releases: set[asyncio.Task] = set()

    async def place(self, client, inputs: dict[str, np.ndarray],
                    offsets: dict[str, int], size: int) -> str:
        """Copy `inputs[offsets]` into a new region registered with `client`'s server."""
        import tritonclient.utils.shared_memory as shm

        name = f"{self.prefix}_{next(self._n)}"
        handle = shm.create_shared_memory_region(name, f"/{name}", size, create_only=True)
        try:
            for tensor, offset in offsets.items():
                shm.set_shared_memory_region(handle, [np.ascontiguousarray(inputs[tensor])], offset)
            self.registered.add(name)  # even a cancelled register may have reached the server
            try:
                await client.register_system_shared_memory(name, f"/{name}", size)
            except BaseException:
                self.release(client, name)
                raise
        finally:
            shm.destroy_shared_memory_region(handle)  # the server keeps its own mapping
        return name

    def release(self, client, name: str) -> None:
        """Unregister `name` from the server (in the background, retried while in use)."""
        task = asyncio.get_running_loop().create_task(self._unregister(client, name))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _unregister(self, client, name: str) -> None:
        from tritonclient.utils import InferenceServerException

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_s
        delay = 0.01
        while True:
            try:
                await client.unregister_system_shared_memory(name)
                self.registered.discard(name)
                return
            except InferenceServerException as e:
                if loop.time() + delay > deadline:
                    log.warning("could not unregister shared memory region %s (%s); "
                                "trying again at shutdown", name, e.message())
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def drain(self) -> None:
        """Wait for the releases in flight."""
        while self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)

    async def close(self, client, timeout_s: float = 5.0) -> None:
        """Unregister every region still registered (at orchestrator shutdown).

        Retries for up to `timeout_s` while the server still holds a cancelled
        request's region; gives up at once when the server is unreachable.
        """
        for task in list(self._releases):
            task.cancel()
        await asyncio.gather(*list(self._releases), return_exceptions=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        error: Exception | None = None
        while self.registered and loop.time() < deadline:
            for name in sorted(self.registered):
                try:
                    async with asyncio.timeout(max(0.1, deadline - loop.time())):
                        await client.unregister_system_shared_memory(name)
                    self.registered.discard(name)
                except Exception as e:
                    error = e
                    if hasattr(e, "status") and exc_code(e) == "UNAVAILABLE":
                        deadline = 0.0  # the server is gone, and its regions with it
                        break
            if self.registered:
                await asyncio.sleep(0.1)
        if self.registered:
            log.warning("shared memory regions left registered: %s (%s)",
                        ", ".join(sorted(self.registered)), error)



"""The orchestrator's StageClient over BLS (runs in the orchestrator's stub; `transport:
bls`): pb_utils.InferenceRequest calls to the other models of this server, blocking
calls on a thread pool of their own, results handed to the event loop.

Triton 2.51's BLS is not usable under load here (docs/omni-chat.md); gRPC is the
default transport. Kept for servers where BLS is preferred.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from omni_serve.errors import code_of_message
from omni_serve.tritonio import pb

log = logging.getLogger(__name__)

# Triton 2.51 hands BLS callers every child error as INTERNAL (the code is lost,
# the message kept): the code is read back from the message, as on a gRPC stream
# without the strict-errors header. A stage model the server does not know is
# not loaded (UNAVAILABLE).


def _error_code(error) -> str:
    pb_utils = pb()
    code = error.code() if hasattr(error, "code") else None
    for name in ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "NOT_FOUND"):
        if code is not None and code == getattr(pb_utils.TritonError, name, object()):
            return "UNAVAILABLE" if name == "NOT_FOUND" else name
    message = error.message()
    if "unknown model" in message.lower():
        return "UNAVAILABLE"
    code = code_of_message(message)
    return "UNAVAILABLE" if code == "DEADLINE_EXCEEDED" else code


class BlsStageClient:
    """The orchestrator's StageClient over BLS (pb_utils.InferenceRequest).

    BLS calls block, so they run on a dedicated thread pool (one thread per
    call in flight, streams included) and hand results to the event loop.
    Triton 2.51 cannot cancel a BLS child stream, so leaving a stream early
    sends the stage an abort control request naming the child's request id
    (omni_llm honours it), and the child then ends on its own.
    """

    def __init__(self, max_threads: int = 256):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="bls")

    @staticmethod
    def _request(model: str, inputs: dict[str, np.ndarray], outputs, request_id: str = "",
                 parameters: dict[str, Any] | None = None):
        pb_utils = pb()
        kwargs: dict[str, Any] = {
            "model_name": model,
            "inputs": [pb_utils.Tensor(name, arr) for name, arr in inputs.items()],
            "requested_output_names": list(outputs),
        }
        if request_id:
            kwargs["request_id"] = request_id
        if parameters:
            kwargs["parameters"] = parameters
        return pb_utils.InferenceRequest(**kwargs)

    @staticmethod
    def _outputs(response, outputs) -> dict[str, np.ndarray]:
        """The response's outputs as numpy arrays that own their memory.

        `as_numpy()` may be a view into the response's shared memory, which is
        freed with the response object: copy before the response goes away
        (keeping views crashed the stub under load). Runs on the thread that
        received the response; only plain arrays cross to the event loop.
        """
        from omni_serve.orchestrator.pipeline import StageCallError

        if response.has_error():
            error = response.error()
            raise StageCallError(_error_code(error), error.message())
        pb_utils = pb()
        out = {}
        for name in outputs:
            tensor = pb_utils.get_output_tensor_by_name(response, name)
            if tensor is not None:
                out[name] = np.array(tensor.as_numpy(), copy=True)
        return out

    async def infer(self, model: str, inputs: dict[str, np.ndarray], outputs) -> dict[str, np.ndarray]:
        import asyncio

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, lambda: self._outputs(self._request(model, inputs, outputs).exec(), outputs))

    async def stream(self, model: str, inputs: dict[str, np.ndarray], outputs, *,
                     request_id: str, timeout_s: float, unread=None):
        import asyncio

        from omni_serve.orchestrator.pipeline import StageCallError

        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)  # noqa: E731

        def pump() -> None:
            try:
                for response in self._request(model, inputs, outputs, request_id).exec(decoupled=True):
                    try:
                        put(("outputs", self._outputs(response, outputs)))
                    except StageCallError as e:
                        put(("error", e))
            except Exception as e:  # reported to the consumer
                put(("exception", e))
            finally:
                put(("end", None))

        loop.run_in_executor(self._pool, pump)
        finished = False
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout_s):  # wait_for can lose a cancel (3.11)
                        kind, item = await q.get()
                except TimeoutError:
                    raise StageCallError("UNAVAILABLE", f"no response for {timeout_s:g} s") from None
                if kind == "end":
                    finished = True
                    return
                if kind == "exception":
                    finished = True
                    raise StageCallError("INTERNAL", f"{type(item).__name__}: {item}")
                if kind == "error":
                    raise item
                if item:
                    yield item
        finally:
            if not finished:
                self._pool.submit(self._abort, model, request_id)
                if unread is not None:  # what was queued; later responses are not seen here
                    while not q.empty():
                        kind, item = q.get_nowait()
                        if kind == "outputs" and item:
                            unread(item)

    def _abort(self, model: str, request_id: str) -> None:
        from omni_serve.contract import LLM

        try:
            request = self._request(model, {}, [LLM.FINISH_REASON],
                                    parameters={LLM.ABORT_PARAMETER: request_id})
            for _ in request.exec(decoupled=True):
                pass
        except Exception:  # the stage may be gone; nothing left to stop
            log.warning("could not abort %s on %s", request_id, model, exc_info=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

"""The orchestrator's StageClient over Triton gRPC (runs on the orchestrator's event loop).

Every stage call is an ordinary Triton gRPC request, to this server (the
default: its gRPC endpoint is read from the tritonserver command line) or to
another one: unary calls and server requests through tritonclient's asyncio
client, streams through omni_serve.grpc_stream on a StreamChannel of their
own (each created on first use, with the same channel arguments, and closed
with this client). No Python-backend objects cross threads. Errors keep their
gRPC status: from the `triton_grpc_error` stream header on a server that
survives it (Triton >= 2.53, asked once per server), else read back from the
in-band message (omni_serve.errors.code_of_message).

Calls are stopped without gRPC cancels, because Triton 2.51 can abort the
server when a cancel races a request's completion (upstream issue #7368): a
stream whose consumer stops gets an in-band `omni_abort` control request and
is read to its end by a task of its own (omni_llm ends it with a final
"abort" response). Unary calls (encoders, DiT, codec decoder) are cancelled
with gRPC: on 2.51 that race is survived (`omni-bench unary-cancel`:
6000 cancels racing queueing, execution and completion, server alive), and
a cancelled request still queued is never computed.
A gRPC cancel is the last resort, for a stream not ended `abort_grace_s`
after its abort.

A stage of this server whose Python stub died (omni_serve.stubs) fails its
calls at once and those in flight soon after, UNAVAILABLE, and is unloaded
where the server allows model control (orchestrator/stub_guard.py).

A stage on another server on this host (orchestrator/locality.py says which) gets
its large inputs (the thinker's `mm_embeds`) through Triton system shared memory
(orchestrator/shm.py) instead of inside the gRPC
message: per call, one POSIX region holds every input of at least
`min_bytes`; it is registered with that server, unlinked from /dev/shm at
once (the server keeps its own mapping, so nothing leaks if this process
dies), and unregistered when the call ends, however it ends. Outputs stay on
gRPC (a decoupled stream's responses cannot be placed in advance).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np
from tritonclient.utils import np_to_triton_dtype

from omni_serve.errors import call_code, exc_code
from omni_serve.orchestrator.config import SHM_MIN_BYTES_DEFAULT
from omni_serve.orchestrator.locality import use_shared_memory
from omni_serve.orchestrator.pipeline import StageCallError
from omni_serve.orchestrator.shm import ShmRegions, shm_layout
from omni_serve.orchestrator.stub_guard import StubGuard
from omni_serve.stubs import StubWatch

log = logging.getLogger(__name__)

# How long a stream stopped in-band may take to end before its call is cancelled.
ABORT_GRACE_S = 5.0
# A stage server that was down and is back (its operator restarted it) is called again
# within this long: gRPC's default reconnect back-off grows to 120 s, and every call
# meanwhile fails at once with UNAVAILABLE.
RECONNECT_BACKOFF_MAX_MS = 1000


def _channel_args() -> list[tuple[str, int]]:
    """tritonclient's own channel arguments, with a reconnect back-off capped."""
    from omni_serve.grpc_stream import channel_args

    return [*channel_args(),
            ("grpc.initial_reconnect_backoff_ms", min(250, RECONNECT_BACKOFF_MAX_MS)),
            ("grpc.min_reconnect_backoff_ms", min(250, RECONNECT_BACKOFF_MAX_MS)),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS)]


class GrpcStageClient:
    """StageClient over Triton gRPC; create and use it on one event loop.

    With `shared_memory` ("auto": when `url` is on this host; "system": always)
    inputs of at least `shared_memory_min_bytes` travel in system shared memory.
    In "auto" a server that cannot open the region (another machine or IPC
    namespace, or client shared memory disabled on it) turns it off for good.
    """

    def __init__(self, url: str, shared_memory: str = "none",
                 shared_memory_min_bytes: int = SHM_MIN_BYTES_DEFAULT, *,
                 call_timeout_s: float = 300.0, abort_grace_s: float = ABORT_GRACE_S,
                 stubs: StubWatch | None = None):
        self.url = url
        self._client = None
        self.stub_guard = StubGuard(stubs, self._connect)  # stubs: this server's stages only
        self._stream_channel = None  # omni_serve.grpc_stream.StreamChannel, on first stream
        self.shm_mode = shared_memory
        self.shm_min_bytes = shared_memory_min_bytes
        self.shm: ShmRegions | None = ShmRegions() if use_shared_memory(shared_memory, url) else None
        self.call_timeout_s = call_timeout_s
        self.abort_grace_s = abort_grace_s
        self._stopping: set[asyncio.Task] = set()  # streams being aborted in-band
        self._strict: bool | None = None  # whether the server takes the strict-errors header

    def _connect(self):
        if self._client is None:
            import tritonclient.grpc.aio as grpcaio

            self._client = grpcaio.InferenceServerClient(self.url, channel_args=_channel_args())
        return self._client

    def _stream_stub(self):
        """The service stub of this client's StreamChannel (created on first use)."""
        if self._stream_channel is None:
            from omni_serve.grpc_stream import StreamChannel

            self._stream_channel = StreamChannel(self.url, _channel_args())
        return self._stream_channel.stub

    async def _strict_errors(self) -> bool:
        if self._strict is None:
            from omni_serve.grpc_stream import strict_errors_safe

            self._strict = await strict_errors_safe(self._connect())
        return bool(self._strict)

    @staticmethod
    def _inputs(placed: dict):
        """`placed` (see _placed) as tritonclient InferInputs, for a unary call."""
        import tritonclient.grpc as grpcclient

        from omni_serve.grpc_stream import SharedMemoryInput

        out = []
        for name, value in placed.items():
            if isinstance(value, SharedMemoryInput):
                tensor = grpcclient.InferInput(name, list(value.shape), value.datatype)
                tensor.set_shared_memory(value.region, value.byte_size, value.offset)
            else:
                tensor = grpcclient.InferInput(name, list(value.shape),
                                               np_to_triton_dtype(value.dtype))
                tensor.set_data_from_numpy(value)
            out.append(tensor)
        return out

    @staticmethod
    def _located(inputs: dict[str, np.ndarray], region: str | None = None,
                 offsets: dict[str, int] | None = None) -> dict:
        """Each input by name: its array (inline), or where it lies in `region`."""
        from omni_serve.grpc_stream import SharedMemoryInput

        out: dict = {}
        for name, arr in inputs.items():
            arr = np.asarray(arr)
            if region is not None and offsets and name in offsets:
                out[name] = SharedMemoryInput(np_to_triton_dtype(arr.dtype), tuple(arr.shape),
                                              region, arr.nbytes, offsets[name])
            else:
                out[name] = arr
        return out

    async def _place(self, inputs: dict[str, np.ndarray]):
        """The call's InferInputs and its shared-memory region (None: all inline)."""
        placed, region = await self._placed(inputs)
        return self._inputs(placed), region

    async def _placed(self, inputs: dict[str, np.ndarray]):
        """The call's inputs by name (numpy arrays inline, SharedMemoryInputs placed) and
        its shared-memory region (None: all inline)."""
        if self.shm is None:
            return self._located(inputs), None
        offsets, size = shm_layout(inputs, self.shm_min_bytes)
        if not offsets:
            return self._located(inputs), None
        from tritonclient.utils import InferenceServerException
        from tritonclient.utils.shared_memory import SharedMemoryException

        try:
            region = await self.shm.place(self._connect(), inputs, offsets, size)
        except SharedMemoryException as e:  # this host's side, e.g. /dev/shm is full
            if self.shm_mode == "system":
                raise StageCallError("INTERNAL", f"system shared memory for {self.url}: "
                                                 f"{e} ({e.__cause__})") from e
            log.warning("no system shared memory for this call to %s (%s: %s); sending its "
                        "inputs over gRPC", self.url, e, e.__cause__)
            return self._located(inputs), None
        except InferenceServerException as e:
            code = exc_code(e)
            if self.shm_mode == "system" or code == "UNAVAILABLE":
                raise StageCallError(code, f"registering system shared memory with {self.url}: "
                                           f"{e.message()}") from e
            log.warning("%s cannot use this host's shared memory (%s); sending inputs over "
                        "gRPC from now on", self.url, e.message())
            self.shm = None
            return self._located(inputs), None
        return self._located(inputs, region, offsets), region

    def _release(self, region: str | None) -> None:
        if region is not None and self.shm is not None:
            self.shm.release(self._connect(), region)

    @staticmethod
    def _outputs(result, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        names = {o.name for o in result.get_response().outputs}
        return {name: result.as_numpy(name) for name in outputs if name in names}

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One unary call; if the caller is cancelled, so is the call: a request still in the
        stage's queue is dropped there (Triton's dynamic batcher, or the adapter's
        `parse_each` when its batch was forming) and never computed. Its shared memory
        is released when the call ends."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self.stub_guard.check(model)
        infer_inputs, region = await self._place(inputs)
        call = asyncio.ensure_future(self._connect().infer(
            model, infer_inputs, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
            client_timeout=self.call_timeout_s))
        call.add_done_callback(lambda _: self._release(region))
        try:
            result = await self.stub_guard.watched(model, asyncio.shield(call))
        except InferenceServerException as e:
            raise StageCallError(exc_code(e), e.message()) from e
        except (asyncio.CancelledError, StageCallError):
            # nobody awaits the call now: retrieve its outcome so asyncio does not report it
            call.add_done_callback(lambda c: c.cancelled() or c.exception())
            call.cancel()
            raise
        return self._outputs(result, outputs)

    async def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str], *,
                     request_id: str, timeout_s: float,
                     unread: Callable[[dict[str, np.ndarray]], None] | None = None,
                     ) -> AsyncIterator[dict[str, np.ndarray]]:
        """One streamed request; a consumer that stops early stops it in-band, and the
        responses it did not read go to `unread` (StageClient.stream).

        The responses are read by a task of their own, so cancelling the
        consumer never cancels the gRPC call: the stage gets an `omni_abort`
        control request naming `request_id`, ends the request with a final
        "abort" response, and the stream closes normally. Only a stage that
        does not end it within `abort_grace_s` has its call cancelled.
        """
        self.stub_guard.check(model)
        placed, region = await self._placed(inputs)
        responses: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(self._read(model, placed, outputs, request_id,
                                                  timeout_s, responses))
        answered = False
        ended = False
        try:
            while True:
                kind, item = await self.stub_guard.watched(model, responses.get())
                if kind == "end":
                    ended = True
                    return
                if kind == "error":
                    ended = True
                    raise await self._stream_error(model, item, answered, timeout_s)
                answered = True
                out = self._outputs(item, outputs)
                if out:
                    yield out
        finally:
            if not ended and unread is not None:
                reader.add_done_callback(lambda _: self._hand_unread(responses, outputs, unread))
            if ended:
                self._release(region)
            elif model in self.stub_guard.taken_down:  # nothing there to stop it in-band
                reader.cancel()
                reader.add_done_callback(lambda _: self._release(region))
            else:
                self._stop_in_band(model, request_id, reader, region)

    def _hand_unread(self, responses: asyncio.Queue, outputs: Sequence[str],
                     unread: Callable[[dict[str, np.ndarray]], None]) -> None:
        """Once the reader is done, every response it queued that nobody read."""
        while not responses.empty():
            kind, item = responses.get_nowait()
            if kind == "result" and (out := self._outputs(item, outputs)):
                try:
                    unread(out)
                except Exception:  # a cleanup hook never breaks the client
                    log.exception("the unread-response hook failed")

    async def _read(self, model: str, placed: dict, outputs: Sequence[str], request_id: str,
                    timeout_s: float, responses: asyncio.Queue) -> None:
        """Put ("result", r) for every response, then ("end", None) or ("error", exc)."""
        from omni_serve.grpc_stream import stream_request

        try:
            strict = await self._strict_errors()
            async for result in stream_request(
                    self._stream_stub(), model, placed, list(outputs),
                    request_id=request_id, timeout_s=timeout_s, strict=strict):
                responses.put_nowait(("result", result))
            responses.put_nowait(("end", None))
        except Exception as e:  # handed to the consumer
            responses.put_nowait(("error", e))

    async def _stream_error(self, model: str, e: Exception, answered: bool,
                            timeout_s: float) -> StageCallError:
        from omni_serve.grpc_stream import StreamError

        if isinstance(e, TimeoutError):
            return StageCallError("UNAVAILABLE", f"no response for {timeout_s:g} s")
        if not isinstance(e, StreamError):
            return StageCallError("INTERNAL", f"{type(e).__name__}: {e}")
        code = call_code(e.code, e.message)
        if (e.code is None and code in ("INVALID_ARG", "INTERNAL") and not answered
                and not await self._model_ready(model)):
            # Triton sends "unknown model" (unloaded, not yet loaded) in-band on a stream,
            # without the NOT_FOUND a unary call gets: the model is not there
            code = "UNAVAILABLE"
        return StageCallError(code, e.message)

    def _stop_in_band(self, model: str, request_id: str, reader: asyncio.Future,
                      region: str | None) -> None:
        """Abort `request_id` with a control request and let its stream end by itself."""
        task = asyncio.get_running_loop().create_task(
            self._abort_and_drain(model, request_id, reader))
        self._stopping.add(task)
        task.add_done_callback(lambda t: (self._stopping.discard(t), self._release(region)))

    async def _abort_and_drain(self, model: str, request_id: str, reader: asyncio.Future) -> None:
        from omni_serve.contract import LLM
        from omni_serve.grpc_stream import StreamError, stream_request

        if reader.done():
            return
        try:
            async with asyncio.timeout(self.abort_grace_s):
                async for _ in stream_request(self._stream_stub(), model, {}, [], request_id="",
                                              timeout_s=self.abort_grace_s,
                                              parameters={LLM.ABORT_PARAMETER: request_id},
                                              strict=bool(self._strict)):
                    pass
                await asyncio.shield(reader)
            return
        except (TimeoutError, StreamError) as e:
            log.warning("stage %s did not end request %s in-band within %g s (%s); "
                        "cancelling its call", model, request_id, self.abort_grace_s, e)
        reader.cancel()  # the gRPC cancel, as a last resort
        await asyncio.gather(reader, return_exceptions=True)

    async def _model_ready(self, model: str) -> bool:
        """Whether the server has `model` ready (False also when it cannot say)."""
        from tritonclient.utils import InferenceServerException

        try:
            async with asyncio.timeout(5):
                return bool(await self._connect().is_model_ready(model))
        except (InferenceServerException, TimeoutError):
            return False

    async def unready(self, model: str, timeout_s: float = 5.0) -> str | None:
        """None when the server has `model` ready, else why not (it did not answer, or
        says the model is not ready)."""
        from tritonclient.utils import InferenceServerException

        try:
            async with asyncio.timeout(timeout_s):
                if await self._connect().is_model_ready(model):
                    return None
            return f"model {model} is not ready on {self.url}"
        except TimeoutError:
            return f"{self.url} did not answer within {timeout_s:g} s"
        except InferenceServerException as e:
            return f"{self.url}: {e.message()}"

    async def drain_stops(self) -> None:
        """Wait until the streams being stopped in-band have ended."""
        while self._stopping:
            await asyncio.gather(*list(self._stopping), return_exceptions=True)

    async def close(self) -> None:
        await self.drain_stops()
        if self._stream_channel is not None:
            await self._stream_channel.close()
        if self._client is not None:
            if self.shm is not None:
                await self.shm.close(self._client)
            await self._client.close()

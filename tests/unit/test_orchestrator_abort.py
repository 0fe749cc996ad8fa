"""The orchestrator stops its stage calls without gRPC cancels (Triton 2.51 can crash on one
that races a request's completion): streams get an in-band abort, unary calls finish.

No tritonserver: a fake omni_llm behind ModelStreamInfer answers `omni_abort` control
requests the way the real stage does (an ack, then a final "abort" on the named stream).
"""
from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from omni_serve.contract import LLM

from .test_orchestrator_shm import EMBEDS, FakeServer, _response, client_for


def _token(final: bool = False):
    """A streamed response carrying one text delta."""
    r = _response(final)
    out = r.infer_response.outputs.add()
    out.name, out.datatype = LLM.TEXT_OUTPUT, "BYTES"
    out.shape.append(1)
    r.infer_response.raw_output_contents.append(len(b"x").to_bytes(4, "little") + b"x")
    return r


class FakeStage:
    """ModelStreamInfer of a fake omni_llm: each call is one request; records aborts, cancels."""

    def __init__(self, honours_abort: bool = True):
        self.honours_abort = honours_abort
        self.streams: dict[str, _Call] = {}
        self.aborts: list[str] = []
        self.cancelled: list[str] = []

    def __call__(self, requests):
        return _Call(self, requests)


class _Call:
    def __init__(self, stage: FakeStage, requests):
        self.stage = stage
        self.requests = requests
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_id: str | None = None

    async def read(self):
        if self.request_id is None:
            request = await self.requests.__anext__()
            self.request_id = request.id
            abort = request.parameters.get(LLM.ABORT_PARAMETER)
            if abort is not None:  # the control request: ack at once
                self.stage.aborts.append(abort.string_param)
                target = self.stage.streams.get(abort.string_param)
                if target is not None and self.stage.honours_abort:
                    target.queue.put_nowait(_response(True))  # ends it: finish "abort"
                return _response(True)
            self.stage.streams[request.id] = self
            self.queue.put_nowait(_token())  # the first token at once, then nothing
        return await self.queue.get()

    def cancel(self):
        self.stage.cancelled.append(self.request_id)


def _stop_after_first_response(client, how: str) -> None:
    async def consume(got: asyncio.Event):
        async for _ in client.stream("llm", {LLM.IMAGE_EMBEDS: EMBEDS}, [LLM.TEXT_OUTPUT],
                                     request_id="omni-1-thinker", timeout_s=30):
            got.set()
            if how == "break":
                break

    async def go():
        got = asyncio.Event()
        task = asyncio.create_task(consume(got))
        await got.wait()
        if how == "cancel":
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.drain_stops()
        await client.shm.drain()

    asyncio.run(go())


@pytest.mark.parametrize("how", ["cancel", "break"])
def test_a_consumer_that_stops_aborts_the_stage_in_band_and_never_cancels_the_call(how):
    stage = FakeStage()
    server = FakeServer(stream=stage)
    client = client_for(server)

    _stop_after_first_response(client, how)

    assert stage.aborts == ["omni-1-thinker"]
    assert stage.cancelled == []
    # its shared-memory region stayed registered until the stream had ended, then went
    assert len(server.unregister_calls) == 1 and server.regions == {}


def test_a_stage_that_does_not_end_the_stream_has_its_call_cancelled_after_the_grace(caplog):
    stage = FakeStage(honours_abort=False)
    server = FakeServer(stream=stage)
    client = client_for(server, abort_grace_s=0.2)

    _stop_after_first_response(client, "cancel")

    assert stage.aborts == ["omni-1-thinker"]
    assert stage.cancelled == ["omni-1-thinker"]
    assert "did not end request omni-1-thinker in-band within 0.2 s" in caplog.text
    assert server.regions == {}


def test_a_stream_read_to_its_end_sends_no_abort():
    class Done(FakeStage):
        def __call__(self, requests):
            call = _Call(self, requests)
            call.queue.put_nowait(_response(True))
            return call

    stage = Done()
    client = client_for(FakeServer(stream=stage), "none")

    async def go():
        return [out async for out in client.stream("llm", {LLM.TEXT_INPUT: np.array([b"x"],
                                                                                    dtype=np.object_)},
                                                   [LLM.TEXT_OUTPUT], request_id="r", timeout_s=30)]

    asyncio.run(go())
    assert stage.aborts == [] and stage.cancelled == []


def test_a_cancelled_unary_call_is_cancelled_and_releases_its_region():
    finished: list[bool] = []

    class SlowServer(FakeServer):
        async def infer(self, model, inputs, outputs=None, client_timeout=None):
            self.infers.append(inputs)
            try:
                await asyncio.Event().wait()  # answers only when cancelled
            except asyncio.CancelledError:
                finished.append(False)
                raise
            finished.append(True)

    server = SlowServer()
    client = client_for(server)

    async def go():
        client._outputs = staticmethod(lambda result, outputs: {})
        task = asyncio.create_task(client.infer("audio_decoder", {LLM.IMAGE_EMBEDS: EMBEDS}, []))
        while not server.infers:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if finished and server.unregister_calls:
                break
            await asyncio.sleep(0.01)
        await client.shm.drain()

    asyncio.run(go())
    assert finished == [False]  # the stage call itself was cancelled
    assert len(server.unregister_calls) == 1 and server.regions == {}


def test_responses_the_consumer_did_not_read_go_to_the_unread_hook():
    """What they hold (a handed-over hidden-states file) is the caller's to free."""
    class Chatty(FakeStage):
        def __call__(self, requests):
            call = _Call(self, requests)
            for _ in range(2):  # two more tokens queued behind the first
                call.queue.put_nowait(_token())
            return call

    stage = Chatty()
    client = client_for(FakeServer(stream=stage), "none")
    unread: list[dict] = []

    async def go():
        async with contextlib.aclosing(client.stream(
                "llm", {}, [LLM.TEXT_OUTPUT], request_id="r", timeout_s=30,
                unread=unread.append)) as responses:
            async for _ in responses:
                break  # reads the first only
        await client.drain_stops()

    asyncio.run(go())
    assert stage.aborts == ["r"]
    assert [list(out) for out in unread] == [[LLM.TEXT_OUTPUT]] * 2

"""The orchestrator adapter's request task under a client cancel (runs in the test process,
with the real `_run` of backends/omni_orchestrator/model.py on an event loop thread).

A cancel may come before the request's task has taken its first step: the request must
still get its final "cancelled" response and leave the in-flight gauge.
"""
from __future__ import annotations

import asyncio
import importlib.util
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_serve.orchestrator.pipeline import Final

MODEL_PY = Path(__file__).resolve().parents[2] / "backends" / "omni_orchestrator" / "model.py"


@pytest.fixture(scope="module")
def adapter():
    spec = importlib.util.spec_from_file_location("omni_orchestrator_model", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Outbox:
    def __init__(self):
        self.sent: list = []
        self.done = threading.Event()

    def send(self, event) -> None:
        self.sent.append(event)
        if isinstance(event, Final):
            self.done.set()

    def fail(self, error) -> None:
        self.sent.append(error)
        self.done.set()


class Forever:
    """A pipeline whose requests run until cancelled."""

    def __init__(self):
        self.started = threading.Event()

    async def run(self, req, emit, received=None) -> None:
        self.started.set()
        await asyncio.Event().wait()


def _model(adapter):
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    gauge: list[int] = []
    model = adapter.TritonPythonModel()
    model.loop, model.pipeline, model.model_name = loop, Forever(), "omni"
    model._in_flight, model._in_flight_lock, model._in_flight_n = (
        SimpleNamespace(set=gauge.append), threading.Lock(), 0)
    return model, gauge


@pytest.mark.parametrize("when", ["before its task starts", "while it runs"])
def test_a_cancelled_request_gets_its_final_and_leaves_the_in_flight_count(adapter, when):
    model, gauge = _model(adapter)
    latch, outbox = adapter._CancelLatch(), Outbox()
    if when == "before its task starts":
        latch.set()
    model._count_in_flight(+1)
    asyncio.run_coroutine_threadsafe(model._run(SimpleNamespace(request_id="omni-0"), outbox,
                                                latch), model.loop)
    if when == "while it runs":
        assert model.pipeline.started.wait(5)
        latch.set()
    assert outbox.done.wait(5)
    assert [type(e) for e in outbox.sent] == [Final] and outbox.sent[0].finish_reason == "cancelled"
    assert gauge == [1, 0]
    model.loop.call_soon_threadsafe(model.loop.stop)

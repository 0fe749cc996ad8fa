"""A vLLM-hosted stage (its EngineHost, driven here through the LLM stage) never loses an
abort: one that overtakes its request, one that lands while
the prompt is rendered, one the engine hears before it knows the request.

No vLLM engine: a fake AsyncLLM that generates until aborted, and ignores an abort
for a request it has not started yet, as vLLM does.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from omni_serve.llm.engine_host import EngineHost
from omni_serve.llm.request import LLMRequest
from omni_serve.llm.stage import LLMStage


class FakeEngine:
    def __init__(self):
        self.known: set[str] = set()
        self.aborted: set[str] = set()
        self.abort_calls: list[str] = []
        self.generated: list[str] = []
        self.step = asyncio.Event()  # set by the test to let the first step run

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        if request_id in self.known:
            self.aborted.add(request_id)

    async def generate(self, prompt, params, request_id):
        self.generated.append(request_id)
        await self.step.wait()  # the request reaches the engine only now
        self.known.add(request_id)
        for n in range(1, 1000):
            finished = request_id in self.aborted
            yield SimpleNamespace(
                finished=finished, prompt=None, prompt_token_ids=[1, 2],
                outputs=[SimpleNamespace(token_ids=[] if finished else [n], text="" if finished
                                         else "t", finish_reason="abort" if finished else None)])
            if finished:
                return
            await asyncio.sleep(0.001)


class Sink:
    def __init__(self):
        self.outputs = []
        self.done = threading.Event()

    def send(self, output):
        self.outputs.append(output)
        if output.final:
            self.done.set()

    def fail(self, error):
        self.outputs.append(error)
        self.done.set()


def _stage(render_gate: asyncio.Event | None = None) -> tuple[EngineHost, FakeEngine]:
    """An LLM stage's host on a fake engine (what the adapter drives)."""
    llm = LLMStage({"model": "fake"}, name="fake")
    host = llm.host
    host._thread.start()
    engine = FakeEngine()
    host.engine = engine

    async def render(req):
        if render_gate is not None:
            await render_gate.wait()
        return {"prompt_token_ids": [1, 2]}

    llm._render = render
    return host, engine


def _on_loop(stage: EngineHost, fn) -> None:
    stage._loop.call_soon_threadsafe(fn)


def _request(rid: str) -> LLMRequest:
    return LLMRequest(request_id=rid, prompt="hi", stream=True, sampling={"max_tokens": 900})


def _wait(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_an_abort_that_overtakes_its_request_ends_it_at_once_when_it_arrives():
    stage, engine = _stage()
    sink = Sink()

    assert stage.abort_client("omni-3-talker-1") is False  # not there yet
    stage.submit(_request("talker-9-omni-3-talker-1"), sink, client_id="omni-3-talker-1")

    assert sink.done.wait(5)
    (out,) = sink.outputs
    assert out.final and out.finish_reason == "abort" and out.num_output_tokens == 0
    assert engine.generated == []  # the engine never saw it
    # the next request under another id runs normally
    other = Sink()
    stage.submit(_request("talker-10-omni-4-talker-0"), other, client_id="omni-4-talker-0")
    _on_loop(stage, engine.step.set)
    _wait(lambda: len(other.outputs) >= 3)
    stage.abort("talker-10-omni-4-talker-0")
    assert other.done.wait(5) and other.outputs[-1].finish_reason == "abort"


def test_an_abort_while_the_prompt_is_rendered_ends_the_request_before_the_engine_gets_it():
    gate = asyncio.Event()
    stage, engine = _stage(render_gate=gate)
    sink = Sink()
    stage.submit(_request("llm-1-omni-1-thinker"), sink, client_id="omni-1-thinker")

    assert stage.abort_client("omni-1-thinker") is True
    _on_loop(stage, gate.set)

    assert sink.done.wait(5)
    assert [o.finish_reason for o in sink.outputs] == ["abort"]
    assert engine.generated == []


def test_an_abort_the_engine_heard_before_it_knew_the_request_is_sent_again():
    stage, engine = _stage()
    sink = Sink()
    stage.submit(_request("llm-2-omni-2-thinker"), sink, client_id="omni-2-thinker")
    _wait(lambda: engine.generated == ["llm-2-omni-2-thinker"])  # in generate, not yet known

    stage.abort("llm-2-omni-2-thinker")
    _wait(lambda: engine.abort_calls)  # heard and ignored: the engine does not know it yet
    assert engine.aborted == set()
    _on_loop(stage, engine.step.set)

    assert sink.done.wait(5)
    assert sink.outputs[-1].finish_reason == "abort"
    assert len(engine.abort_calls) >= 2 and engine.aborted == {"llm-2-omni-2-thinker"}
    assert len(sink.outputs) < 10  # stopped after its first step, not at 900 tokens


def test_a_requests_tokens_are_counted_before_its_final_response_goes_out():
    stage, engine = _stage()
    counted: list[tuple[int, int]] = []
    seen_at_final: list[list] = []
    stage.metrics = SimpleNamespace(time_to_first_token=lambda s: None,
                                    time_per_output_token=lambda s: None,
                                    tokens=lambda p, g: counted.append((p, g)),
                                    scheduler=lambda r, w: None, prefix_cache=lambda q, h: None,
                                    in_flight=lambda n: None)

    class Watching(Sink):
        def send(self, output):
            if output.final:
                seen_at_final.append(list(counted))
            super().send(output)

    sink = Watching()
    stage.submit(_request("llm-3-omni-3-thinker"), sink, client_id="omni-3-thinker")
    _on_loop(stage, engine.step.set)
    _wait(lambda: len(sink.outputs) >= 3)
    stage.abort("llm-3-omni-3-thinker")

    assert sink.done.wait(5)
    streamed = sum(len(o.token_ids) for o in sink.outputs)
    assert seen_at_final == [[(2, streamed)]]  # a client holding the final sees the count


def test_in_flight_counts_a_request_from_submit_until_its_final_output_is_handed_over():
    stage, engine = _stage()
    in_flight: list[int] = []
    stage.metrics = SimpleNamespace(time_to_first_token=lambda s: None,
                                    time_per_output_token=lambda s: None,
                                    tokens=lambda p, g: None, scheduler=lambda r, w: None,
                                    prefix_cache=lambda q, h: None, in_flight=in_flight.append)
    at_final: list[list[int]] = []

    class Watching(Sink):
        def send(self, output):
            if output.final:
                at_final.append(list(in_flight))
            super().send(output)

    sinks = [Watching(), Watching()]
    for n, sink in enumerate(sinks):
        stage.submit(_request(f"llm-{n}-omni-{n}-thinker"), sink, client_id=f"omni-{n}-thinker")
    assert in_flight == [1, 2]
    _on_loop(stage, engine.step.set)
    _wait(lambda: all(len(s.outputs) >= 2 for s in sinks))
    stage.abort("llm-0-omni-0-thinker")
    assert sinks[0].done.wait(5)
    _wait(lambda: in_flight[-1] == 1)
    assert at_final == [[1, 2]]  # still counted while its final output went out
    assert stage.abort_client("omni-1-thinker") is True
    assert sinks[1].done.wait(5)
    _wait(lambda: in_flight[-1] == 0)
    assert in_flight == [1, 2, 1, 0]

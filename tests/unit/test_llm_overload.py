"""The omni_llm stage's bounded queue (`queue.max_queue_size`): one request past it is
rejected at once, UNAVAILABLE "overloaded", while the others go on. No real engine."""
from __future__ import annotations

import asyncio

from omni_serve.errors import StageOverloadedError, code_of_message, is_overloaded
from omni_serve.llm.engine_host import EngineHost
from omni_serve.llm.stage import LLMStage

from .test_llm_abort import Sink, _on_loop, _request, _stage, _wait


def _bounded(running: int, queued: int) -> tuple[EngineHost, asyncio.Event]:
    gate = asyncio.Event()  # holds every request in rendering: they stay in flight
    stage, engine = _stage(render_gate=gate)
    _on_loop(stage, engine.step.set)
    stage.max_queued = queued
    stage.max_in_flight = running + queued
    return stage, gate


def _end(stage: EngineHost, gate: asyncio.Event, ids) -> None:
    """Let the held requests reach the engine, then stop them (the fake runs until aborted)."""
    _on_loop(stage, gate.set)
    for rid in ids:
        stage.abort(rid)


def test_a_request_past_the_queue_bound_is_rejected_at_once_and_the_others_go_on():
    stage, gate = _bounded(running=2, queued=1)
    held = [Sink() for _ in range(3)]
    for i, sink in enumerate(held):
        stage.submit(_request(f"r{i}"), sink)
    rejected = Sink()
    stage.submit(_request("r3"), rejected)
    assert rejected.done.is_set()  # answered in submit, before any engine work
    (error,) = rejected.outputs
    assert isinstance(error, StageOverloadedError)
    assert str(error) == ("stage fake is overloaded: 3 requests in flight, the most it takes "
                          "(2 running + 1 waiting, queue.max_queue_size); retry later")
    assert is_overloaded(str(error)) and code_of_message(str(error)) == "UNAVAILABLE"
    assert not any(s.done.is_set() for s in held)

    _end(stage, gate, ["r0", "r1", "r2"])  # they end: room again
    for sink in held:
        assert sink.done.wait(5)
    _wait(lambda: not stage._live)
    again = Sink()
    stage.submit(_request("r4"), again)
    _wait(lambda: len(again.outputs) >= 2)  # admitted: tokens come
    assert not any(isinstance(o, Exception) for o in again.outputs)
    stage.abort("r4")
    assert again.done.wait(5)


def test_without_a_bound_nothing_is_rejected():
    gate = asyncio.Event()
    stage, engine = _stage(render_gate=gate)
    _on_loop(stage, engine.step.set)
    assert stage.max_in_flight is None
    sinks = [Sink() for _ in range(50)]
    for i, sink in enumerate(sinks):
        stage.submit(_request(f"r{i}"), sink)
    assert not any(s.done.is_set() for s in sinks)
    _end(stage, gate, [f"r{i}" for i in range(50)])
    for sink in sinks:
        assert sink.done.wait(5)


def test_the_bound_comes_from_engine_json():
    stage = LLMStage({"model": "fake", "max_queued_requests": 4}, name="fake").host
    assert stage.max_queued == 4 and "max_queued_requests" not in stage.engine_args


def test_triton_s_own_full_queue_reads_as_overloaded():
    message = "Exceeds maximum queue size"  # Triton's dynamic batcher, UNAVAILABLE
    assert is_overloaded(message) and code_of_message(message) == "UNAVAILABLE"

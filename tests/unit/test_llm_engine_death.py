"""A vLLM engine that dies: every request is UNAVAILABLE naming the stage, and the stage
asks once to be taken out of service (the adapter unloads its model where the server's
model-control mode allows it: test_server_args.py). No real engine here; the real one is
killed in tests/integration/test_engine_health.py."""
from __future__ import annotations

import threading

from omni_serve.errors import StageUnavailableError

from .test_llm_abort import Sink, _request, _stage


class DeadEngine:
    def __init__(self):
        self.calls = 0

    async def abort(self, request_id: str) -> None:
        pass

    async def generate(self, prompt, params, request_id):
        from vllm.v1.engine.exceptions import EngineDeadError

        self.calls += 1
        raise EngineDeadError("EngineCore encountered an issue")
        yield  # an async generator, as AsyncLLM.generate is


def test_a_dead_engine_makes_every_request_unavailable_naming_the_stage():
    stage, _ = _stage()
    stage.engine = engine = DeadEngine()
    reasons = []
    stage.on_dead = reasons.append

    first = Sink()
    stage.submit(_request("fake-1"), first)
    assert first.done.wait(5)
    (error,) = first.outputs
    assert isinstance(error, StageUnavailableError)  # the adapter answers it UNAVAILABLE
    assert "stage fake is unavailable: its vLLM engine died" in str(error)
    assert "reload the model" in str(error)

    second = Sink()
    stage.submit(_request("fake-2"), second)  # fails at once: the engine is not asked again
    assert second.done.wait(5)
    assert isinstance(second.outputs[0], StageUnavailableError)
    assert engine.calls == 1
    assert reasons == [str(error)]  # taken out of service once


class ErroredEngine(DeadEngine):
    """What AsyncLLM says once its engine-core process is gone: `errored`, before any
    request has failed on it."""

    errored = True

    @property
    def dead_error(self):
        from vllm.v1.engine.exceptions import EngineDeadError

        return EngineDeadError()


def test_a_death_vllm_already_knows_is_noticed_before_any_request_fails_on_it():
    stage, _ = _stage()
    stage.engine = engine = ErroredEngine()
    reasons = []
    stage.on_dead = reasons.append

    # readiness asks from several threads at once: one death, told once
    threads = [threading.Thread(target=stage.healthy) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not stage.healthy()
    assert reasons == [stage.dead] and "stage fake is unavailable" in stage.dead

    sink = Sink()
    stage.submit(_request("fake-1"), sink)  # answered at once, from submit itself
    assert sink.done.is_set() and isinstance(sink.outputs[0], StageUnavailableError)
    assert engine.calls == 0


def test_a_live_engine_is_healthy():
    stage, engine = _stage()
    engine.errored = False
    assert stage.healthy() and not stage.dead

"""A vLLM engine that dies: every request is UNAVAILABLE naming the stage, and the stage
asks once to be taken out of service (the adapter unloads its model). No real engine."""
from __future__ import annotations

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

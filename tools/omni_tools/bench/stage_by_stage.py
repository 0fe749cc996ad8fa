"""The pipelining scenario's baseline: the omni pipeline with every speech stage run to its end.

Runs in the stub of a benchmark repository's second entry model (`omni_sequential`,
`backend: "python"`, written by `install`), and in tests. It is the product's
orchestrator with one change: its stage calls go through `StageByStage`, so for each
request the talker is called only once the thinker's stream has ended, and the talker's
codes reach the decoder only once the talker's stream has ended. The benchmark gives
this entry `parallel_chunks: 1`, so the decoder chunks then run one after another.
What the product's orchestrator does instead (talker on the thinker's first reply
tokens, decoder on the first codes) is what the scenario measures against this.

Its `stage_seconds` for the talker include the talker's wait for the thinker; the
benchmark times requests on the client.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from pathlib import Path

import numpy as np

from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.pipeline import OmniPipeline, StageClient
from omni_serve.orchestrator.prompt import ChatPrompt
from omni_serve.orchestrator.request import OmniRequest
from omni_tools.bench.scenario import ROOT

# set by StageByStagePipeline.run for each request: its tasks (thinker, speech) share it
_thinker_done: ContextVar[asyncio.Event] = ContextVar("thinker_done")

ENTRY_MODEL_PY = '''\
"""omni-bench's stage-by-stage entry model (benchmark repositories only)."""
from omni_tools.bench.stage_by_stage import entry_model

TritonPythonModel = entry_model()
'''


class StageByStage:
    """A StageClient over `client` that holds a request's talker call until its thinker
    stream has ended, and hands the talker's responses on only once they all came."""

    def __init__(self, client: StageClient, cfg: OrchestratorConfig):
        self.client = client
        self.thinkers = frozenset(cfg.stages.thinkers)
        self.talker = cfg.stages.talker

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> dict[str, np.ndarray]:
        return await self.client.infer(model, inputs, outputs)

    async def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str], *,
                     request_id: str, timeout_s: float,
                     unread: Callable[[dict[str, np.ndarray]], None] | None = None,
                     ) -> AsyncIterator[dict[str, np.ndarray]]:
        if model == self.talker:
            await _thinker_done.get().wait()
        try:
            async with contextlib.aclosing(self.client.stream(
                    model, inputs, outputs, request_id=request_id, timeout_s=timeout_s,
                    unread=unread)) as responses:
                if model == self.talker:
                    for out in [out async for out in responses]:  # the whole talk first
                        yield out
                else:
                    async for out in responses:
                        yield out
        finally:
            if model in self.thinkers:
                _thinker_done.get().set()


class StageByStagePipeline(OmniPipeline):
    """OmniPipeline whose stage calls go through StageByStage."""

    def __init__(self, cfg: OrchestratorConfig, client: StageClient, prompt: ChatPrompt):
        super().__init__(cfg, StageByStage(client, cfg), prompt)

    async def run(self, req: OmniRequest, emit) -> None:
        _thinker_done.set(asyncio.Event())  # this request's task and the tasks it starts
        await super().run(req, emit)


def entry_model() -> type:
    """The orchestrator's Triton adapter (backends/omni_orchestrator/model.py) with a
    StageByStagePipeline (runs in the stub: the adapter needs triton_python_backend_utils)."""
    path = ROOT / "backends" / "omni_orchestrator" / "model.py"
    spec = importlib.util.spec_from_file_location("omni_orchestrator_adapter", path)
    adapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adapter)

    class TritonPythonModel(adapter.TritonPythonModel):
        def initialize(self, args):
            super().initialize(args)
            self.pipeline = StageByStagePipeline(self.cfg, self.client, self.pipeline.prompt)

    return TritonPythonModel


def install(model_dir: Path) -> None:
    """Make the generated orchestrator model at `model_dir` this baseline: Triton's
    python backend loads its 1/model.py (entry_model) instead of omni_orchestrator's."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config_path = model_dir / "config.pbtxt"
    config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
    config.backend = "python"
    config_path.write_text(text_format.MessageToString(config))
    (model_dir / "1").mkdir(exist_ok=True)
    (model_dir / "1" / "model.py").write_text(ENTRY_MODEL_PY)

"""The talker stage (omni_talker): a thinker's handed-over rows in, codec codes out.

Runs in the omni_talker model's Triton stub process, on the engine loop of its
EngineHost (llm/engine_host.py: the vLLM AsyncLLM, aborts, overload, a dead
engine, metrics), which calls `serve` once per request. Here: the talker's
prompt built from the thinker's rows as they arrive (talker/prompt.py), the
per-step feed handed to the engine (talker/engine.py), and the sampled codes
streamed back as [frames, groups] (one group for Qwen2.5-Omni), cut at the
talker's stop code as transformers cuts them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from omni_serve.contract import TALKER
from omni_serve.errors import RequestError
from omni_serve.llm import sampling
from omni_serve.llm.engine_host import EngineHost
from omni_serve.llm.metrics import Sink, StageMetrics
from omni_serve.talker import engine as talker_engine
from omni_serve.talker import prompt
from omni_serve.talker.request import TalkerOutput, TalkerRequest, aborted_output

# How long a talker request waits for the thinker's first reply rows.
WAIT_S = 120.0
GROUPS = 1  # Qwen2.5-Omni: one codebook, one code per step


class TalkerStage:
    """A vLLM engine (its `host`) serving talker requests; the adapter calls `host.submit`."""

    def __init__(self, engine_args: dict[str, Any], *, metrics: StageMetrics | None = None,
                 name: str = "talker"):
        self.name = name
        self.host = EngineHost(prompt.engine_args(engine_args), serve=self.serve,
                               aborted=aborted_output, name=name, metrics=metrics,
                               prompt_field=TALKER.PROMPT_TOKEN_IDS)
        self.prompter: prompt.TalkerPrompter | None = None  # once the engine runs

    def start(self, warm_up: bool = True) -> None:
        self.host.start(self._started, warm_up=warm_up,
                        vocab=lambda: self.prompter.config.vocab_size)

    async def _started(self) -> None:
        reasons = [r for r in await self.host.engine.collective_rpc(talker_engine.RPC) if r]
        if reasons:
            raise RuntimeError(f"[{self.name}] the talker cannot run: {'; '.join(reasons)}")
        self.prompter = prompt.TalkerPrompter(self.host.engine_args["model"], self.name)

    async def serve(self, req: TalkerRequest, sink: Sink, arrival: float) -> None:
        params = sampling.build(self.prompter.sampling(req.sampling, self.host.max_model_len),
                                stream=True)
        if params.extra_args and talker_engine.EXTRA_ARG in params.extra_args:
            raise RequestError(f"{sampling.FIELD}.extra_args.{talker_engine.EXTRA_ARG}",
                               "is set by the stage")
        engine_prompt, feed = await self.prompter.prompt(req.feed, timeout_s=WAIT_S)
        params.extra_args = {**(params.extra_args or {}), talker_engine.EXTRA_ARG: feed}
        engine_input = await self.host.render_prompt(engine_prompt)
        if self.host.aborted(req.request_id):  # aborted while its prompt was built
            sink.send(aborted_output())
            return
        async for out, _, _ in self.host.generate(engine_input, params, req.request_id,
                                                  arrival, stream=True):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            if comp.finish_reason == "stop" and ids and ids[-1] in self.prompter.stop_ids:
                ids = ids[:-1]  # as transformers cuts the codes at the talker's eos
            sink.send(TalkerOutput(np.asarray(ids, dtype=np.int64).reshape(-1, GROUPS),
                                   comp.finish_reason, out.finished))

"""The talker stage (omni_talker): what a thinker handed over in, codec codes out.

Runs in the omni_talker model's Triton stub process, on the engine loop of its
EngineHost (llm/engine_host.py: the vLLM AsyncLLM, aborts, overload, a dead
engine, metrics), which calls `serve` once per request. The checkpoint's model
family (omni_serve.families, from its config.json) gives the talker's side
(`TalkerSide`, e.g. a family folder's talker_prompt.py): the engine
arguments, the prompt built from what the thinker hands over and the
engine feed that goes with it, sampling defaults and stop codes, and the
request's `FrameStream`, which turns the engine's sampled ids into whole
frames [n, codec_groups] (a one-code talker: the ids, cut at its stop code as
transformers cuts them, `StopCutStream`; Qwen3-Omni: each code 0 with the 15
codes its code predictor wrote beside it). Here: one request through it, and
the frames streamed back as they complete.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from omni_serve import families
from omni_serve.contract import TALKER
from omni_serve.errors import RequestError
from omni_serve.llm import sampling
from omni_serve.llm.engine_host import EngineHost
from omni_serve.llm.metrics import Sink, StageMetrics
from omni_serve.talker.request import TalkerInput, TalkerOutput, TalkerRequest, aborted_output

# How long a talker request waits for what the thinker hands over.
WAIT_S = 120.0


class FrameStream(Protocol):
    """One talker request's frames as the engine's ids come (the side makes one per request)."""

    def push(self, new_ids: list[int]) -> np.ndarray:
        """The frames, int64 [n, codec_groups], that these newly sampled ids complete."""
        ...

    def close(self) -> None:
        """The request is over (whatever the reason): release what the stream holds."""
        ...


class StopCutStream:
    """A talker that samples whole frames: its ids as [n, groups], its stop codes left out
    (vLLM ends the request on one, so only the last id can be one)."""

    def __init__(self, groups: int, stop_ids: list[int]):
        self.groups, self.stop_ids = groups, set(stop_ids)

    def push(self, new_ids: list[int]) -> np.ndarray:
        ids = [int(i) for i in new_ids]
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]  # as transformers cuts the codes at the talker's eos
        return np.asarray(ids, dtype=np.int64).reshape(-1, self.groups)

    def close(self) -> None:
        pass


class TalkerSide(Protocol):
    """A model family's talker, as the stage drives it (built once the engine runs)."""

    codec_groups: int
    vocab_size: int
    stop_ids: list[int]
    reserved_extra_args: tuple[str, ...]  # SamplingParams.extra_args keys `prompt` sets

    def sampling(self, requested: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
        """The request's sampling fields over the family's defaults."""
        ...

    async def prompt(self, req: TalkerInput, timeout_s: float) -> tuple[dict, dict]:
        """(the vLLM prompt, SamplingParams.extra_args for the engine's feed)."""
        ...

    def frame_stream(self, extra_args: dict) -> FrameStream:
        """The frames of the request `prompt` returned `extra_args` for."""
        ...

    def close(self) -> None:
        """The stage stops: remove what the side keeps between requests."""
        ...


class TalkerStage:
    """A vLLM engine (its `host`) serving talker requests; the adapter calls `host.submit`."""

    def __init__(self, engine_args: dict[str, Any], *, metrics: StageMetrics | None = None,
                 name: str = "talker"):
        self.name = name
        family = families.for_checkpoint(engine_args["model"])
        if family.talker is None:
            raise ValueError(f"stage {name}: model family {family.name!r} has no talker")
        self.side_class = families.load(family.talker)
        self.host = EngineHost(self.side_class.engine_args(engine_args), serve=self.serve,
                               aborted=lambda: aborted_output(self.side_class.codec_groups),
                               name=name, metrics=metrics,
                               prompt_field=TALKER.PROMPT_TOKEN_IDS)
        self.side: TalkerSide | None = None  # once the engine runs

    def start(self, warm_up: bool = True) -> None:
        self.host.start(self._started, warm_up=warm_up, vocab=lambda: self.side.vocab_size)

    async def _started(self) -> None:
        reasons = await self.side_class.check(self.host.engine)
        if reasons:
            raise RuntimeError(f"[{self.name}] the talker cannot run: {'; '.join(reasons)}")
        self.side = self.side_class(self.host.engine_args["model"], self.name)
        self.host.at_shutdown(self.side.close)

    async def serve(self, req: TalkerRequest, sink: Sink, arrival: float) -> None:
        side = self.side
        params = sampling.build(side.sampling(req.sampling, self.host.max_model_len), stream=True)
        for own in side.reserved_extra_args:
            if params.extra_args and own in params.extra_args:
                raise RequestError(f"{sampling.FIELD}.extra_args.{own}", "is set by the stage")
        engine_prompt, extra = await side.prompt(req.feed, timeout_s=WAIT_S)
        stream = side.frame_stream(extra)
        try:
            params.extra_args = {**(params.extra_args or {}), **extra}
            engine_input = await self.host.render_prompt(engine_prompt)
            if self.host.aborted(req.request_id):  # aborted while its prompt was built
                sink.send(aborted_output(side.codec_groups))
                return
            async for out, _, _ in self.host.generate(engine_input, params, req.request_id,
                                                      arrival, stream=True):
                comp = out.outputs[0]
                sink.send(TalkerOutput(stream.push(list(comp.token_ids)), comp.finish_reason,
                                       out.finished))
        finally:
            stream.close()

"""The LLM core stage (omni_llm): prompts in, text, token ids and hidden states out.

Runs in the omni_llm model's Triton stub process, on the engine loop of its
EngineHost (llm/engine_host.py: the vLLM AsyncLLM, aborts, overload, a dead
engine, metrics), which calls `serve` once per request. Here: the request's
sampling parameters, its prompt rendered as the engine takes it (text, token
ids, a chat through the checkpoint's template, multimodal embeddings), and
each vLLM output turned into an LLMOutput, with the hidden-state rows the
engine captured for it (llm/hidden_states.py) when asked. Tokens flow engine
core process -> AsyncLLM (the loop) -> Sink -> the adapter's sender.
"""
from __future__ import annotations

import logging
from typing import Any

from omni_serve.contract import LLM
from omni_serve.encoder.config import VIDEO_LIMITS_KEY, VideoLimits
from omni_serve.errors import RequestError, VerbatimRequestError
from omni_serve.llm import hidden_states, logprobs, render, row_cache, sampling
from omni_serve.llm.engine_host import EngineHost
from omni_serve.llm.lora import LoraTable
from omni_serve.llm.media import MediaShapes, video_sampling
from omni_serve.llm.metrics import Sink, StageMetrics
from omni_serve.llm.request import LLMOutput, LLMRequest

log = logging.getLogger(__name__)


def feature_rate(model: str, default: int = 16000) -> int:
    """The sampling rate the checkpoint's audio feature extractor takes
    (preprocessor_config.json `sampling_rate`; `default` for a folder without one)."""
    import json
    import os

    try:
        with open(os.path.join(model, "preprocessor_config.json")) as f:
            return int(json.load(f).get("sampling_rate", default))
    except (OSError, ValueError, TypeError):
        return default


def aborted_output() -> LLMOutput:
    """The final output of a request stopped before the engine ran it (as vLLM ends one)."""
    return LLMOutput(text="", finish_reason="abort", num_input_tokens=0, num_output_tokens=0,
                     final=True)


class _RowsMissed(Exception):
    """A capturing request hit the prefix cache where the engine kept no rows."""


class LLMStage:
    """A vLLM engine (its `host`) serving LLM requests; the adapter calls `host.submit`."""

    def __init__(self, engine_args: dict[str, Any], *, metrics: StageMetrics | None = None,
                 name: str = "llm", loras: LoraTable | None = None, stat_loggers=()):
        if "talker" in engine_args:
            raise ValueError("engine_args 'talker' is not an omni_llm setting: a talker is a "
                             "stage of its own, backend omni_talker")
        self.name = name
        engine_args = dict(engine_args)  # a clip's limits (the spec's video_limits) are not vLLM's
        self.video_limits = VideoLimits.from_engine_args(engine_args.pop(VIDEO_LIMITS_KEY, None))
        self.host = EngineHost(engine_args, serve=self.serve, aborted=aborted_output, name=name,
                               metrics=metrics, prompt_field=LLM.TEXT_INPUT,
                               stat_loggers=stat_loggers)
        self.loras = loras or LoraTable()
        self.media_shapes: MediaShapes | None = None  # None: a text-only model
        self.audio_rate = 16000  # raw audio's rate for the model's processor, once started
        self.video_sampling = None  # how its family samples a video's frames (None: no video)
        self.hidden_size = 0
        self._capture_dir: str | None = None  # where the engine writes hidden states
        self._rows_kept = row_cache.budget_bytes() > 0  # for prefix-cached positions
        self.hidden_states_unavailable = "the engine has not started"  # '' when available

    def start(self, warm_up: bool = True) -> None:
        """Start the engine (with the hidden-state capture unless the spec brings its own
        worker extension) and warm it up; blocks until both are done."""
        own = self.host.engine_args.setdefault("worker_extension_cls", hidden_states.EXTENSION)
        if own == hidden_states.EXTENSION:
            self._capture_dir = hidden_states.make_directory()  # before the engine core starts
            self.host.at_shutdown(lambda: hidden_states.remove_directory(self._capture_dir))
        self.host.start(self._started, warm_up=warm_up)

    async def _started(self) -> None:
        engine = self.host.engine
        self.media_shapes = MediaShapes.from_hf_config(engine.model_config.hf_config)
        self.audio_rate = feature_rate(self.host.engine_args["model"])
        self.video_sampling = video_sampling(engine.model_config.hf_config)
        self.hidden_size = engine.model_config.get_hidden_size()
        if self._capture_dir is None:
            self.hidden_states_unavailable = ("the engine runs its own worker_extension_cls "
                                              f"{self.host.engine_args['worker_extension_cls']!r}")
        else:
            reasons = [r for r in await engine.collective_rpc(hidden_states.RPC) if r]
            self.hidden_states_unavailable = "; ".join(reasons)

    # --- one request ---------------------------------------------------------------
    async def serve(self, req: LLMRequest, sink: Sink, arrival: float) -> None:
        self._check_task(req)
        lora = self.loras.request(req.lora_name)
        if req.embed is not None:
            await self._embed(req, sink, lora)
            return
        capture = None
        try:
            params = sampling.build(req.sampling, stream=req.stream, max_n=self._max_n(req))
            if params.extra_args and hidden_states.EXTRA_ARG in params.extra_args:
                raise RequestError(f"{sampling.FIELD}.extra_args.{hidden_states.EXTRA_ARG}",
                                   "is set by the stage")
            if req.return_hidden_states:
                capture = self._capture(params)
            engine_input = await self._render(req)
            if self.host.aborted(req.request_id):  # aborted while its prompt was rendered
                sink.send(aborted_output())
                return
            if params.n > 1:
                await self._stream_sequences(req, sink, params, engine_input, arrival, lora)
                return
            try:
                await self._stream(req, sink, params, engine_input, arrival, capture, lora)
            except _RowsMissed:  # its prefix-cached rows were not kept: compute them all
                self.host.metrics.rows_recomputed()
                capture.close()
                params = sampling.build(req.sampling, stream=req.stream, max_n=self._max_n(req))
                capture = self._capture(params, read_prefix_cache=False)
                await self._stream(req, sink, params, engine_input, arrival, capture, lora)
        finally:
            if capture is not None:
                capture.close()

    def _max_n(self, req: LLMRequest) -> tuple[int, str]:
        """How many sequences (sampling n) this request may ask for, and why no more."""
        for flag, name in ((req.return_hidden_states, LLM.RETURN_HIDDEN_STATES),
                           (req.return_token_ids, LLM.RETURN_TOKEN_IDS)):
            if flag:
                return 1, f"{name} returns one sequence"
        return self.host.max_num_seqs, "the engine's max_num_seqs"

    def _check_task(self, req: LLMRequest) -> None:
        """vllm_backend's refusal of a request the model's runner cannot serve (its text)."""
        task = "embed" if req.embed is not None else "generate"
        if self.host.supported_tasks and task not in self.host.supported_tasks:
            field = LLM.EMBEDDING_REQUEST if req.embed is not None else LLM.TEXT_INPUT
            raise VerbatimRequestError(field, f"Model {self.name} does not support '{task}' "
                                              "request")

    async def _embed(self, req: LLMRequest, sink: Sink, lora) -> None:
        """vllm_backend's embedding request: one response, the embedding as JSON text."""
        from vllm.exceptions import VLLMClientError
        from vllm.outputs import EmbeddingOutput
        from vllm.pooling_params import PoolingParams

        what = req.embed.input
        prompt = {"prompt": what} if isinstance(what, str) else {"prompt_token_ids": what}
        params = PoolingParams(task="embed", dimensions=req.embed.dimensions)
        final = None
        try:
            async for out in self.host.engine.encode(prompt, params, req.request_id,
                                                     lora_request=lora):
                final = out
        except (VLLMClientError, ValueError) as e:  # vLLM refused the input or its options
            raise RequestError(LLM.EMBEDDING_REQUEST, str(e.args[0] if e.args else e)) from e
        if final is None:  # aborted before the engine produced it
            sink.send(aborted_output())
            return
        if getattr(final, "error", None) is not None:
            raise RuntimeError(f"the engine failed the embedding: {final.error}")
        embedding = EmbeddingOutput.from_base(final.outputs).embedding
        sink.send(LLMOutput(text="", finish_reason=None,
                            num_input_tokens=len(final.prompt_token_ids or ()),
                            num_output_tokens=0, final=True, embedding=embedding))

    async def _render(self, req: LLMRequest):
        return await render.render_request(self.host.engine, req, self.media_shapes, self.name,
                                           self.audio_rate, self.video_sampling,
                                           self.video_limits)

    def _capture(self, params, read_prefix_cache: bool = True) -> hidden_states.CaptureFile:
        """A capture file for one request's hidden states, named in its SamplingParams.

        A prefix-cached position is never computed: the engine's worker writes its row
        from the rows it kept (llm/row_cache.py), or marks the file missed and the
        request is computed again without reading the prefix cache. With no room to
        keep rows (OMNI_HIDDEN_ROWS_CACHE_MB=0) it never reads the prefix cache.
        """
        if self.hidden_states_unavailable:
            raise RequestError(LLM.RETURN_HIDDEN_STATES, "this stage cannot return hidden "
                                                         f"states: {self.hidden_states_unavailable}")
        capture = hidden_states.CaptureFile(self._capture_dir, self.hidden_size)
        params.extra_args = {**(params.extra_args or {}), hidden_states.EXTRA_ARG: capture.token}
        if not (read_prefix_cache and self._rows_kept):
            params.skip_reading_prefix_cache = True
        return capture

    async def _stream(self, req: LLMRequest, sink: Sink, params, engine_input,
                      arrival: float, capture: hidden_states.CaptureFile | None = None,
                      lora=None) -> None:
        first_output = True
        sent = 0  # output tokens sent so far
        async for out, n_in, n_out in self.host.generate(engine_input, params, req.request_id,
                                                         arrival, req.stream, lora_request=lora):
            comp = out.outputs[0]
            text = comp.text
            if not req.stream and not req.exclude_input_in_output:
                text = (out.prompt or req.prompt or "") + text
            rows = span = None
            if capture is not None and first_output and capture.missed():
                await self.host.engine.abort(req.request_id)
                raise _RowsMissed
            if capture is not None:
                want = (capture.rows_read if comp.finish_reason == "abort"
                        else capture.expected_rows(n_in, n_out))
                if req.hidden_states_in_shm:
                    span = await capture.span_until(want)
                    capture.handed_over = True  # the caller reads it and deletes it
                    if out.finished:  # a talker reading it learns where the reply ends
                        hidden_states.write_final_rows(capture.path, want)
                else:
                    rows = await capture.read_until(want)
                if out.finished:
                    capture.completed = comp.finish_reason != "abort"
            sink.send(LLMOutput(text=text, finish_reason=comp.finish_reason,
                                num_input_tokens=n_in, num_output_tokens=n_out - sent,
                                final=out.finished, token_ids=tuple(comp.token_ids),
                                cumulative_logprob=getattr(comp, "cumulative_logprob", None),
                                logprobs=logprobs.collect(getattr(comp, "logprobs", None)),
                                input_token_ids=tuple(out.prompt_token_ids or ())
                                if req.return_input_token_ids and first_output else None,
                                hidden=rows, hidden_span=span,
                                hidden_file=capture.path if span is not None else None))
            first_output = False
            sent = n_out

    async def _stream_sequences(self, req: LLMRequest, sink: Sink, params, engine_input,
                                arrival: float, lora=None) -> None:
        """n > 1: every output carries all n sequences by index, as vllm_backend's
        per-sequence tensors are n wide. Streamed, vLLM sends one sequence's delta at a
        time: the others add nothing to that output and keep their finish reason and
        cumulative logprob so far."""
        n = params.n
        last: list[LLMOutput | None] = [None] * n
        sent = 0
        async for out, n_in, n_out in self.host.generate(engine_input, params, req.request_id,
                                                         arrival, req.stream, lora_request=lora):
            prefix = ""
            if not req.stream and not req.exclude_input_in_output:
                prefix = out.prompt or req.prompt or ""
            seqs = [LLMOutput(text="", finish_reason=p.finish_reason if p else None,
                              num_input_tokens=n_in, num_output_tokens=0, final=False,
                              cumulative_logprob=p.cumulative_logprob if p else None,
                              logprobs=[] if params.logprobs is not None else None)
                    for p in last]
            for comp in out.outputs:
                seqs[comp.index] = last[comp.index] = LLMOutput(
                    text=prefix + comp.text, finish_reason=comp.finish_reason,
                    num_input_tokens=n_in, num_output_tokens=len(comp.token_ids),
                    final=comp.finish_reason is not None,
                    cumulative_logprob=getattr(comp, "cumulative_logprob", None),
                    logprobs=logprobs.collect(getattr(comp, "logprobs", None)))
            sink.send(LLMOutput(text="", finish_reason=None, num_input_tokens=n_in,
                                num_output_tokens=n_out - sent, final=out.finished,
                                sequences=tuple(seqs)))
            sent = n_out

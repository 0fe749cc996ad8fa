"""The LLM core stage: a vLLM AsyncLLM driven from Triton's stub process.

Threads in the stub process:
- Triton's execute() thread calls `submit()`, which only schedules work;
- the engine thread owns an asyncio loop with the AsyncLLM client; one task
  per request renders the prompt, iterates `generate()` and hands each
  output to the request's `Sink`;
- the adapter's sender thread (omni_serve.tritonio.ResponseSender) turns
  outputs into Triton responses, so a slow client never stalls the loop,
  and calls `abort()` when a client cancels.
Tokens flow engine core process -> AsyncLLM (this loop) -> Sink -> sender.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from omni_serve import processes
from omni_serve.contract import LLM, MAX_QUEUED_ARG
from omni_serve.errors import RequestError, StageOverloadedError, StageUnavailableError
from omni_serve.llm import (
    hidden_states,
    render,
    sampling,
    startup_failure,
    talker,
    talker_engine,
    warmup,
)
from omni_serve.llm.media import MediaShapes
from omni_serve.llm.metrics import NULL_METRICS, NullMetrics, Sink, StageMetrics, stat_logger_factory
from omni_serve.llm.request import LLMOutput, LLMRequest

log = logging.getLogger(__name__)

# How long a talker request waits for the thinker's first reply rows.
TALKER_WAIT_S = 120.0
# How long an in-band abort that found no request waits for that request to arrive.
EARLY_ABORT_TTL_S = 60.0


def _aborted_output() -> LLMOutput:
    """The final output of a request stopped before the engine ran it (as vLLM ends one)."""
    return LLMOutput(text="", finish_reason="abort", num_input_tokens=0, num_output_tokens=0,
                     final=True)

# Engine arguments the stage sets unless the per-stage JSON says otherwise.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    "disable_log_stats": True,  # our stat logger still receives the stats
}


class LLMStage:
    """Owns one AsyncLLM engine and its event loop; thread-safe `submit`."""

    def __init__(self, engine_args: dict[str, Any], *, metrics: StageMetrics | None = None,
                 name: str = "llm"):
        self.name = name
        engine_args = dict(engine_args)
        self.is_talker = bool(engine_args.pop(talker.ENGINE_ARG, False))
        queued = engine_args.pop(MAX_QUEUED_ARG, None)
        self.max_queued: int | None = None if queued is None else int(queued)
        self.max_in_flight: int | None = None  # max_num_seqs + max_queued, once started
        if self.is_talker:
            engine_args = talker.engine_args(engine_args)
        self.talker: talker.TalkerPrompter | None = None  # set once the engine runs
        self.engine_args = {**DEFAULT_ENGINE_ARGS, **engine_args}
        self.metrics = metrics or NullMetrics()
        self.engine = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"{name}-engine-loop", daemon=True)
        self._live: dict[str, Future] = {}  # request id -> its task, until it ends
        self._by_client_id: dict[str, str] = {}  # caller's Triton request id -> request id
        self._aborted: set[str] = set()  # live request ids asked to stop
        # caller ids aborted before their request arrived -> when (kept EARLY_ABORT_TTL_S)
        self._aborted_early: dict[str, float] = {}
        self._live_lock = threading.Lock()
        self._stopping = threading.Event()
        self._warming = False
        self.max_model_len: int | None = None
        self.media_shapes: MediaShapes | None = None  # None: a text-only model
        self.warmup_report = ""  # what the warm-up did and how long it took
        self.hidden_size = 0
        self._capture_dir: str | None = None  # where the engine writes hidden states
        self.hidden_states_unavailable = "the engine has not started"  # '' when available
        # Once the engine has died: why ('' while it lives). Every request is then
        # UNAVAILABLE naming the stage, and `on_dead` (the adapter's: take the model out
        # of service as far as the server's model-control mode allows) runs once.
        self.dead = ""
        self.on_dead: Callable[[str], None] | None = None
        self._dead_lock = threading.Lock()
        # the engine core and its workers, as started: a killed core's workers
        # outlive it re-parented to init, and must still be ended
        self._engine_processes: list = []

    # --- lifecycle ---------------------------------------------------------------
    def start(self, warm_up: bool = True) -> None:
        """Start the loop and the engine, then warm it up (blocks until both are done)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start_engine(), self._loop).result()
        if warm_up and warmup.enabled():
            asyncio.run_coroutine_threadsafe(self._warm_up(), self._loop).result()

    async def _start_engine(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = dict(self.engine_args)
        own_extension = engine_args.setdefault("worker_extension_cls", hidden_states.EXTENSION)
        if own_extension == hidden_states.EXTENSION:
            self._capture_dir = hidden_states.make_directory()  # before the engine core starts
        args = AsyncEngineArgs(**engine_args)
        with startup_failure.watch(self.name):
            self.engine = AsyncLLM.from_engine_args(
                args, stat_loggers=[stat_logger_factory(
                    lambda: NULL_METRICS if self._warming else self.metrics)])
        self._engine_processes = processes.descendants()
        self.max_model_len = self.engine.model_config.max_model_len
        if self.max_queued is not None:
            self.max_in_flight = self.engine.vllm_config.scheduler_config.max_num_seqs + self.max_queued
        self.media_shapes = MediaShapes.from_hf_config(self.engine.model_config.hf_config)
        self.hidden_size = self.engine.model_config.get_hidden_size()
        if self.is_talker:
            reasons = [r for r in await self.engine.collective_rpc(talker_engine.RPC) if r]
            if reasons:
                raise RuntimeError(f"[{self.name}] the talker cannot run: {'; '.join(reasons)}")
            self.talker = talker.TalkerPrompter(self.engine_args["model"], self.name)
        if self._capture_dir is None:
            self.hidden_states_unavailable = (
                f"the engine runs its own worker_extension_cls {own_extension!r}")
        else:
            reasons = [r for r in await self.engine.collective_rpc(hidden_states.RPC) if r]
            self.hidden_states_unavailable = "; ".join(reasons)
        log.info("[%s] engine ready (model=%s, max_model_len=%s)", self.name,
                 self.engine_args.get("model"), self.max_model_len)

    async def _warm_up(self) -> None:
        """Run warmup.plan's batches through the engine, muted (none of it is counted)."""
        vocab = (self.talker.config.vocab_size if self.talker is not None
                 else self.engine.model_config.get_vocab_size())
        self._warming = True
        try:
            self.warmup_report = await warmup.run(self.engine, self.max_model_len, vocab,
                                                  self._render_prompt)
        finally:
            self._warming = False
        self.metrics.scheduler(0, 0)
        log.info("[%s] %s", self.name, self.warmup_report)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is still running, wait for it, stop the engine and the loop."""
        self._stopping.set()
        with self._live_lock:
            live = list(self._live.items())
        for request_id, _ in live:
            self.abort(request_id)
        deadline = time.monotonic() + timeout
        for _, fut in live:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # already reported to its sink
                pass
        if self.engine is not None:
            self.engine.shutdown()
        processes.terminate(self._engine_processes)  # what a dead core left behind
        if self._capture_dir is not None:
            hidden_states.remove_directory(self._capture_dir)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # --- requests ----------------------------------------------------------------
    def submit(self, request: LLMRequest, sink: Sink, arrival: float | None = None,
               client_id: str | None = None) -> None:
        """Schedule one request; outputs and errors go to `sink`. Never blocks.

        `client_id` (the caller's Triton request id) lets `abort_client` find it.
        """
        if self._stopping.is_set() or self.engine is None:
            sink.fail(StageUnavailableError(f"stage {self.name} is not serving"))
            return
        if not self.healthy():
            sink.fail(StageUnavailableError(self.dead))
            return
        arrival = time.perf_counter() if arrival is None else arrival
        with self._live_lock:
            aborted_early = client_id is not None and self._aborted_early.pop(client_id, None)
            in_flight = len(self._live)
        if aborted_early:  # its abort came first: end it at once
            sink.send(_aborted_output())
            return
        if self.max_in_flight is not None and in_flight >= self.max_in_flight:
            sink.fail(StageOverloadedError(
                f"stage {self.name} is overloaded: {in_flight} requests in flight, the most "
                f"it takes ({self.max_in_flight - self.max_queued} running + {self.max_queued} "
                f"waiting, queue.max_queue_size); retry later"))
            return
        fut = asyncio.run_coroutine_threadsafe(self._generate(request, sink, arrival), self._loop)
        with self._live_lock:
            self._live[request.request_id] = fut
            if client_id:
                self._by_client_id[client_id] = request.request_id
            self.metrics.in_flight(len(self._live))
        fut.add_done_callback(lambda _: self._forget(request.request_id, client_id))

    def abort_client(self, client_id: str) -> bool:
        """Abort the request the caller submitted as `client_id` (the in-band abort).

        False when no such request is live; it may still be on its way (the
        abort overtook it), so it is remembered for EARLY_ABORT_TTL_S and a
        request arriving under that id then ends at once, aborted.
        """
        now = time.monotonic()
        with self._live_lock:
            request_id = self._by_client_id.get(client_id)
            if request_id is None:
                self._aborted_early = {c: t for c, t in self._aborted_early.items()
                                       if now - t < EARLY_ABORT_TTL_S}
                self._aborted_early[client_id] = now
                return False
        self.abort(request_id)
        return True

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe, no-op when finished); its sink gets a final "abort".

        The request is marked first: if the engine does not know it yet (its
        prompt is still being rendered), the stage aborts it again as soon as
        it appears, so an abort is never lost to that race.
        """
        with self._live_lock:
            if request_id not in self._live:
                return
            self._aborted.add(request_id)
        if self.engine is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.engine.abort(request_id), self._loop)

    def _forget(self, request_id: str, client_id: str | None = None) -> None:
        with self._live_lock:
            self._live.pop(request_id, None)
            self._aborted.discard(request_id)
            if client_id and self._by_client_id.get(client_id) == request_id:
                del self._by_client_id[client_id]
            self.metrics.in_flight(len(self._live))

    async def _render_prompt(self, prompt: dict):
        return await render.render_prompt(self.engine, prompt)

    async def _render(self, req: LLMRequest, params):
        if self.talker is not None:
            if req.talker is None:
                raise RequestError(LLM.THINKER_HIDDEN_STATES_FILE,
                                   f"is required: stage {self.name} is a talker")
            prompt, feed = await self.talker.prompt(req.talker, timeout_s=TALKER_WAIT_S)
            params.extra_args = {**(params.extra_args or {}), talker_engine.EXTRA_ARG: feed}
            return await self._render_prompt(prompt)
        if req.talker is not None:
            raise RequestError(LLM.THINKER_HIDDEN_STATES_FILE,
                               f"stage {self.name} is not a talker (engine_args \"talker\": true)")
        return await render.render_request(self.engine, req, self.media_shapes, self.name)

    def healthy(self) -> bool:
        """False once the engine has died (noticed here when vLLM's client already knows,
        before any request fails on it); the model's readiness where Triton asks."""
        if not self.dead and self.engine is not None and getattr(self.engine, "errored", False):
            self._died(self.engine.dead_error)
        return not self.dead

    def _died(self, error: BaseException) -> str:
        """Record the engine's death (once) and say what a request gets from now on."""
        with self._dead_lock:
            if self.dead:
                return self.dead
            self.dead = (f"stage {self.name} is unavailable: its vLLM engine died ({error}); "
                         "reload the model (model control) or restart the server")
        log.error("[%s] %s", self.name, self.dead)
        # its workers cannot serve without it: end them now, not at unload
        threading.Thread(target=processes.terminate, args=(self._engine_processes,),
                         name=f"{self.name}-reap", daemon=True).start()
        if self.on_dead is not None:
            try:
                self.on_dead(self.dead)
            except Exception:  # the stage still answers UNAVAILABLE
                log.exception("[%s] on_dead failed", self.name)
        return self.dead

    async def _generate(self, req: LLMRequest, sink: Sink, arrival: float) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        capture = None
        try:
            fields = (self.talker.sampling(req.sampling, self.max_model_len)
                      if self.talker is not None else req.sampling)
            params = sampling.build(fields, stream=req.stream)
            for own in (hidden_states.EXTRA_ARG, talker_engine.EXTRA_ARG):
                if params.extra_args and own in params.extra_args:
                    raise RequestError(f"{sampling.FIELD}.extra_args.{own}",
                                       "is set by the stage")
            if req.return_hidden_states:
                capture = self._capture(params)
            engine_input = await self._render(req, params)
            if req.request_id in self._aborted:  # aborted while its prompt was rendered
                sink.send(_aborted_output())
                return
            await self._stream(req, sink, params, engine_input, arrival, capture)
        except RequestError as e:
            sink.fail(e)
        except (VLLMClientError, ValueError) as e:
            param = getattr(e, "parameter", None)
            if param in sampling.settable_fields():
                sink.fail(sampling.client_error(e, sampling.FIELD))
            else:  # about the prompt (too long, bad tokens)
                sink.fail(RequestError("text_input", str(e.args[0] if e.args else e)))
        except asyncio.CancelledError:
            await self.engine.abort(req.request_id)
            raise
        except EngineDeadError as e:
            sink.fail(StageUnavailableError(self._died(e)))
        except Exception as e:  # engine failure: that request fails, the stage reports it
            log.exception("[%s] request %s failed", self.name, req.request_id)
            sink.fail(e)
        finally:
            if capture is not None:
                capture.close()

    def _capture(self, params) -> hidden_states.CaptureFile:
        """A capture file for one request's hidden states, named in its SamplingParams.

        The request skips the prefix cache: a cached position is never computed,
        so its hidden state would be missing.
        """
        if self.hidden_states_unavailable:
            raise RequestError(LLM.RETURN_HIDDEN_STATES, "this stage cannot return hidden "
                                                         f"states: {self.hidden_states_unavailable}")
        capture = hidden_states.CaptureFile(self._capture_dir, self.hidden_size)
        params.extra_args = {**(params.extra_args or {}), hidden_states.EXTRA_ARG: capture.token}
        params.skip_reading_prefix_cache = True
        return capture

    async def _stream(self, req: LLMRequest, sink: Sink, params, engine_input,
                      arrival: float, capture: hidden_states.CaptureFile | None = None) -> None:
        first_at: float | None = None
        last_at = 0.0
        n_out = 0
        n_in = 0
        first_output = True
        async for out in self.engine.generate(engine_input, params, req.request_id):
            now = time.perf_counter()
            if not out.finished and req.request_id in self._aborted:
                await self.engine.abort(req.request_id)  # it reached the engine after its abort
            comp = out.outputs[0]
            n_in = len(out.prompt_token_ids or ())
            new_tokens = len(comp.token_ids)
            if first_at is None and new_tokens:
                first_at = now
                self.metrics.time_to_first_token(now - arrival)
            last_at = now
            n_out = n_out + new_tokens if req.stream else new_tokens
            text = comp.text
            if not req.stream and not req.exclude_input_in_output:
                text = (out.prompt or req.prompt or "") + text
            ids = comp.token_ids
            if (self.talker is not None and comp.finish_reason == "stop" and ids
                    and ids[-1] in self.talker.stop_ids):
                ids = ids[:-1]  # as transformers cuts the codes at the talker's eos
            rows = span = None
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
            if out.finished:  # counted before the final response goes: whoever has it sees them
                self._count(n_in, n_out, first_at, last_at)
                if capture is not None:
                    capture.completed = comp.finish_reason != "abort"
            sink.send(LLMOutput(text=text, finish_reason=comp.finish_reason,
                                num_input_tokens=n_in, num_output_tokens=n_out,
                                final=out.finished, token_ids=tuple(ids),
                                input_token_ids=tuple(out.prompt_token_ids or ())
                                if req.return_input_token_ids and first_output else None,
                                hidden=rows, hidden_span=span,
                                hidden_file=capture.path if span is not None else None))
            first_output = False

    def _count(self, n_in: int, n_out: int, first_at: float | None, last_at: float) -> None:
        self.metrics.tokens(n_in, n_out)
        if first_at is not None and n_out > 1:  # vLLM's definition: decode time / (n - 1)
            self.metrics.time_per_output_token((last_at - first_at) / (n_out - 1))

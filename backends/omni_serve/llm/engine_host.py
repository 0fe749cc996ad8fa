"""One vLLM AsyncLLM engine hosted in a Triton stub: what every vLLM-backed stage shares.

Runs in the stub process of an omni_llm or omni_talker model. Threads:
- Triton's execute() thread calls `submit()`, which only schedules work;
- the engine thread owns an asyncio loop with the AsyncLLM client; one task
  per request runs the stage kind's `serve(request, sink, arrival)` coroutine
  (render the prompt, iterate `generate()`, hand each output to the `Sink`);
- the adapter's sender thread (omni_serve.tritonio.ResponseSender) turns
  outputs into Triton responses and calls `abort()` when a client cancels.

What the host owns, so that no stage kind repeats it: the loop, engine start
(with its one-line failure, llm/startup_failure.py) and warm-up, live-request
bookkeeping, aborts (in-band ones that overtake their request included),
overload refusal (`max_queued_requests`), the dead-engine state (every request
UNAVAILABLE naming the stage, `on_dead` once), the per-request token metrics
and shutdown. The stage kinds (llm/stage.py, talker/stage.py) hold it by
composition and give it their `serve` and what to do once the engine runs.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from omni_serve import processes
from omni_serve.contract import MAX_QUEUED_ARG
from omni_serve.errors import RequestError, StageOverloadedError, StageUnavailableError
from omni_serve.llm import cpu_engine, render, sampling, startup_failure, warmup
from omni_serve.llm.metrics import NULL_METRICS, NullMetrics, Sink, StageMetrics, stat_logger_factory

log = logging.getLogger(__name__)

# How long an in-band abort that found no request waits for that request to arrive.
EARLY_ABORT_TTL_S = 60.0

# Engine arguments the host sets unless the per-stage JSON says otherwise.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    "disable_log_stats": True,  # our stat logger still receives the stats
}


class Request(Protocol):
    request_id: str


Serve = Callable[[Any, Sink, float], Awaitable[None]]


class EngineHost:
    """Owns one AsyncLLM engine and its event loop; thread-safe `submit`.

    `serve(request, sink, arrival)` is the stage kind's coroutine for one request,
    `aborted()` its final output for a request stopped before the engine ran it;
    errors it raises are mapped here (RequestError and vLLM's client errors become
    that request's INVALID_ARG naming `prompt_field` or the sampling field, a dead
    engine UNAVAILABLE for every request from then on).
    """

    def __init__(self, engine_args: dict[str, Any], *, serve: Serve, aborted: Callable[[], Any],
                 name: str, metrics: StageMetrics | None = None, prompt_field: str = "text_input",
                 stat_loggers: Sequence[Callable] = ()):
        # vLLM's request errors, imported here, not by the first request on the engine
        # loop (the import takes seconds on a cold process)
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        self._vllm_errors = (VLLMClientError, EngineDeadError)
        self.name = name
        self.serve = serve
        self.aborted_output = aborted  # the final output of a request stopped before it ran
        self.prompt_field = prompt_field
        engine_args = dict(engine_args)
        queued = engine_args.pop(MAX_QUEUED_ARG, None)
        self.max_queued: int | None = None if queued is None else int(queued)
        self.max_in_flight: int | None = None  # max_num_seqs + max_queued, once started
        self.engine_args = {**DEFAULT_ENGINE_ARGS, **engine_args}
        self.metrics = metrics or NullMetrics()
        # more stat loggers (vllm_backend's vllm:* families): each a callable that, given
        # `muted()` (true while the engine warms up), returns a vLLM StatLogger factory
        self.stat_loggers = tuple(stat_loggers)
        self.engine = None
        self.supported_tasks: tuple[str, ...] = ()  # vLLM's ("generate",), ("embed", ...)
        self.max_model_len: int | None = None
        self.max_num_seqs = 1  # sequences the engine runs at once, once started
        self.warmup_report = ""  # what the warm-up did and how long it took
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
        self._cleanups: list[Callable[[], None]] = []  # run at shutdown, after the engine
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
    def start(self, started: Callable[[], Awaitable[None]] | None = None, *,
              warm_up: bool = True, vocab: Callable[[], int] | None = None) -> None:
        """Start the loop and the engine, run `started` on the loop, then warm the engine
        up with prompts of ids below `vocab()` (blocks until all are done)."""
        self._thread.start()
        self.run(self._start_engine())
        if started is not None:
            self.run(started())
        if warm_up and warmup.enabled() and "generate" in self.supported_tasks:
            size = vocab() if vocab is not None else self.engine.model_config.get_vocab_size()
            self.run(self._warm_up(size))

    def run(self, coro: Awaitable[Any]) -> Any:
        """Run `coro` on the engine loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def at_shutdown(self, cleanup: Callable[[], None]) -> None:
        self._cleanups.append(cleanup)

    async def _start_engine(self) -> None:
        with startup_failure.watch(self.name):
            self.engine = cpu_engine.start(self.engine_args, stat_loggers=[
                stat_logger_factory(lambda: NULL_METRICS if self._warming else self.metrics),
                *(factory(lambda: self._warming) for factory in self.stat_loggers)])
        self.supported_tasks = tuple(await self.engine.get_supported_tasks())
        self._engine_processes = processes.descendants()
        self.max_model_len = self.engine.model_config.max_model_len
        self.max_num_seqs = self.engine.vllm_config.scheduler_config.max_num_seqs
        if self.max_queued is not None:
            self.max_in_flight = self.max_num_seqs + self.max_queued
        log.info("[%s] engine ready (model=%s, max_model_len=%s)", self.name,
                 self.engine_args.get("model"), self.max_model_len)

    async def _warm_up(self, vocab: int) -> None:
        """Run warmup.plan's batches through the engine, muted (none of it is counted)."""
        self._warming = True
        try:
            self.warmup_report = await warmup.run(self.engine, self.max_model_len, vocab,
                                                  self.render_prompt)
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
        for cleanup in self._cleanups:
            cleanup()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # --- requests ----------------------------------------------------------------
    def submit(self, request: Request, sink: Sink, arrival: float | None = None,
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
            sink.send(self.aborted_output())
            return
        if self.max_in_flight is not None and in_flight >= self.max_in_flight:
            sink.fail(StageOverloadedError(
                f"stage {self.name} is overloaded: {in_flight} requests in flight, the most "
                f"it takes ({self.max_in_flight - self.max_queued} running + {self.max_queued} "
                f"waiting, queue.max_queue_size); retry later"))
            return
        fut = asyncio.run_coroutine_threadsafe(self._serve(request, sink, arrival), self._loop)
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
        prompt is still being rendered), the host aborts it again as soon as
        it appears, so an abort is never lost to that race.
        """
        with self._live_lock:
            if request_id not in self._live:
                return
            self._aborted.add(request_id)
        if self.engine is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.engine.abort(request_id), self._loop)

    def aborted(self, request_id: str) -> bool:
        """Whether the request was asked to stop (e.g. while its prompt was rendered)."""
        return request_id in self._aborted

    def _forget(self, request_id: str, client_id: str | None = None) -> None:
        with self._live_lock:
            self._live.pop(request_id, None)
            self._aborted.discard(request_id)
            if client_id and self._by_client_id.get(client_id) == request_id:
                del self._by_client_id[client_id]
            self.metrics.in_flight(len(self._live))

    async def render_prompt(self, prompt: dict):
        return await render.render_prompt(self.engine, prompt)

    def healthy(self) -> bool:
        """False once the engine has died (noticed here when vLLM's client already knows,
        before any request fails on it); the model's readiness where Triton asks."""
        if not self.dead and self.engine is not None and getattr(self.engine, "errored", False):
            self._died(self.engine.dead_error)
        return not self.dead

    def check_health(self) -> bool:
        """vLLM's own check_health(), run on the engine loop (vllm_backend's check before
        each execute); a failing check is the engine's death. False once it died."""
        if self.dead or self.engine is None:
            return not self.dead
        try:
            self.run(self.engine.check_health())
        except Exception as e:
            self._died(e)
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

    async def _serve(self, request: Request, sink: Sink, arrival: float) -> None:
        VLLMClientError, EngineDeadError = self._vllm_errors
        try:
            await self.serve(request, sink, arrival)
        except RequestError as e:
            sink.fail(e)
        except (VLLMClientError, ValueError) as e:
            param = getattr(e, "parameter", None)
            if param in sampling.settable_fields():
                sink.fail(sampling.client_error(e, sampling.FIELD))
            else:  # about the prompt (too long, bad tokens)
                sink.fail(RequestError(self.prompt_field, str(e.args[0] if e.args else e)))
        except asyncio.CancelledError:
            await self.engine.abort(request.request_id)
            raise
        except EngineDeadError as e:
            sink.fail(StageUnavailableError(self._died(e)))
        except Exception as e:  # engine failure: that request fails, the stage reports it
            log.exception("[%s] request %s failed", self.name, request.request_id)
            sink.fail(e)

    async def generate(self, engine_input, params, request_id: str, arrival: float,
                       stream: bool, lora_request=None) -> AsyncIterator[tuple[Any, int, int]]:
        """vLLM's outputs of one request with (prompt tokens, output tokens so far).

        Records time to first token, and on the final output the token counts and
        time per output token, before the caller sends it (whoever has the final
        response sees them counted).
        """
        first_at: float | None = None
        last_at = 0.0
        n_out = 0
        extra = {} if lora_request is None else {"lora_request": lora_request}
        async for out in self.engine.generate(engine_input, params, request_id, **extra):
            now = time.perf_counter()
            if not out.finished and request_id in self._aborted:
                await self.engine.abort(request_id)  # it reached the engine after its abort
            n_in = len(out.prompt_token_ids or ())
            new_tokens = sum(len(comp.token_ids) for comp in out.outputs)  # n > 1: several
            if first_at is None and new_tokens:
                first_at = now
                self.metrics.time_to_first_token(now - arrival)
            last_at = now
            n_out = n_out + new_tokens if stream else new_tokens
            if out.finished:
                self._count(n_in, n_out, first_at, last_at)
            yield out, n_in, n_out

    def _count(self, n_in: int, n_out: int, first_at: float | None, last_at: float) -> None:
        self.metrics.tokens(n_in, n_out)
        if first_at is not None and n_out > 1:  # vLLM's definition: decode time / (n - 1)
            self.metrics.time_per_output_token((last_at - first_at) / (n_out - 1))

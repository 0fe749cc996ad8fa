"""The omni pipeline's stage graph for one request (runs on the orchestrator's event loop).

Flow of one request (pipelined mode):

    media --> image/audio encoders (concurrently) --> image rows, audio features
    text + media --> thinker (streamed) --> text deltas to the client
                       |  every few tokens: a segment of reply token ids
                       v
                    talker (streamed, one segment after another) --> codec codes
                       |  every few codes: a chunk with left context
                       v
                    audio decoder (one call per chunk) --> PCM chunks to the client
    whole reply --> image generator (when "image" is asked for) --> PNG

The talker works on segment k while the thinker writes segment k+1, and the
decoder voices chunk j while the talker samples chunk j+1, so the first audio
comes long before the text is finished. In sequential mode every stage waits
for the previous one to finish (the baseline of tools/bench_omni.py).

Stages are reached through a `StageClient` (BLS inside Triton; anything with
the same three calls in tests). A failing stage ends the request with a
StageFailedError naming it; cancelling the task cancels every child stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from omni_serve.audio.request import chunk_plan
from omni_serve.contract import AUDIO, DIT, ENCODER, LLM
from omni_serve.errors import StageFailedError
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.request import OmniRequest, Turn
from omni_serve.orchestrator.routing import EngineRouter

log = logging.getLogger(__name__)

# Qwen2.5-Omni's prompt spans for media (the thinker's tokenizer has these tokens).
AUDIO_SPAN = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
IMAGE_SPAN = ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>")


@dataclass(frozen=True)
class Chunk:
    """One decoder request: `codes` = left context + the codes voiced + right context."""

    segment: int
    codes: list[int]
    context: int
    lookahead: int
    offset: int  # position of codes[0] in its segment
    end: int  # one past the last code voiced, in its segment


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error in a (nested) exception group (cancellations come last)."""
    leaves = []
    stack = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = list(exc.exceptions)
        else:
            leaves.append(exc)
    real = [e for e in leaves if not isinstance(e, asyncio.CancelledError)]
    return (real or leaves)[0]


class StageCallError(Exception):
    """What a StageClient raises when a stage answers with an error (or not at all)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class StageClient(Protocol):
    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> dict[str, np.ndarray]: ...

    def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str], *,
               request_id: str, timeout_s: float) -> AsyncIterator[dict[str, np.ndarray]]: ...


# --- events sent back to the client ----------------------------------------------------

@dataclass
class TextDelta:
    text: str


@dataclass
class AudioChunk:
    pcm: np.ndarray
    sample_rate: int


@dataclass
class ImageOut:
    png: bytes


@dataclass
class CodecIds:
    """The talker's codec ids of the reply so far (sent with `return_codec_ids`)."""

    ids: list[int]


@dataclass
class Final:
    finish_reason: str
    metrics: dict[str, Any]


Event = TextDelta | AudioChunk | ImageOut | CodecIds | Final


@dataclass
class Timings:
    """Per-request timings: what the final response's `metrics` JSON reports."""

    start: float = field(default_factory=time.perf_counter)
    first_text: float | None = None
    first_audio: float | None = None
    audio_start: float | None = None
    audio_end: float | None = None
    audio_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0  # the thinker's (or, reading aloud, the text's) tokens
    completion_tokens: int = 0  # the thinker's reply tokens
    thinker_model: str | None = None  # the thinker engine that served the request
    passed_over: list[str] = field(default_factory=list)  # thinker engines found down

    def add(self, role: str, seconds: float) -> None:
        self.stage_seconds[role] = self.stage_seconds.get(role, 0.0) + seconds

    def report(self) -> dict[str, Any]:
        now = time.perf_counter()
        out: dict[str, Any] = {
            "total_s": round(now - self.start, 6),
            "time_to_first_token_s": None if self.first_text is None else
            round(self.first_text - self.start, 6),
            "time_to_first_audio_s": None if self.first_audio is None else
            round(self.first_audio - self.start, 6),
            "audio_seconds": round(self.audio_seconds, 6),
            "audio_rtf": None,
            "stage_seconds": {k: round(v, 6) for k, v in self.stage_seconds.items()},
            "usage": {"prompt_tokens": self.prompt_tokens,
                      "completion_tokens": self.completion_tokens},
        }
        if self.thinker_model is not None:
            out["thinker_model"] = self.thinker_model
        if self.passed_over:
            out["thinker_passed_over"] = list(self.passed_over)
        if self.audio_seconds > 0 and self.audio_start is not None and self.audio_end is not None:
            out["audio_rtf"] = round((self.audio_end - self.audio_start) / self.audio_seconds, 6)
        return out


def _bytes_tensor(value: str | bytes) -> np.ndarray:
    data = value.encode("utf-8") if isinstance(value, str) else value
    return np.array([data], dtype=np.object_)


def _first(arr: np.ndarray | None, default: Any = None) -> Any:
    if arr is None or np.asarray(arr).size == 0:
        return default
    value = np.asarray(arr).reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


def media_span(span: tuple[str, str, str]) -> str:
    """`<|audio_bos|><|AUDIO|><|audio_eos|>`: the engine expands the placeholder to the
    item's tokens."""
    return "".join(span)


def chat_prompt(system: str, user: str, history: Sequence[Turn] = ()) -> str:
    """The thinker's ChatML prompt (Qwen2.5-Omni's template): the earlier turns, then `user`.

    Each turn is `<|im_start|>{role}\n{content}<|im_end|>\n`, as in Qwen's chat
    template, so turn N's prompt extends turn N-1's prompt + its reply and
    the engine's prefix cache holds everything up to the new user turn.
    """
    turns = "".join(f"<|im_start|>{turn.role}\n{turn.content}<|im_end|>\n" for turn in history)
    return (f"<|im_start|>system\n{system}<|im_end|>\n{turns}"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


class OmniPipeline:
    """Runs requests through the stages named in `cfg.stages`."""

    def __init__(self, cfg: OrchestratorConfig, client: StageClient,
                 tokenize: Callable[[str], list[int]] | None = None):
        self.cfg = cfg
        self.client = client
        # the thinker's tokenizer (text -> ids), for task "speech"
        self.tokenize = tokenize
        # which thinker engine serves a request (session affinity, else least busy)
        self.thinkers = EngineRouter(cfg.stages.thinkers, retry_after_s=cfg.engine_retry_after_s)

    # --- stage calls with the stage's name on every error ---------------------------
    async def _infer(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                     timings: Timings) -> dict[str, np.ndarray]:
        model = getattr(self.cfg.stages, role)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.stage_timeout_s):  # not wait_for: see grpc_stream
                return await self.client.infer(model, inputs, outputs)
        except StageCallError as e:
            raise StageFailedError(role, model, e.message, e.code) from e
        except TimeoutError as e:
            raise StageFailedError(role, model, f"no answer within {self.cfg.stage_timeout_s:g} s",
                                   "UNAVAILABLE") from e
        finally:
            timings.add(role, time.perf_counter() - t0)

    async def _stream(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                      request_id: str, timings: Timings,
                      model: str | None = None) -> AsyncIterator[dict[str, np.ndarray]]:
        model = model or getattr(self.cfg.stages, role)
        t0 = time.perf_counter()
        try:
            # aclosing here and around every stage stream below: a stream whose consumer
            # stops is closed at once (the gRPC call cancelled), not when it is collected
            async with contextlib.aclosing(self.client.stream(
                    model, inputs, outputs, request_id=request_id,
                    timeout_s=self.cfg.stage_timeout_s)) as responses:
                async for out in responses:
                    yield out
        except StageCallError as e:
            raise StageFailedError(role, model, e.message, e.code) from e
        finally:
            timings.add(role, time.perf_counter() - t0)

    # --- the request -----------------------------------------------------------------
    async def run(self, req: OmniRequest, emit: Callable[[Event], None]) -> None:
        """Run one request, emitting events; raises on failure (the caller reports it)."""
        t = Timings()
        if req.task == "speech":
            await self._read_aloud(req, emit, t)
            emit(Final("stop", t.report()))
            return
        media, prompt = await self._encode(req, t)
        speech = "audio" in req.modalities
        sequential = self.cfg.mode == "sequential"
        segments: asyncio.Queue | None = asyncio.Queue() if speech else None
        try:
            # one task group: a failing talker or decoder cancels the thinker and back
            async with asyncio.TaskGroup() as tg:
                think = tg.create_task(self._think(req, prompt, media, emit, segments, t))
                if speech and not sequential:
                    tg.create_task(self._speak(req, segments, emit, t))
            reply, finish = think.result()
            if speech and sequential:
                await self._speak(req, segments, emit, t)
            if "image" in req.modalities:
                emit(ImageOut(await self._draw(req, reply, t)))
        except ExceptionGroup as group:
            raise _first_error(group) from None
        emit(Final(finish, t.report()))

    # --- encoders --------------------------------------------------------------------
    async def _encode(self, req: OmniRequest, t: Timings) -> tuple[dict[str, np.ndarray], str]:
        """The encoders' outputs as thinker inputs, and the prompt with one placeholder each."""
        jobs, roles = [], []
        for role, data, outputs in (
                ("audio_encoder", req.audio, [ENCODER.FEATURES]),
                ("image_encoder", req.image, [ENCODER.EMBEDDINGS, ENCODER.GRID_THW])):
            if data is not None:
                jobs.append(self._infer(role, {ENCODER.MEDIA: np.array([[data]], dtype=np.object_)},
                                        outputs, t))
                roles.append(role)
        media: dict[str, np.ndarray] = {}
        parts = []
        for role, out in zip(roles, await asyncio.gather(*jobs)):
            if role == "audio_encoder":
                features = np.asarray(out[ENCODER.FEATURES], dtype=np.float32)
                features = features.reshape(features.shape[-2], features.shape[-1])
                media[LLM.AUDIO_FEATURES] = features
                media[LLM.AUDIO_FEATURE_LENGTHS] = np.array([features.shape[1]], dtype=np.int64)
                parts.append(media_span(AUDIO_SPAN))
            else:
                rows = np.asarray(out[ENCODER.EMBEDDINGS], dtype=np.float32)
                media[LLM.IMAGE_EMBEDS] = rows.reshape(-1, rows.shape[-1])
                media[LLM.IMAGE_GRID_THW] = np.asarray(out[ENCODER.GRID_THW],
                                                       dtype=np.int64).reshape(1, 3)
                parts.append(media_span(IMAGE_SPAN))
        prompt = chat_prompt(self.cfg.system_prompt, "".join(parts) + req.text, req.history)
        return media, prompt

    # --- thinker ---------------------------------------------------------------------
    async def _think(self, req: OmniRequest, prompt: str, media: dict[str, np.ndarray],
                     emit: Callable[[Event], None], segments: asyncio.Queue | None,
                     t: Timings) -> tuple[str, str]:
        sampling = {**self.cfg.thinker_sampling, **req.sampling}
        inputs = {
            LLM.TEXT_INPUT: _bytes_tensor(prompt),
            LLM.STREAM: np.array([True]),
            LLM.SAMPLING_PARAMETERS: _bytes_tensor(json.dumps(sampling)),
            LLM.RETURN_FINISH_REASON: np.array([True]),
            LLM.RETURN_TOKEN_IDS: np.array([True]),
            LLM.RETURN_NUM_INPUT_TOKENS: np.array([True]),
            LLM.RETURN_NUM_OUTPUT_TOKENS: np.array([True]),
        }
        inputs.update(media)
        pending: list[int] = []
        limit = self.cfg.first_segment_tokens
        text: list[str] = []
        finish = ""
        async with contextlib.aclosing(self._thinker_stream(req, inputs, t)) as responses:
            async for out in responses:
                t.prompt_tokens = int(_first(out.get(LLM.NUM_INPUT_TOKENS), t.prompt_tokens))
                # streamed: each response carries the running count of reply tokens
                t.completion_tokens = int(_first(out.get(LLM.NUM_OUTPUT_TOKENS),
                                                 t.completion_tokens))
                delta = _first(out.get(LLM.TEXT_OUTPUT), "")
                if delta:
                    if t.first_text is None:
                        t.first_text = time.perf_counter()
                    text.append(delta)
                    emit(TextDelta(delta))
                finish = _first(out.get(LLM.FINISH_REASON), "") or finish
                if segments is not None:
                    ids = out.get(LLM.TOKEN_IDS)
                    if ids is not None:
                        pending.extend(int(i) for i in np.asarray(ids).reshape(-1))
                    # Cut at exact sizes: a response may carry several tokens (the stage
                    # merges outputs while its sender is busy), and the talker's input,
                    # so the speech for a given seed, must not depend on that timing.
                    while len(pending) >= limit:
                        segments.put_nowait(pending[:limit])
                        pending, limit = pending[limit:], self.cfg.segment_tokens
        if segments is not None:
            if pending:
                segments.put_nowait(pending)
            segments.put_nowait(None)  # the reply is complete
        return "".join(text), finish

    async def _thinker_stream(self, req: OmniRequest, inputs: dict[str, np.ndarray],
                              t: Timings) -> AsyncIterator[dict[str, np.ndarray]]:
        """The thinker's responses, from the engine the router picks.

        An engine that fails UNAVAILABLE before its first response is marked
        down and the request goes to the next engine (nothing was emitted
        yet); once it has answered, its failures end the request.
        """
        outputs = [LLM.TEXT_OUTPUT, LLM.FINISH_REASON, LLM.TOKEN_IDS,
                   LLM.NUM_INPUT_TOKENS, LLM.NUM_OUTPUT_TOKENS]
        tried: list[str] = []
        while True:
            with self.thinkers.route(req.session_id, exclude=tried) as engine:
                t.thinker_model = engine
                answered = False
                try:
                    async with contextlib.aclosing(self._stream(
                            "thinker", inputs, outputs, f"{req.request_id}-thinker", t,
                            model=engine)) as responses:
                        async for out in responses:
                            if not answered:
                                answered = True
                                self.thinkers.mark_up(engine)
                            yield out
                    return
                except StageFailedError as e:
                    tried.append(engine)
                    if answered or e.code != "UNAVAILABLE":
                        raise
                    self.thinkers.mark_down(engine)
                    if len(tried) == len(self.thinkers.engines):
                        raise
                    t.passed_over.append(engine)
                    log.warning("%s; passing it over for %g s, request %s goes to the next "
                                "engine", e, self.thinkers.retry_after_s, req.request_id)

    # --- reading text aloud (task "speech") ---------------------------------------------
    async def _read_aloud(self, req: OmniRequest, emit: Callable[[Event], None], t: Timings) -> None:
        """Voice `req.text` itself: its thinker token ids go to the talker in segments."""
        if self.tokenize is None:
            raise StageFailedError("talker", self.cfg.stages.talker or "",
                                   "no thinker tokenizer is loaded to read text aloud",
                                   "UNAVAILABLE")
        ids = list(self.tokenize(req.text))
        t.prompt_tokens = len(ids)
        segments: asyncio.Queue = asyncio.Queue()
        first = self.cfg.first_segment_tokens
        for start in (0, *range(first, len(ids), self.cfg.segment_tokens)):
            size = first if start == 0 else self.cfg.segment_tokens
            if ids[start:start + size]:
                segments.put_nowait(ids[start:start + size])
        segments.put_nowait(None)
        await self._speak(req, segments, emit, t)

    # --- talker + audio decoder ------------------------------------------------------
    async def _speak(self, req: OmniRequest, segments: asyncio.Queue,
                     emit: Callable[[Event], None], t: Timings) -> None:
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(7), "big")
        if self.cfg.mode == "sequential":  # every talker call, then every decoder call
            chunks: list[Chunk] = []
            index = 0
            while (segment := await segments.get()) is not None:
                t.audio_start = t.audio_start or time.perf_counter()
                chunks.extend([chunk async for chunk in self._talk(req, segment, index, t)])
                index += 1
            for chunk in chunks:
                self._emit_audio(await self._decode(req, chunk, seed, t), emit, t)
            return
        # pipelined: segments talk concurrently (vLLM batches them), chunks decode
        # concurrently (Triton batches them); audio still goes out in order.
        order: asyncio.Queue = asyncio.Queue()  # per segment, in order: its queue of decodes
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._talk_segments(req, segments, order, seed, tg, t))
                while (decodes := await order.get()) is not None:
                    while (decode := await decodes.get()) is not None:
                        self._emit_audio(await decode, emit, t)
        except ExceptionGroup as group:
            raise _first_error(group) from None

    async def _talk_segments(self, req: OmniRequest, segments: asyncio.Queue, order: asyncio.Queue,
                             seed: int, tg: asyncio.TaskGroup, t: Timings) -> None:
        talkers = asyncio.Semaphore(self.cfg.parallel_segments)
        decoders = asyncio.Semaphore(self.cfg.parallel_chunks)
        index = 0
        while (segment := await segments.get()) is not None:
            t.audio_start = t.audio_start or time.perf_counter()
            decodes: asyncio.Queue = asyncio.Queue()
            order.put_nowait(decodes)
            await talkers.acquire()
            tg.create_task(self._talk_segment(req, segment, index, decodes, seed, talkers, decoders,
                                              tg, t))
            index += 1
        order.put_nowait(None)

    async def _talk_segment(self, req: OmniRequest, segment: list[int], index: int,
                            decodes: asyncio.Queue, seed: int, talkers: asyncio.Semaphore,
                            decoders: asyncio.Semaphore, tg: asyncio.TaskGroup, t: Timings) -> None:
        async def decode(chunk: Chunk) -> AudioChunk:
            try:
                return await self._decode(req, chunk, seed, t)
            finally:
                decoders.release()

        try:
            async with contextlib.aclosing(self._talk(req, segment, index, t)) as chunks:
                async for chunk in chunks:
                    await decoders.acquire()
                    decodes.put_nowait(tg.create_task(decode(chunk)))
        finally:
            talkers.release()
            decodes.put_nowait(None)

    async def _talk(self, req: OmniRequest, segment: list[int], index: int,
                    t: Timings) -> AsyncIterator[Chunk]:
        """One talker call for reply segment `index`; yields its decoder chunks as codes arrive."""
        codec = self.cfg.codec
        max_codes = max(self.cfg.talker_min_codes,
                        math.ceil(len(segment) * self.cfg.talker_codes_per_token))
        sampling = {**self.cfg.talker_sampling, "max_tokens": max_codes,
                    "allowed_token_ids": [*range(codec.offset, codec.offset + codec.size), codec.eos],
                    "stop_token_ids": [codec.eos]}
        if req.seed is not None:
            sampling["seed"] = req.seed + index
        inputs = {
            LLM.PROMPT_TOKEN_IDS: np.array([*segment, codec.bos], dtype=np.int64),
            LLM.STREAM: np.array([True]),
            LLM.SAMPLING_PARAMETERS: _bytes_tensor(json.dumps(sampling)),
            LLM.RETURN_TOKEN_IDS: np.array([True]),
        }
        codes: list[int] = []
        done = 0  # codes already planned into chunks
        async with contextlib.aclosing(self._stream(
                "talker", inputs, [LLM.TOKEN_IDS], f"{req.request_id}-talker-{index}",
                t)) as responses:
            async for out in responses:
                ids = out.get(LLM.TOKEN_IDS)
                if ids is None:
                    continue
                codes.extend(int(i) - codec.offset for i in np.asarray(ids).reshape(-1)
                             if codec.offset <= int(i) < codec.offset + codec.size)
                for chunk in self._plan_chunks(codes, index, done, final=False):
                    done = chunk.end
                    yield chunk
        for chunk in self._plan_chunks(codes, index, done, final=True):
            yield chunk

    def _plan_chunks(self, codes: list[int], segment: int, done: int, *, final: bool) -> list[Chunk]:
        """The decoder chunks that `codes` allow now, past the first `done` codes."""
        cfg = self.cfg
        chunks = []
        while True:
            first = segment == 0 and done == 0
            spans = chunk_plan(len(codes), done, cfg.first_chunk_codes if first else cfg.chunk_codes,
                               cfg.left_context_codes, final, right_context=cfg.right_context_codes,
                               align=cfg.align_codes)
            if not spans:
                return chunks
            span = spans[0]  # the size changes after the first chunk: plan again
            chunks.append(Chunk(segment, codes[span.first:span.last], span.context, span.lookahead,
                                span.first, span.end))
            done = span.end

    async def _decode(self, req: OmniRequest, chunk: Chunk, seed: int, t: Timings) -> AudioChunk:
        # Each segment is its own utterance: its own noise stream, positions from 0.
        inputs = {AUDIO.CODEC_TOKENS: np.array([chunk.codes], dtype=np.int64),
                  AUDIO.CONTEXT_TOKENS: np.array([[chunk.context]], dtype=np.int32),
                  AUDIO.LOOKAHEAD_TOKENS: np.array([[chunk.lookahead]], dtype=np.int32),
                  AUDIO.CODE_OFFSET: np.array([[chunk.offset]], dtype=np.int64),
                  AUDIO.SEED: np.array([[(seed + chunk.segment) % 2**63]], dtype=np.int64)}
        if req.speaker:
            inputs[AUDIO.SPEAKER] = np.array([[req.speaker.encode()]], dtype=np.object_)
        out = await self._infer("audio_decoder", inputs, [AUDIO.AUDIO_CHUNK, AUDIO.SAMPLE_RATE], t)
        return AudioChunk(np.asarray(out[AUDIO.AUDIO_CHUNK], dtype=np.float32).reshape(-1),
                          int(_first(out[AUDIO.SAMPLE_RATE])))

    @staticmethod
    def _emit_audio(chunk: AudioChunk, emit: Callable[[Event], None], t: Timings) -> None:
        now = time.perf_counter()
        t.first_audio = t.first_audio or now
        t.audio_end = now
        t.audio_seconds += chunk.pcm.size / chunk.sample_rate
        emit(chunk)

    # --- image generator -------------------------------------------------------------
    async def _draw(self, req: OmniRequest, reply: str, t: Timings) -> bytes:
        side = self.cfg.image_size
        inputs = {DIT.PROMPT: np.array([[(reply or req.text).encode("utf-8")]], dtype=np.object_),
                  DIT.HEIGHT: np.array([[side]], dtype=np.int32),
                  DIT.WIDTH: np.array([[side]], dtype=np.int32),
                  DIT.NUM_INFERENCE_STEPS: np.array([[self.cfg.image_steps]], dtype=np.int32)}
        if req.seed is not None:
            inputs[DIT.SEED] = np.array([[req.seed]], dtype=np.int64)
        out = await self._infer("image_generator", inputs, [DIT.IMAGE], t)
        return bytes(np.asarray(out[DIT.IMAGE]).reshape(-1)[0])

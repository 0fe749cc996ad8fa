"""Speech for one omni request: the talker, then the audio decoder (orchestrator's event loop).

Flow, with the model family's SpeechFeed (omni_serve.families) saying what
each call carries:

    thinker (its responses gathered in `ThinkerRows`)
       |  once the feed says the talker can start: one talker request
       v
    talker (the family's own, on vLLM) --> codec codes, [frames, groups],
       |  streamed                         [--> CodecIds events]
       |  every `chunk_codes` frames: a chunk with the decoder's context
       v
    audio decoder (one call per chunk, `parallel_chunks` at once)
       --> PCM chunks to the client, in order

With `stream_audio` false the whole utterance goes to the decoder in one
call when the talker is done (exactly what transformers decodes).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from omni_serve import families
from omni_serve.audio.request import chunk_plan
from omni_serve.contract import AUDIO, LLM, TALKER
from omni_serve.families import DecoderChunk, SpeechFeed, ThinkerReply
from omni_serve.llm.hidden_states import remove_handed_over
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.events import AudioChunk, CodecIds, Event, Timings
from omni_serve.orchestrator.pace import ChunkSizes, SpeechPace
from omni_serve.orchestrator.request import OmniRequest


class ThinkerRows(ThinkerReply):
    """What the thinker sent so far, filled from its responses, read by the talker's feed."""

    def __init__(self, feed: SpeechFeed):
        super().__init__()
        self.feed = feed
        self.ready = asyncio.Event()  # the talker can start
        self.done = asyncio.Event()  # the thinker has finished

    def update(self, out: dict[str, np.ndarray]) -> None:
        if self.file is None:
            self.file = _file_of(out)
        ids = out.get(LLM.INPUT_TOKEN_IDS)
        if ids is not None and self.prompt_ids is None:
            self.prompt_ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        new = out.get(LLM.TOKEN_IDS)
        if new is not None:
            self.reply_ids.extend(int(i) for i in np.asarray(new).reshape(-1))
        count = out.get(LLM.NUM_OUTPUT_TOKENS)  # the reply tokens this response adds
        if count is not None:
            self.reply_tokens += int(np.asarray(count).reshape(-1)[0])
        if self.feed.talker_ready(self):
            self.ready.set()

    def finish(self) -> None:
        self.done.set()

    def remove(self) -> None:
        """Delete the handed-over file (the caller owns it) and its row count."""
        if self.file:
            remove_handed_over(self.file)


def remove_unread_file(out: dict[str, np.ndarray]) -> None:
    """A thinker response nobody read (the request was stopped): the file it hands over is
    this request's to delete, and nobody else knows its name."""
    path = _file_of(out)
    if path is not None:
        remove_handed_over(path)


def _file_of(out: dict[str, np.ndarray]) -> str | None:
    """The hidden-states file a thinker response hands over, if it names one."""
    path = out.get(LLM.HIDDEN_STATES_FILE)
    if path is None:
        return None
    value = np.asarray(path).reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


class StageCalls(Protocol):
    """The pipeline's stage calls (errors already name the stage)."""

    def stream(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
               request_id: str, timings: Timings) -> AsyncIterator[dict[str, np.ndarray]]: ...
    async def infer(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                    timings: Timings) -> dict[str, np.ndarray]: ...


class Speech:
    """Talker + decoder for one request; `run` emits its audio (and codec ids) in order."""

    def __init__(self, cfg: OrchestratorConfig, calls: StageCalls, req: OmniRequest,
                 media: dict[str, np.ndarray], emit: Callable[[Event], None], t: Timings,
                 pace: SpeechPace):
        self.cfg, self.calls, self.req, self.media, self.emit, self.t = cfg, calls, req, media, emit, t
        self.pace = pace  # the instance's: the first chunk sees every reply's decoder calls
        self.chunk_sizes = ChunkSizes(
            self.pace, least=cfg.min_first_chunk_codes or cfg.first_chunk_codes,
            most=cfg.first_chunk_codes, next_least=cfg.min_chunk_codes or cfg.chunk_codes,
            next_most=cfg.chunk_codes, right_context=cfg.right_context_codes,
            margin=cfg.first_chunk_margin, max_replies=cfg.first_chunk_pace_replies)
        self.feed = families.get(cfg.family).speech
        self.seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(7), "big")

    async def run(self, rows: ThinkerRows) -> None:
        with self.pace.speaking():  # from the thinker's start: a burst counts at once
            await self._run(rows)

    async def _run(self, rows: ThinkerRows) -> None:
        waits = [asyncio.ensure_future(rows.ready.wait()), asyncio.ensure_future(rows.done.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if not rows.ready.is_set():
            return  # the reply ended before the talker could start: nothing to voice
        self.t.audio_start = self.t.audio_start or time.perf_counter()
        self.t.step("talker_ready")
        if not self.req.stream_audio:
            frames = [f async for f in self._frames(rows)]
            if frames:
                self._emit_audio(await self._decode(
                    DecoderChunk(np.stack(frames), 0, 0, 0, len(frames))))
            return
        await self._pipelined(rows)

    async def _pipelined(self, rows: ThinkerRows) -> None:
        decoders = asyncio.Semaphore(self.cfg.parallel_chunks)
        pending: asyncio.Queue = asyncio.Queue()  # decode tasks in stream order, then None

        async def decode(chunk: DecoderChunk) -> AudioChunk:
            try:
                return await self._decode(chunk)
            finally:
                decoders.release()

        async def talk(tg: asyncio.TaskGroup) -> None:
            codes: list[np.ndarray] = []  # one [groups] frame each
            done = 0
            try:
                async with contextlib.aclosing(self._frames(rows)) as stream:
                    async for frame in stream:
                        codes.append(frame)
                        for chunk in self._plan(codes, done, final=False):
                            done = chunk.end
                            await decoders.acquire()
                            pending.put_nowait(tg.create_task(decode(chunk)))
                # a reply done before its first chunk could go (it and its right context
                # are longer than the reply): one call for all of it, as stream_audio false
                # does, rather than chunks that decode their contexts twice
                whole = [DecoderChunk(np.stack(codes), 0, 0, 0, len(codes))] if codes else []
                for chunk in whole if done == 0 else self._plan(codes, done, final=True):
                    await decoders.acquire()
                    pending.put_nowait(tg.create_task(decode(chunk)))
            finally:
                pending.put_nowait(None)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(talk(tg))
            while (task := await pending.get()) is not None:
                self._emit_audio(await task)

    async def _frames(self, rows: ThinkerRows) -> AsyncIterator[np.ndarray]:
        """The talker's frames ([groups] codes each) as they come; CodecIds events go out
        with them."""
        req = self.req
        sampling: dict[str, Any] = {**self.cfg.talker_sampling, **req.talker_sampling}
        sampling["seed"] = self.seed % 2**63
        inputs = self.feed.talker_inputs(rows, self.media, req.voice, sampling)
        groups = self.feed.codec_groups
        async with contextlib.aclosing(self.calls.stream(
                "talker", inputs, [TALKER.CODEC_IDS], f"{req.request_id}-talker", self.t)) as outs:
            async for out in outs:
                frames = out.get(TALKER.CODEC_IDS)
                if frames is None:
                    continue
                frames = np.asarray(frames, dtype=np.int64).reshape(-1, groups)
                if len(frames) and req.return_codec_ids:
                    self.emit(CodecIds(frames.astype(int).tolist()))
                for frame in frames:
                    yield frame

    def _plan(self, frames: list[np.ndarray], done: int, *, final: bool) -> list[DecoderChunk]:
        """The decoder chunks that `frames` allow now, past the first `done` frames."""
        cfg = self.cfg
        chunks = []
        while True:
            size = self.chunk_sizes.size(len(frames), done)
            spans = chunk_plan(len(frames), done, size, cfg.left_context_codes, final,
                               right_context=cfg.right_context_codes, align=cfg.align_codes)
            if not spans:
                return chunks
            span = spans[0]  # the size changes after the first chunk: plan again
            if done == 0:
                self.t.first_chunk_codes = span.end
            first = span.first
            chunks.append(DecoderChunk(np.stack(frames[first:span.last]), span.context,
                                       span.lookahead, first, span.end))
            done = span.end

    async def _decode(self, chunk: DecoderChunk) -> AudioChunk:
        inputs = self.feed.decoder_inputs(chunk, self.seed % 2**63, self.req.voice)
        sent = time.perf_counter()
        out = await self.calls.infer("audio_decoder", inputs,
                                     [AUDIO.AUDIO_CHUNK, AUDIO.SAMPLE_RATE], self.t)
        rate = int(np.asarray(out[AUDIO.SAMPLE_RATE]).reshape(-1)[0])
        pcm = np.asarray(out[AUDIO.AUDIO_CHUNK], dtype=np.float32).reshape(-1)
        voiced = len(chunk.frames) - chunk.context - chunk.lookahead
        self.pace.decoded(time.perf_counter() - sent, voiced, pcm.size / rate)
        return AudioChunk(pcm, rate)

    def _emit_audio(self, chunk: AudioChunk) -> None:
        now = time.perf_counter()
        self.t.first_audio = self.t.first_audio or now
        self.t.audio_end = now
        self.t.audio_seconds += chunk.pcm.size / chunk.sample_rate
        self.emit(chunk)
        self.t.step("audio_out")

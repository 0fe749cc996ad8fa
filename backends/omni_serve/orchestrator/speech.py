"""Speech for one omni request: the talker, then the audio decoder (orchestrator's event loop).

Flow (pipelined mode):

    thinker (hidden states kept in a /dev/shm file, `ThinkerRows`)
       |  once the reply has 2 tokens: one talker request naming that file
       v
    talker (Qwen2.5-Omni's own, on vLLM; reads each reply row as the thinker
            writes it) --> codec ids, streamed  [--> CodecIds events]
       |  every `chunk_codes` codes: a chunk with the DiT's context
       v
    audio decoder (Token2Wav, one call per chunk, `parallel_chunks` at once)
       --> PCM chunks to the client, in order

With `stream_audio` false the whole utterance goes to the decoder in one
call when the talker is done (exactly what transformers decodes). In
sequential mode (tools/bench_omni.py's baseline) the talker starts when the
thinker has finished and the decoder when the talker has.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from omni_serve.audio.request import chunk_plan
from omni_serve.contract import AUDIO, LLM, TALKER
from omni_serve.llm.hidden_states import remove_handed_over
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.events import AudioChunk, CodecIds, Event, Timings
from omni_serve.orchestrator.request import OmniRequest


@dataclass
class ThinkerRows:
    """Where the thinker's rows are: filled from its responses, read by the talker request."""

    file: str | None = None
    prompt_ids: list[int] | None = None
    reply_tokens: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # the talker can start
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the thinker has finished

    def update(self, out: dict[str, np.ndarray]) -> None:
        if self.file is None:
            self.file = _file_of(out)
        ids = out.get(LLM.INPUT_TOKEN_IDS)
        if ids is not None and self.prompt_ids is None:
            self.prompt_ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        count = out.get(LLM.NUM_OUTPUT_TOKENS)
        if count is not None:
            self.reply_tokens = int(np.asarray(count).reshape(-1)[0])
        # the talker's prefill needs reply token 0 fed back: a reply of 2 tokens
        if self.file and self.prompt_ids is not None and self.reply_tokens >= 2:
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


# the thinker inputs that keep its rows for the talker
THINKER_INPUTS = {
    LLM.RETURN_HIDDEN_STATES: np.array([True]),
    LLM.HIDDEN_STATES_IN_SHM: np.array([True]),
    LLM.RETURN_INPUT_TOKEN_IDS: np.array([True]),
}
THINKER_OUTPUTS = (LLM.HIDDEN_STATES_FILE, LLM.HIDDEN_STATES_ROWS, LLM.INPUT_TOKEN_IDS)


class StageCalls(Protocol):
    """The pipeline's stage calls (errors already name the stage)."""

    def stream(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
               request_id: str, timings: Timings) -> AsyncIterator[dict[str, np.ndarray]]: ...
    async def infer(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                    timings: Timings) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Chunk:
    """One decoder request: `codes` = left context + the codes voiced + right context."""

    codes: list[int]
    context: int
    lookahead: int
    offset: int  # stream position of codes[0]
    end: int  # stream position after the last code voiced


class Speech:
    """Talker + decoder for one request; `run` emits its audio (and codec ids) in order."""

    def __init__(self, cfg: OrchestratorConfig, calls: StageCalls, req: OmniRequest,
                 media: dict[str, np.ndarray], emit: Callable[[Event], None], t: Timings):
        self.cfg, self.calls, self.req, self.media, self.emit, self.t = cfg, calls, req, media, emit, t
        self.seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(7), "big")

    async def run(self, rows: ThinkerRows) -> None:
        waits = [asyncio.ensure_future(rows.ready.wait()), asyncio.ensure_future(rows.done.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if not rows.ready.is_set():
            return  # a reply of fewer than 2 tokens: nothing the talker can voice
        if self.cfg.mode == "sequential":
            await rows.done.wait()
        self.t.audio_start = self.t.audio_start or time.perf_counter()
        if self.cfg.mode == "sequential" or not self.req.stream_audio:
            codes = [c async for c in self._codes(rows)]
            if self.cfg.mode == "sequential" and self.req.stream_audio:
                for chunk in self._plan(codes, 0, final=True):
                    self._emit_audio(await self._decode(chunk))
            elif codes:
                self._emit_audio(await self._decode(Chunk(codes, 0, 0, 0, len(codes))))
            return
        await self._pipelined(rows)

    async def _pipelined(self, rows: ThinkerRows) -> None:
        decoders = asyncio.Semaphore(self.cfg.parallel_chunks)
        pending: asyncio.Queue = asyncio.Queue()  # decode tasks in stream order, then None

        async def decode(chunk: Chunk) -> AudioChunk:
            try:
                return await self._decode(chunk)
            finally:
                decoders.release()

        async def talk(tg: asyncio.TaskGroup) -> None:
            codes: list[int] = []
            done = 0
            try:
                async with contextlib.aclosing(self._codes(rows)) as stream:
                    async for code in stream:
                        codes.append(code)
                        for chunk in self._plan(codes, done, final=False):
                            done = chunk.end
                            await decoders.acquire()
                            pending.put_nowait(tg.create_task(decode(chunk)))
                for chunk in self._plan(codes, done, final=True):
                    await decoders.acquire()
                    pending.put_nowait(tg.create_task(decode(chunk)))
            finally:
                pending.put_nowait(None)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(talk(tg))
            while (task := await pending.get()) is not None:
                self._emit_audio(await task)

    async def _codes(self, rows: ThinkerRows) -> AsyncIterator[int]:
        """The talker's codec ids as they come (CodecIds events go out with them)."""
        req = self.req
        sampling: dict[str, Any] = {**self.cfg.talker_sampling, **req.talker_sampling}
        sampling["seed"] = self.seed % 2**63
        inputs = {
            TALKER.THINKER_HIDDEN_STATES_FILE: np.array([rows.file.encode()], dtype=np.object_),
            TALKER.PROMPT_TOKEN_IDS: np.array(rows.prompt_ids, dtype=np.int64),
            TALKER.SAMPLING_PARAMETERS: np.array([json.dumps(sampling).encode()], dtype=np.object_),
        }
        for name in (TALKER.IMAGE_GRID_THW, TALKER.AUDIO_FEATURE_LENGTHS):
            if name in self.media:
                inputs[name] = self.media[name]
        if req.speaker:
            inputs[TALKER.SPEAKER] = np.array([req.speaker.encode()], dtype=np.object_)
        async with contextlib.aclosing(self.calls.stream(
                "talker", inputs, [TALKER.CODEC_IDS], f"{req.request_id}-talker", self.t)) as outs:
            async for out in outs:
                frames = out.get(TALKER.CODEC_IDS)
                if frames is None:
                    continue
                # [frames, groups]; one group (Qwen2.5-Omni): one code a frame
                new = [int(i) for i in np.asarray(frames).reshape(-1)]
                if new and req.return_codec_ids:
                    self.emit(CodecIds(new))
                for code in new:
                    yield code

    def _plan(self, codes: list[int], done: int, *, final: bool) -> list[Chunk]:
        """The decoder chunks that `codes` allow now, past the first `done` codes."""
        cfg = self.cfg
        chunks = []
        while True:
            size = cfg.first_chunk_codes if done == 0 else cfg.chunk_codes
            spans = chunk_plan(len(codes), done, size, cfg.left_context_codes, final,
                               right_context=cfg.right_context_codes, align=cfg.align_codes)
            if not spans:
                return chunks
            span = spans[0]  # the size changes after the first chunk: plan again
            first = span.first
            chunks.append(Chunk(codes[first:span.last], span.context, span.lookahead, first,
                                span.end))
            done = span.end

    async def _decode(self, chunk: Chunk) -> AudioChunk:
        inputs = {AUDIO.CODEC_TOKENS: np.array([chunk.codes], dtype=np.int64),
                  AUDIO.CONTEXT_TOKENS: np.array([[chunk.context]], dtype=np.int32),
                  AUDIO.LOOKAHEAD_TOKENS: np.array([[chunk.lookahead]], dtype=np.int32),
                  AUDIO.CODE_OFFSET: np.array([[chunk.offset]], dtype=np.int64),
                  AUDIO.SEED: np.array([[self.seed % 2**63]], dtype=np.int64)}
        if self.req.speaker:
            inputs[AUDIO.SPEAKER] = np.array([[self.req.speaker.encode()]], dtype=np.object_)
        out = await self.calls.infer("audio_decoder", inputs,
                                     [AUDIO.AUDIO_CHUNK, AUDIO.SAMPLE_RATE], self.t)
        rate = int(np.asarray(out[AUDIO.SAMPLE_RATE]).reshape(-1)[0])
        return AudioChunk(np.asarray(out[AUDIO.AUDIO_CHUNK], dtype=np.float32).reshape(-1), rate)

    def _emit_audio(self, chunk: AudioChunk) -> None:
        now = time.perf_counter()
        self.t.first_audio = self.t.first_audio or now
        self.t.audio_end = now
        self.t.audio_seconds += chunk.pcm.size / chunk.sample_rate
        self.emit(chunk)

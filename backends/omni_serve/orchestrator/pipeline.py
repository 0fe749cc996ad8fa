"""The omni pipeline's stage graph for one request (runs on the orchestrator's event loop).

Flow of one request (pipelined mode):

    media --> image/audio encoders (concurrently) --> image rows, audio features
    text + media --> thinker (streamed) --> text deltas to the client
                       |  its hidden states, in a /dev/shm file (speech only)
                       v
                    speech (orchestrator/speech.py): the family's talker reads
                    them as they are written; the codec decoder voices its
                    frames chunk by chunk --> PCM chunks to the client
    whole reply --> image generator (when "image" is asked for) --> PNG

The talker starts on the thinker's first two reply tokens and the decoder on
the talker's first codes, so the first audio comes long before the text is
finished (`omni-bench pipelining` measures this against running each stage to its
end: omni_tools.bench.stage_by_stage).

Stages are reached through a `StageClient` (Triton gRPC by default; anything
with the same two calls in tests). A failing stage ends the request with a
StageFailedError naming it; cancelling the task cancels every child stream.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from omni_serve import families
from omni_serve.contract import DIT, ENCODER, LLM, OMNI, TALKER
from omni_serve.errors import RequestError, StageFailedError, is_overloaded
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.events import (  # noqa: F401  (re-exported for the adapter)
    AudioChunk,
    CodecIds,
    Event,
    Final,
    ImageOut,
    TextDelta,
    Timings,
)
from omni_serve.orchestrator.pace import SpeechPace
from omni_serve.orchestrator.prompt import ChatPrompt, Media
from omni_serve.orchestrator.request import OmniRequest
from omni_serve.orchestrator.routing import SESSION_ID, EngineRouter
from omni_serve.orchestrator.speech import Speech, ThinkerRows, remove_unread_file

log = logging.getLogger(__name__)

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


def _joined(*found: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Media shapes of several items, each name's rows in order."""
    out: dict[str, np.ndarray] = {}
    for shapes in found:
        for name, value in shapes.items():
            out[name] = np.concatenate([out[name], value]) if name in out else value
    return out


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
               request_id: str, timeout_s: float,
               unread: Callable[[dict[str, np.ndarray]], None] | None = None,
               ) -> AsyncIterator[dict[str, np.ndarray]]:
        """The request's responses; `unread` is called with each one the consumer did not
        read because it stopped early (what they hold is the caller's to free)."""


def _bytes_tensor(value: str | bytes) -> np.ndarray:
    data = value.encode("utf-8") if isinstance(value, str) else value
    return np.array([data], dtype=np.object_)


def _first(arr: np.ndarray | None, default: Any = None) -> Any:
    if arr is None or np.asarray(arr).size == 0:
        return default
    value = np.asarray(arr).reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


class OmniPipeline:
    """Runs requests through the stages named in `cfg.stages`."""

    def __init__(self, cfg: OrchestratorConfig, client: StageClient, prompt: ChatPrompt):
        self.cfg = cfg
        self.client = client
        # the model family's speech feed: what the thinker returns for the talker, and how
        # the talker and the decoder are called (omni_serve.families)
        self.speech = families.get(cfg.family).speech
        # the thinker's chat template and tokenizer
        self.prompt = prompt
        # which thinker engine serves a request (session affinity, else least busy)
        self.thinkers = EngineRouter(cfg.stages.thinkers, retry_after_s=cfg.engine_retry_after_s)
        # the shapes of raw media, for the talker's positions (loaded on first use)
        self._raw_media_shapes: Any = None
        # how fast this instance's decoder calls go: sizes streamed replies' first chunks
        self.pace = SpeechPace()

    # --- stage calls with the stage's name on every error ---------------------------
    async def _infer(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                     timings: Timings) -> dict[str, np.ndarray]:
        model = getattr(self.cfg.stages, role)
        t0 = time.perf_counter()
        call = timings.call(role)
        try:
            async with asyncio.timeout(self.cfg.stage_timeout_s):  # not wait_for: see grpc_stream
                out = await self.client.infer(model, inputs, outputs)
            call.response()
            return out
        except StageCallError as e:
            raise StageFailedError(role, model, e.message, e.code) from e
        except TimeoutError as e:
            raise StageFailedError(role, model, f"no answer within {self.cfg.stage_timeout_s:g} s",
                                   "UNAVAILABLE") from e
        finally:
            timings.add(role, time.perf_counter() - t0)

    async def _stream(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                      request_id: str, timings: Timings, model: str | None = None,
                      unread: Callable[[dict[str, np.ndarray]], None] | None = None,
                      ) -> AsyncIterator[dict[str, np.ndarray]]:
        model = model or getattr(self.cfg.stages, role)
        t0 = time.perf_counter()
        call = timings.call(role)
        try:
            # aclosing here and around every stage stream below: a stream whose consumer
            # stops is closed at once (the gRPC call cancelled), not when it is collected
            async with contextlib.aclosing(self.client.stream(
                    model, inputs, outputs, request_id=request_id,
                    timeout_s=self.cfg.stage_timeout_s, unread=unread)) as responses:
                async for out in responses:
                    call.response()
                    yield out
        except StageCallError as e:
            raise StageFailedError(role, model, e.message, e.code) from e
        finally:
            timings.add(role, time.perf_counter() - t0)

    # --- the request -----------------------------------------------------------------
    async def run(self, req: OmniRequest, emit: Callable[[Event], None],
                  received: float | None = None) -> None:
        """Run one request, emitting events; raises on failure (the caller reports it).
        `received`: when the request reached the orchestrator (time.perf_counter), the start
        of its timings (default: now)."""
        SESSION_ID.set(req.session_id)  # a stage server's replicas keep a session on one
        t = Timings(timeline=req.return_timeline)
        if received is not None:
            t.start = received
            t.step("task_started")
        rows = ThinkerRows(self.speech) if req.wants_audio else None
        media: dict[str, np.ndarray] = {}
        shapes: dict[str, np.ndarray] = {}  # of raw media, for the talker
        prompt = reply_ids = None
        if req.task == "speech":
            prompt_part, reply_ids = await self._read_aloud_prompt(req)
            rows.prompt_ids = prompt_part  # the talker's prompt ends where the text starts
            t.prompt_tokens = len(reply_ids) - len(prompt_part)  # the text's tokens
        else:
            media, prompt, shapes = await self._encode(req, t)
        speech = rows is not None
        try:
            # one task group: a failing talker or decoder cancels the thinker and back
            async with asyncio.TaskGroup() as tg:
                think = tg.create_task(self._think(req, prompt, media, emit, rows, t, reply_ids))
                if speech:
                    tg.create_task(Speech(self.cfg, self, req, {**media, **shapes}, emit,
                                          t, self.pace).run(rows))
        except ExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            if rows is not None:  # the talker is done with the thinker's rows
                rows.remove()
        reply, finish = think.result()
        if "image" in req.modalities:
            emit(ImageOut(await self._draw(req, reply, t)))
        emit(Final(finish, t.report()))

    # the speech path's stage calls (speech.StageCalls)
    def stream(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
               request_id: str, timings: Timings) -> AsyncIterator[dict[str, np.ndarray]]:
        return self._stream(role, inputs, outputs, request_id, timings)

    async def infer(self, role: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                    timings: Timings) -> dict[str, np.ndarray]:
        return await self._infer(role, inputs, outputs, timings)

    # --- encoders --------------------------------------------------------------------
    async def _encode(self, req: OmniRequest, t: Timings
                      ) -> tuple[dict[str, np.ndarray], str, dict[str, np.ndarray]]:
        """The encoders' outputs as thinker inputs, the prompt with one placeholder each,
        and, for speech, the shapes of the media the thinker takes raw. Audio is every clip
        of the conversation in prompt order (`history`'s, then the request's), each encoded
        alone (or sent as its file), their features / lengths / shapes in that order.

        A modality the family's thinker takes raw (`raw_media`) goes to it as the file:
        an image as base64 (the `image` input vllm_backend defined), audio and video as
        bytes (a video's header is checked here first, so a bad clip fails before any
        stage). Its talker's positions need the media's shapes, which the family's
        `raw_media_shapes` reads from the same file (in a thread: the checkpoint's processor
        runs there). vLLM's processor cannot take one prompt's media partly precomputed
        and partly raw: beside a raw one (a video), every medium of a request goes raw.
        """
        jobs, roles, shape_jobs = [], [], []
        media: dict[str, np.ndarray] = {}
        kinds: list[Media] = []
        clips = req.audio_clips  # the history's, then this turn's: the prompt's order
        sent = {"audio": clips or None, "image": req.image, "video": req.video}
        all_raw = any(data is not None and kind in self.cfg.raw_media
                      for kind, data in sent.items())
        for role, kind, items, outputs in (
                ("audio_encoder", "audio", clips, [ENCODER.FEATURES]),
                ("image_encoder", "image", [] if req.image is None else [req.image],
                 [ENCODER.EMBEDDINGS, ENCODER.GRID_THW])):
            if not items:
                continue
            if kind == "image" or req.audio is not None:
                kinds.append(kind)  # this turn's placeholders: audio, then image
            if all_raw:
                raw = [base64.b64encode(data) if kind == "image" else data for data in items]
                media[LLM.IMAGE if kind == "image" else LLM.AUDIO] = np.array(raw,
                                                                              dtype=np.object_)
                if req.wants_audio:
                    shape_jobs += [asyncio.to_thread(self._raw_shapes, kind, d) for d in items]
                continue
            jobs += [self._infer(role, {ENCODER.MEDIA: np.array([[data]], dtype=np.object_)},
                                 outputs, t) for data in items]
            roles += [role] * len(items)
        heard = []  # each clip's features [mel bins, frames]
        for role, out in zip(roles, await asyncio.gather(*jobs)):
            if role == "audio_encoder":
                features = np.asarray(out[ENCODER.FEATURES], dtype=np.float32)
                heard.append(features.reshape(features.shape[-2], features.shape[-1]))
            else:
                rows = np.asarray(out[ENCODER.EMBEDDINGS], dtype=np.float32)
                media[LLM.IMAGE_EMBEDS] = rows.reshape(-1, rows.shape[-1])
                media[LLM.IMAGE_GRID_THW] = np.asarray(out[ENCODER.GRID_THW],
                                                       dtype=np.int64).reshape(1, 3)
        if heard:
            media[LLM.AUDIO_FEATURES] = np.concatenate(heard, axis=1)
            media[LLM.AUDIO_FEATURE_LENGTHS] = np.array([f.shape[1] for f in heard],
                                                        dtype=np.int64)
        video_shapes: dict[str, np.ndarray] = {}
        if req.video is not None:  # a raw-media family's (request parsing refused others)
            video_shapes, has_sound = await asyncio.to_thread(self._check_video, req.video)
            kinds.append("video")
            media[LLM.VIDEO] = np.array([req.video], dtype=np.object_)
            if await asyncio.to_thread(self._hears_soundtrack, req, has_sound):
                media[LLM.USE_AUDIO_IN_VIDEO] = np.array([True])
                if req.wants_audio:  # the talker's positions interleave the sound too
                    video_shapes[TALKER.USE_AUDIO_IN_VIDEO] = np.array([True])
                    video_shapes.update(await asyncio.to_thread(self._soundtrack_shapes,
                                                                req.video))
        prompt = self.prompt.render(self.cfg.system_prompt, req.text, kinds, req.history)
        shapes = _joined(*await asyncio.gather(*shape_jobs))
        if req.wants_audio:
            shapes = _joined(shapes, video_shapes)  # a soundtrack's length after the clips'
        return media, prompt, shapes

    def _check_video(self, data: bytes) -> tuple[dict[str, np.ndarray], bool]:
        """RequestError("video", ...) for a clip the thinker would refuse, from its header alone
        (the thinker decodes its frames; one cut short inside them is refused there); else
        what the talker's positions need of it: the processor's grid of the frames the
        family samples, and the seconds a temporal grid step stands for; and whether the
        file has sound."""
        from omni_serve.encoder.video import probe_video

        sampling = families.get(self.cfg.family).video
        header = probe_video(data, self.cfg.clip_limits, sampling)
        return {TALKER.VIDEO_GRID_THW: np.array([header.grid_thw(sampling)], dtype=np.int64),
                TALKER.VIDEO_SECOND_PER_GRID: np.array([sampling.seconds_per_grid],
                                                       dtype=np.float32)}, header.has_audio

    def _hears_soundtrack(self, req: OmniRequest, has_sound: bool) -> bool:
        """Whether the thinker hears the clip's sound: the request's use_audio_in_video, else
        the checkpoint processor's default (then only for a clip with sound and no separate
        audio). RequestError naming the flag for a clip without sound when it is true."""
        if req.use_audio_in_video is None:
            if not has_sound or req.audio is not None:
                return False
            reader = self._shapes_reader()
            return reader is not None and reader.use_audio_in_video()
        if req.use_audio_in_video and not has_sound:
            raise RequestError(OMNI.USE_AUDIO_IN_VIDEO, "is true but the video has no audio "
                                                        "stream to hear; send a clip with sound, "
                                                        "or the flag false")
        return req.use_audio_in_video

    def _soundtrack_shapes(self, data: bytes) -> dict[str, np.ndarray]:
        """{audio_feature_lengths} of the clip's soundtrack, for the talker's positions."""
        reader = self._shapes_reader()
        if reader is None:
            return {}
        shapes = reader.soundtrack_lengths(data)
        return {TALKER.AUDIO_FEATURE_LENGTHS: shapes[LLM.AUDIO_FEATURE_LENGTHS]}

    def _shapes_reader(self) -> Any:
        """The family's raw media shapes reader (its checkpoint processor), loaded once; None
        for a family without one."""
        family = families.get(self.cfg.family)
        if family.raw_media_shapes is None:
            return None
        if self._raw_media_shapes is None:
            self._raw_media_shapes = families.load(family.raw_media_shapes)(
                self.cfg.tokenizer, self.cfg.video_limits)
        return self._raw_media_shapes

    def _raw_shapes(self, kind: str, data: bytes) -> dict[str, np.ndarray]:
        """{image_grid_thw} / {audio_feature_lengths} of a raw media file ({} for a family
        without raw media shapes)."""
        reader = self._shapes_reader()
        if reader is None:
            return {}
        try:
            return reader.shapes(kind, data)
        except RequestError as e:  # the encoder's field name: the request's is the modality
            raise RequestError(kind, e.message) from None

    # --- thinker ---------------------------------------------------------------------
    async def _think(self, req: OmniRequest, prompt: str | None, media: dict[str, np.ndarray],
                     emit: Callable[[Event], None], rows: ThinkerRows | None, t: Timings,
                     prompt_ids: list[int] | None = None) -> tuple[str, str]:
        """The thinker's reply (streamed out as text deltas) and its finish reason.

        With speech, its rows stay in a /dev/shm file (`rows`) for the talker;
        with `prompt_ids` (reading aloud) the prompt is those ids and nothing is
        generated: the text to read is already their last part.
        """
        sampling = {**self.cfg.thinker_sampling, **req.sampling}
        if prompt_ids is not None:
            sampling = {"max_tokens": 1, "temperature": 0.0}
        inputs = {
            LLM.STREAM: np.array([True]),
            LLM.SAMPLING_PARAMETERS: _bytes_tensor(json.dumps(sampling)),
            LLM.RETURN_FINISH_REASON: np.array([True]),
            LLM.RETURN_NUM_INPUT_TOKENS: np.array([True]),
            LLM.RETURN_NUM_OUTPUT_TOKENS: np.array([True]),
        }
        if prompt_ids is not None:
            inputs[LLM.PROMPT_TOKEN_IDS] = np.array(prompt_ids, dtype=np.int64)
        else:
            inputs[LLM.TEXT_INPUT] = _bytes_tensor(prompt)
        if rows is not None:
            inputs.update(self.speech.thinker_inputs)
        inputs.update(media)
        text: list[str] = []
        finish = ""
        try:
            async with contextlib.aclosing(self._thinker_stream(req, inputs, t)) as responses:
                async for out in responses:
                    if prompt_ids is None:  # reading aloud, usage counts the text (run)
                        t.prompt_tokens = int(_first(out.get(LLM.NUM_INPUT_TOKENS),
                                                     t.prompt_tokens))
                        # streamed: each response carries the reply tokens it adds
                        t.completion_tokens += int(_first(out.get(LLM.NUM_OUTPUT_TOKENS), 0))
                    finish = _first(out.get(LLM.FINISH_REASON), "") or finish
                    if rows is not None:
                        if prompt_ids is not None:  # the text's own tokens are the reply
                            out = {**out, LLM.NUM_OUTPUT_TOKENS: np.array([2])}
                        rows.update(out)
                    if prompt_ids is not None:
                        continue
                    delta = _first(out.get(LLM.TEXT_OUTPUT), "")
                    if delta:
                        if t.first_text is None:
                            t.first_text = time.perf_counter()
                        text.append(delta)
                        emit(TextDelta(delta))
        finally:
            if rows is not None:
                rows.finish()
        if prompt_ids is not None:
            return req.text, "stop"
        return "".join(text), finish

    async def _thinker_stream(self, req: OmniRequest, inputs: dict[str, np.ndarray],
                              t: Timings) -> AsyncIterator[dict[str, np.ndarray]]:
        """The thinker's responses, from the engine the router picks.

        An engine that fails UNAVAILABLE before its first response is marked
        down and the request goes to the next engine (nothing was emitted
        yet); once it has answered, its failures end the request.
        """
        outputs = [LLM.TEXT_OUTPUT, LLM.FINISH_REASON, LLM.NUM_INPUT_TOKENS,
                   LLM.NUM_OUTPUT_TOKENS, *(self.speech.thinker_outputs if self.speech else ())]
        tried: list[str] = []
        while True:
            with self.thinkers.route(req.session_id, exclude=tried) as engine:
                t.thinker_model = engine
                answered = False
                try:
                    async with contextlib.aclosing(self._stream(
                            "thinker", inputs, outputs, f"{req.request_id}-thinker", t,
                            model=engine, unread=remove_unread_file)) as responses:
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
                    overloaded = is_overloaded(str(e))  # busy, not down: keep routing to it
                    if not overloaded:
                        self.thinkers.mark_down(engine)
                    if len(tried) == len(self.thinkers.engines):
                        raise
                    t.passed_over.append(engine)
                    log.warning("%s; %s, request %s goes to the next engine", e,
                                "it is full" if overloaded else
                                f"passing it over for {self.thinkers.retry_after_s:g} s",
                                req.request_id)

    # --- reading text aloud (task "speech") ---------------------------------------------
    async def _read_aloud_prompt(self, req: OmniRequest) -> tuple[list[int], list[int]]:
        """(chat prompt ids, those + the text's ids): the thinker's prompt for voicing
        `req.text` itself, a chat turn whose reply is the text, so the talker reads it
        as if the thinker had written it."""
        prompt = self.prompt.encode(self.prompt.render(self.cfg.system_prompt, req.text))
        return prompt, prompt + self.prompt.encode(req.text)

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

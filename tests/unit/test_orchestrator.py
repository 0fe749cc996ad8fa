"""The omni orchestrator's stage graph, driven with a scripted StageClient (no Triton)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from omni_serve.contract import AUDIO, DIT, ENCODER, LLM, OMNI
from omni_serve.errors import RequestError, StageFailedError
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.pipeline import (
    AudioChunk,
    Final,
    ImageOut,
    OmniPipeline,
    StageCallError,
    TextDelta,
)
from omni_serve.orchestrator.request import parse_request

CODEC = {"offset": 1000, "size": 64, "bos": 1064, "eos": 1065}
SAMPLES_PER_CODE = 10
MEL_BINS = 128
HIDDEN = 4


def config(**overrides) -> OrchestratorConfig:
    base = {
        "stages": {"thinker": "llm", "talker": "talker", "image_encoder": "ienc",
                   "audio_encoder": "aenc", "audio_decoder": "dec", "image_generator": "dit"},
        "codec": CODEC, "first_segment_tokens": 4, "segment_tokens": 6,
        "first_chunk_codes": 3, "chunk_codes": 5, "left_context_codes": 2,
        "right_context_codes": 2, "align_codes": 2,
        "talker_codes_per_token": 2.0, "talker_min_codes": 4, "stage_timeout_s": 2.0,
    }
    base.update(overrides)
    return OrchestratorConfig.model_validate(base)


class ScriptedStages:
    """A StageClient whose stages answer from rules; it records every call."""

    def __init__(self, *, reply_tokens: int = 20, token_delay: float = 0.01,
                 fail: str | None = None, hang: str | None = None):
        self.reply_tokens = reply_tokens
        self.token_delay = token_delay
        self.fail = fail
        self.hang = hang
        self.calls: list[tuple[str, dict]] = []
        self.open_streams: set[str] = set()
        self.closed_early: list[str] = []
        self.decoded: list[tuple[list[int], int]] = []
        self.thinker_done_at: int | None = None
        self.log: list[str] = []

    async def infer(self, model, inputs, outputs):
        self.calls.append((model, inputs))
        if model == self.fail:
            raise StageCallError("INVALID_ARG", f"{model} refuses")
        if model == self.hang:
            await asyncio.sleep(3600)
        if model == "ienc":  # a grid of (1, 2, 2 * rows) patches: `rows` rows after 2x2 merging
            rows = 2 + len(bytes(inputs[ENCODER.MEDIA].reshape(-1)[0])) % 3
            return {ENCODER.EMBEDDINGS: np.full((1, rows, HIDDEN), 0.5, np.float32),
                    ENCODER.GRID_THW: np.array([[1, 2, 2 * rows]], np.int64)}
        if model == "aenc":
            frames = 20 + len(bytes(inputs[ENCODER.MEDIA].reshape(-1)[0]))
            return {ENCODER.FEATURES: np.full((1, MEL_BINS, frames), 0.25, np.float32)}
        if model == "dec":
            codes = inputs[AUDIO.CODEC_TOKENS].reshape(-1).tolist()
            context = int(inputs[AUDIO.CONTEXT_TOKENS].reshape(-1)[0])
            lookahead = int(inputs[AUDIO.LOOKAHEAD_TOKENS].reshape(-1)[0])
            offset = int(inputs[AUDIO.CODE_OFFSET].reshape(-1)[0])
            seed = int(inputs[AUDIO.SEED].reshape(-1)[0])
            self.decoded.append((codes, context, lookahead, offset, seed))
            self.log.append("audio")
            await asyncio.sleep(0.03 if offset + context == 0 else 0.001)  # out-of-order finishes
            n = (len(codes) - context - lookahead) * SAMPLES_PER_CODE
            marks = [seed * 10000 + offset + context + i // SAMPLES_PER_CODE for i in range(n)]
            return {AUDIO.AUDIO_CHUNK: np.array([marks], np.float32),
                    AUDIO.SAMPLE_RATE: np.array([[100]], np.int32)}
        if model == "dit":
            return {DIT.IMAGE: np.array([[b"\x89PNG fake"]], dtype=np.object_)}
        raise AssertionError(model)

    async def stream(self, model, inputs, outputs, *, request_id, timeout_s):
        self.calls.append((model, inputs))
        self.open_streams.add(request_id)
        talking = sum("talker" in r for r in self.open_streams)
        self.max_talking = max(getattr(self, "max_talking", 0), talking)
        finished = False
        try:
            if model == self.fail:
                raise StageCallError("INVALID_ARG", f"{model} refuses")
            if model == self.hang:
                await asyncio.sleep(3600)
            if model == "llm":
                prompt = inputs[LLM.TEXT_INPUT][0].decode()
                # one placeholder per item; the engine expands it
                assert prompt.count("<|IMAGE|>") == (LLM.IMAGE_EMBEDS in inputs)
                assert prompt.count("<|AUDIO|>") == (LLM.AUDIO_FEATURES in inputs)
                for i in range(self.reply_tokens):
                    await asyncio.sleep(self.token_delay)
                    last = i == self.reply_tokens - 1
                    self.log.append("text")
                    yield {LLM.TEXT_OUTPUT: np.array([f"w{i} ".encode()], dtype=np.object_),
                           LLM.TOKEN_IDS: np.array([10 + i], np.int64),
                           LLM.FINISH_REASON: np.array([b"length" if last else b""], dtype=np.object_)}
                self.thinker_done_at = len(self.log)
            elif model == "talker":
                ids = inputs[LLM.PROMPT_TOKEN_IDS].tolist()
                assert ids[-1] == CODEC["bos"]
                sampling = json.loads(inputs[LLM.SAMPLING_PARAMETERS][0])
                for i in range(sampling["max_tokens"]):
                    await asyncio.sleep(0.005)
                    yield {LLM.TOKEN_IDS: np.array([CODEC["offset"] + (i % CODEC["size"])], np.int64)}
            finished = True
        finally:
            self.open_streams.discard(request_id)
            if not finished:
                self.closed_early.append(model)


def run(pipeline: OmniPipeline, tensors: dict, cfg: OrchestratorConfig) -> list:
    events: list = []
    req = parse_request("r1", tensors, cfg)
    asyncio.run(pipeline.run(req, events.append))
    return events


def tensors(text="hello", **extra) -> dict:
    out = {OMNI.TEXT_INPUT: np.array([text.encode()], dtype=np.object_)}
    for key, value in extra.items():
        if key == OMNI.MODALITIES:
            out[key] = np.array([m.encode() for m in value], dtype=np.object_)
        else:
            out[key] = np.array([value], dtype=np.object_)
    return out


def test_text_only_never_calls_the_speech_stages():
    cfg = config()
    stages = ScriptedStages(reply_tokens=5)
    events = run(OmniPipeline(cfg, stages), tensors(), cfg)
    assert [m for m, _ in stages.calls] == ["llm"]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "w0 w1 w2 w3 w4 "
    assert isinstance(events[-1], Final) and events[-1].finish_reason == "length"
    assert events[-1].metrics["time_to_first_token_s"] > 0
    assert events[-1].metrics["time_to_first_audio_s"] is None


def test_speech_starts_before_the_text_is_finished_when_pipelined():
    cfg = config()
    stages = ScriptedStages(reply_tokens=20, token_delay=0.02)
    events = run(OmniPipeline(cfg, stages), tensors(modalities=["text", "audio"]), cfg)
    assert "audio" in stages.log[:stages.thinker_done_at]
    chunks = [e for e in events if isinstance(e, AudioChunk)]
    metrics = events[-1].metrics
    assert chunks and metrics["time_to_first_audio_s"] < metrics["total_s"]
    assert metrics["audio_seconds"] == pytest.approx(
        sum(c.pcm.size for c in chunks) / 100)
    assert set(metrics["stage_seconds"]) == {"thinker", "talker", "audio_decoder"}


def test_sequential_mode_voices_nothing_before_the_thinker_ends():
    cfg = config(mode="sequential")
    stages = ScriptedStages(reply_tokens=12)
    events = run(OmniPipeline(cfg, stages), tensors(modalities=["audio"]), cfg)
    assert "audio" not in stages.log[:stages.thinker_done_at]
    assert any(isinstance(e, AudioChunk) for e in events)


@pytest.mark.parametrize("mode", ["pipelined", "sequential"])
def test_every_codec_code_is_voiced_once_and_in_order(mode):
    cfg = config(mode=mode)
    stages = ScriptedStages(reply_tokens=11)
    events = run(OmniPipeline(cfg, stages), tensors(modalities=["audio"], seed=5), cfg)
    talker_calls = [i for m, i in stages.calls if m == "talker"]
    # segments of 4, then 6, then the rest (1): max_tokens = max(4, 2 * len)
    assert [len(i[LLM.PROMPT_TOKEN_IDS]) - 1 for i in talker_calls] == [4, 6, 1]
    per_segment = [json.loads(i[LLM.SAMPLING_PARAMETERS][0])["max_tokens"] for i in talker_calls]
    for codes, context, lookahead, offset, _ in stages.decoded:
        assert 0 <= context <= cfg.left_context_codes + cfg.align_codes
        assert lookahead <= cfg.right_context_codes
    # the audio comes out in order: segment by segment (one noise seed each), code by code
    pcm = np.concatenate([e.pcm for e in events if isinstance(e, AudioChunk)])
    marks = pcm[::SAMPLES_PER_CODE].astype(np.int64)
    want = [(5 + seg) * 10000 + pos for seg, n in enumerate(per_segment) for pos in range(n)]
    assert marks.tolist() == want
    first_codes, first_context, first_lookahead, _, _ = stages.decoded[0]
    assert first_context == 0 and len(first_codes) - first_lookahead == cfg.first_chunk_codes


def test_pipelined_segments_talk_concurrently_and_sequential_ones_do_not():
    for mode, overlap in (("pipelined", True), ("sequential", False)):
        cfg = config(mode=mode, first_segment_tokens=2, segment_tokens=2)
        stages = ScriptedStages(reply_tokens=12, token_delay=0.001)
        run(OmniPipeline(cfg, stages), tensors(modalities=["audio"]), cfg)
        assert (stages.max_talking > 1) is overlap, mode


def test_the_encoders_outputs_go_to_the_thinker_with_one_placeholder_each():
    cfg = config()
    stages = ScriptedStages(reply_tokens=2)
    run(OmniPipeline(cfg, stages), tensors(image=b"img-bytes", audio=b"wav"), cfg)
    models = [m for m, _ in stages.calls]
    assert sorted(models[:2]) == ["aenc", "ienc"] and models[2] == "llm"
    thinker = stages.calls[2][1]
    prompt = thinker[LLM.TEXT_INPUT][0].decode()
    assert prompt.index("<|audio_bos|><|AUDIO|><|audio_eos|>") \
        < prompt.index("<|vision_bos|><|IMAGE|><|vision_eos|>") < prompt.index("hello")
    rows = 2 + len(b"img-bytes") % 3
    assert thinker[LLM.IMAGE_EMBEDS].shape == (rows, HIDDEN)
    assert thinker[LLM.IMAGE_GRID_THW].tolist() == [[1, 2, 2 * rows]]
    assert thinker[LLM.AUDIO_FEATURES].shape == (MEL_BINS, 20 + len(b"wav"))
    assert thinker[LLM.AUDIO_FEATURE_LENGTHS].tolist() == [20 + len(b"wav")]


def test_image_output_uses_the_reply_as_the_prompt():
    cfg = config()
    stages = ScriptedStages(reply_tokens=3)
    events = run(OmniPipeline(cfg, stages), tensors(modalities=["text", "image"]), cfg)
    (dit_inputs,) = [i for m, i in stages.calls if m == "dit"]
    assert dit_inputs[DIT.PROMPT].reshape(-1)[0] == b"w0 w1 w2 "
    assert [type(e) for e in events[-2:]] == [ImageOut, Final]


@pytest.mark.parametrize("failing,role", [("talker", "talker"), ("dec", "audio_decoder"),
                                          ("llm", "thinker"), ("aenc", "audio_encoder")])
def test_a_failing_stage_is_named_and_no_child_stream_is_left_open(failing, role):
    cfg = config()
    stages = ScriptedStages(reply_tokens=30, fail=failing)
    with pytest.raises(StageFailedError) as err:
        run(OmniPipeline(cfg, stages), tensors(audio=b"wav", modalities=["audio"]), cfg)
    assert str(err.value) == f"stage '{role}' (model {failing}) failed: {failing} refuses"
    assert err.value.code == "INVALID_ARG"
    assert not stages.open_streams
    if role in ("talker", "audio_decoder"):
        assert "llm" in stages.closed_early  # the thinker was stopped, not left running


def test_a_silent_stage_times_out_as_unavailable():
    cfg = config(stage_timeout_s=0.2)
    stages = ScriptedStages(reply_tokens=3, hang="dec")
    with pytest.raises(StageFailedError) as err:
        run(OmniPipeline(cfg, stages), tensors(modalities=["audio"]), cfg)
    assert err.value.code == "UNAVAILABLE" and "audio_decoder" in str(err.value)


def test_cancelling_the_request_closes_every_child_stream():
    cfg = config()
    stages = ScriptedStages(reply_tokens=200, token_delay=0.01)

    async def scenario():
        req = parse_request("r1", tensors(modalities=["audio"]), cfg)
        task = asyncio.create_task(OmniPipeline(cfg, stages).run(req, lambda e: None))
        while not any(m == "talker" for m, _ in stages.calls):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert not stages.open_streams
    assert "llm" in stages.closed_early


@pytest.mark.parametrize("extra,field,message", [
    ({OMNI.MODALITIES: ["video"]}, "modalities", "unknown or unavailable modality 'video'"),
    ({OMNI.IMAGE: b""}, "image", "is empty"),
    ({OMNI.IMAGE: b"x" * 2000}, "image", "is 2000 bytes; at most 1000 are allowed"),
    ({OMNI.MODALITIES: ['["text", 1]']}, "modalities", "must be a list of strings"),
    ({OMNI.SAMPLING_PARAMETERS: b"{nope"}, "sampling_parameters", "invalid JSON"),
])
def test_bad_requests_name_the_input(extra, field, message):
    cfg = config(max_media_bytes=1000)
    with pytest.raises(RequestError) as err:
        parse_request("r", tensors(**extra), cfg)
    assert err.value.field == field and message in err.value.message


def test_modalities_need_their_stages():
    cfg = config(stages={"thinker": "llm"}, codec=None)
    with pytest.raises(RequestError, match="'audio' needs a talker and an audio_decoder stage, "
                       "which this pipeline has not .*; it offers \\['text'\\]"):
        parse_request("r", tensors(modalities=["audio"]), cfg)
    with pytest.raises(RequestError, match="this pipeline offers \\['text'\\]"):
        parse_request("r", tensors(modalities=["image"]), cfg)
    with pytest.raises(RequestError, match="no audio encoder stage"):
        parse_request("r", tensors(audio=b"wav"), cfg)
    req = parse_request("r", tensors(modalities=['["audio", "text"]']), config())
    assert req.modalities == ("audio", "text")


@pytest.mark.parametrize("argv,url", [
    (["tritonserver", "--model-repository=/r"], "127.0.0.1:8001"),
    (["tritonserver", "--model-repository", "/r", "--grpc-port", "9101"], "127.0.0.1:9101"),
    (["tritonserver", "--grpc-port=9102", "--grpc-address=10.0.0.5"], "10.0.0.5:9102"),
    (["tritonserver", "--grpc-address", "0.0.0.0", "--grpc-port=7"], "127.0.0.1:7"),
])
def test_the_local_grpc_endpoint_comes_from_the_server_command_line(argv, url):
    from omni_serve.orchestrator.grpc_client import grpc_url_from_args

    assert grpc_url_from_args(argv) == url


def test_a_server_without_grpc_is_refused_with_the_reason():
    from omni_serve.orchestrator.grpc_client import grpc_url_from_args

    with pytest.raises(ValueError, match="--allow-grpc=false"):
        grpc_url_from_args(["tritonserver", "--allow-grpc=false"])


def test_segments_do_not_depend_on_how_the_thinker_groups_its_tokens():
    """The stage merges outputs while its sender is busy, so one response may carry several
    tokens: the talker still gets the same segments (and so, for a seed, the same speech)."""

    class Merging(ScriptedStages):
        async def stream(self, model, inputs, outputs, *, request_id, timeout_s):
            if model != "llm":
                async for out in super().stream(model, inputs, outputs, request_id=request_id,
                                                timeout_s=timeout_s):
                    yield out
                return
            outs = [o async for o in super().stream(model, inputs, outputs,
                                                    request_id=request_id, timeout_s=timeout_s)]
            for group in (outs[0:3], outs[3:8], outs[8:11]):  # 3, 5 and 3 tokens a response
                yield {LLM.TEXT_OUTPUT: np.array(["".join(o[LLM.TEXT_OUTPUT][0].decode()
                                                          for o in group).encode()], dtype=object),
                       LLM.TOKEN_IDS: np.concatenate([o[LLM.TOKEN_IDS] for o in group]),
                       LLM.FINISH_REASON: group[-1][LLM.FINISH_REASON]}

    cfg = config()
    prompts = []
    for stages in (ScriptedStages(reply_tokens=11), Merging(reply_tokens=11)):
        run(OmniPipeline(cfg, stages), tensors(modalities=["audio"], seed=5), cfg)
        prompts.append([i[LLM.PROMPT_TOKEN_IDS].tolist() for m, i in stages.calls
                        if m == "talker"])
    assert [len(p) - 1 for p in prompts[1]] == [4, 6, 1]
    assert prompts[1] == prompts[0]

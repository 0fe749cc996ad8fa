"""The omni orchestrator's stage graph, driven with a scripted StageClient (no Triton)."""
from __future__ import annotations

import asyncio
import json
import os
import tempfile

import numpy as np
import pytest

from omni_serve.contract import AUDIO, DIT, ENCODER, LLM, OMNI, TALKER
from omni_serve.errors import RequestError, StageFailedError
from omni_serve.families.qwen2_5_omni import FAMILY
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.pipeline import (
    Final,
    ImageOut,
    OmniPipeline,
    StageCallError,
    TextDelta,
)
from omni_serve.orchestrator.request import parse_request
from tests.unit.chat import tiny_chat_prompt

SAMPLES_PER_CODE = 10
MEL_BINS = 128
HIDDEN = 4
ROW_WIDTH = 2 * HIDDEN  # [input embedding | hidden state] floats per row


def config(**overrides) -> OrchestratorConfig:
    base = {
        "stages": {"thinker": "llm", "talker": "talker", "image_encoder": "ienc",
                   "audio_encoder": "aenc", "audio_decoder": "dec", "image_generator": "dit"},
        "first_chunk_codes": 3, "chunk_codes": 5, "left_context_codes": 2,
        "right_context_codes": 2, "align_codes": 2, "stage_timeout_s": 2.0,
    }
    base.update(overrides)
    return OrchestratorConfig.model_validate(base)


def prompt_ids_of(prompt: str) -> list[int]:
    """The fake thinker's input_token_ids for a text prompt (one id per character)."""
    return [ord(c) for c in prompt]


def code_at(position: int) -> int:
    """The fake talker's codec id at `position` of its stream (0-based codes, all distinct)."""
    return (7 * position + 3) % 512


def mark(position: int, code: int) -> int:
    """The fake decoder's sample value for code `code` at stream `position`."""
    return position * 1000 + code


class ScriptedStages:
    """A StageClient whose stages answer from rules; it records every call.

    The thinker keeps its rows in a real file (as the stage does with
    hidden_states_in_shm) and answers with hidden_states_file / rows,
    input_token_ids (first response) and the running num_output_tokens; the
    talker streams `talker_codes` codec ids in groups of `code_groups` (cycled);
    the decoder voices each code it is sent outside the context as
    SAMPLES_PER_CODE samples of `mark(position, code)`.
    """

    def __init__(self, *, reply_tokens: int = 20, token_delay: float = 0.01,
                 talker_codes: int = 23, code_groups: tuple[int, ...] = (1, 2, 3),
                 code_delay: float = 0.005, first_decode_delay: float = 0.03,
                 fail: str | None = None, hang: str | None = None):
        self.reply_tokens = reply_tokens
        self.token_delay = token_delay
        self.talker_codes = talker_codes
        self.code_groups = code_groups
        self.code_delay = code_delay
        self.first_decode_delay = first_decode_delay
        self.fail = fail
        self.hang = hang
        self.calls: list[tuple[str, dict]] = []
        self.open_streams: set[str] = set()
        self.closed_early: list[str] = []
        self.decoded: list[tuple[list[int], int, int, int, int]] = []
        self.decode_finished: list[int] = []  # first code voiced, in the order decodes finished
        self.thinker_done_at: int | None = None
        self.thinker_files: list[str] = []  # the hidden-state files the thinker handed over
        self.thinker_prompt_ids: list[list[int]] = []
        self.talker_groups: list[list[int]] = []  # the codec ids of each talker response
        self.files_seen_by_talker: list[bool] = []
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
            codes = inputs[AUDIO.CODEC_IDS].reshape(-1).tolist()
            context = int(inputs[AUDIO.CONTEXT_TOKENS].reshape(-1)[0])
            lookahead = int(inputs[AUDIO.LOOKAHEAD_TOKENS].reshape(-1)[0])
            offset = int(inputs[AUDIO.CODE_OFFSET].reshape(-1)[0])
            seed = int(inputs[AUDIO.SEED].reshape(-1)[0])
            self.decoded.append((codes, context, lookahead, offset, seed))
            self.log.append("audio")
            # the stream's first chunk is the slowest: later ones finish before it
            await asyncio.sleep(self.first_decode_delay if offset + context == 0 else 0.001)
            self.decode_finished.append(offset + context)
            voiced = codes[context:len(codes) - lookahead]
            marks = [mark(offset + context + i, code) for i, code in enumerate(voiced)]
            pcm = np.repeat(np.array(marks, np.float32), SAMPLES_PER_CODE)
            return {AUDIO.AUDIO_CHUNK: pcm[None], AUDIO.SAMPLE_RATE: np.array([[100]], np.int32)}
        if model == "dit":
            return {DIT.IMAGE: np.array([[b"\x89PNG fake"]], dtype=np.object_)}
        raise AssertionError(model)

    async def stream(self, model, inputs, outputs, *, request_id, timeout_s, unread=None):
        self.calls.append((model, inputs))
        self.open_streams.add(request_id)
        finished = False
        try:
            if model == self.fail:
                raise StageCallError("INVALID_ARG", f"{model} refuses")
            if model == self.hang:
                await asyncio.sleep(3600)
            if model == "llm":
                async for out in self._think(inputs):
                    yield out
                self.thinker_done_at = len(self.log)
            elif model == "talker":
                async for out in self._talk(inputs):
                    yield out
            finished = True
        finally:
            self.open_streams.discard(request_id)
            if not finished:
                self.closed_early.append(model)

    async def _think(self, inputs):
        if LLM.PROMPT_TOKEN_IDS in inputs:
            assert LLM.TEXT_INPUT not in inputs
            ids = inputs[LLM.PROMPT_TOKEN_IDS].tolist()
        else:
            prompt = inputs[LLM.TEXT_INPUT][0].decode()
            # one placeholder per item; the engine expands it
            assert prompt.count("<|IMAGE|>") == (LLM.IMAGE_EMBEDS in inputs or LLM.IMAGE in inputs)
            clips = inputs.get(LLM.AUDIO_FEATURE_LENGTHS, inputs.get(LLM.AUDIO, ()))
            assert prompt.count("<|AUDIO|>") == len(clips)
            ids = prompt_ids_of(prompt)
        self.thinker_prompt_ids.append(ids)
        sampling = json.loads(inputs[LLM.SAMPLING_PARAMETERS][0])
        n = min(self.reply_tokens, sampling.get("max_tokens", self.reply_tokens))
        path = None
        if LLM.HIDDEN_STATES_IN_SHM in inputs:
            assert inputs[LLM.RETURN_HIDDEN_STATES].all() and inputs[LLM.RETURN_INPUT_TOKEN_IDS].all()
            fd, path = tempfile.mkstemp(prefix="omni-test-thinker-")
            os.close(fd)
            self.thinker_files.append(path)
        rows = 0
        for i in range(n):
            await asyncio.sleep(self.token_delay)
            last = i == n - 1
            self.log.append("text")
            out = {LLM.TEXT_OUTPUT: np.array([f"w{i} ".encode()], dtype=np.object_),
                   LLM.FINISH_REASON: np.array([b"length" if last else b""], dtype=np.object_),
                   LLM.NUM_INPUT_TOKENS: np.array([len(ids)], np.uint32),
                   LLM.NUM_OUTPUT_TOKENS: np.array([1], np.uint32)}  # the tokens it adds
            if path is not None:
                # prompt rows with the first response, then one per reply token fed back
                new = len(ids) if i == 0 else 1
                with open(path, "ab") as f:
                    f.write(np.zeros((new, ROW_WIDTH), np.float32).tobytes())
                out[LLM.HIDDEN_STATES_FILE] = np.array([path.encode()], dtype=np.object_)
                out[LLM.HIDDEN_STATES_ROWS] = np.array([rows, new, ROW_WIDTH], np.int64)
                rows += new
                if i == 0:
                    out[LLM.INPUT_TOKEN_IDS] = np.array(ids, np.int64)
            yield out
        if path is not None:
            with open(path + ".rows", "w") as f:
                f.write(str(rows))

    async def _talk(self, inputs):
        source = inputs[TALKER.THINKER_HIDDEN_STATES_FILE][0].decode()
        self.files_seen_by_talker.append(os.path.exists(source))
        self.log.append("talker")
        position, group = 0, 0
        while position < self.talker_codes:
            await asyncio.sleep(self.code_delay)
            size = self.code_groups[group % len(self.code_groups)]
            codes = [code_at(p) for p in range(position, min(position + size, self.talker_codes))]
            self.talker_groups.append(codes)
            position, group = position + len(codes), group + 1
            yield {TALKER.CODEC_IDS: np.array(codes, np.int64).reshape(-1, 1)}  # [frames, groups]
        yield {TALKER.CODEC_IDS: np.zeros((0, 1), np.int64)}  # the last response: the stop code cut
        self.log.append("talker done")

    def talker_requests(self) -> list[dict]:
        return [inputs for model, inputs in self.calls if model == "talker"]

    def thinker_requests(self) -> list[dict]:
        return [inputs for model, inputs in self.calls if model == "llm"]


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
    events = run(OmniPipeline(cfg, stages, tiny_chat_prompt()), tensors(), cfg)
    assert [m for m, _ in stages.calls] == ["llm"]
    # no rows kept for a talker: none of the speech flags, no file handed over
    assert not set(FAMILY.speech.thinker_inputs) & set(stages.thinker_requests()[0])
    assert stages.thinker_files == []
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "w0 w1 w2 w3 w4 "
    assert isinstance(events[-1], Final) and events[-1].finish_reason == "length"
    assert events[-1].metrics["time_to_first_token_s"] > 0
    assert events[-1].metrics["time_to_first_audio_s"] is None


def test_the_encoders_outputs_go_to_the_thinker_with_one_placeholder_each():
    cfg = config()
    stages = ScriptedStages(reply_tokens=2)
    run(OmniPipeline(cfg, stages, tiny_chat_prompt()), tensors(image=b"img-bytes", audio=b"wav"), cfg)
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


def test_media_a_familys_thinker_takes_raw_go_to_it_as_files_with_no_encoder_call():
    import base64

    cfg = config(family="qwen3_omni_moe", stages={"thinker": "llm"})
    stages = ScriptedStages(reply_tokens=2)
    run(OmniPipeline(cfg, stages, tiny_chat_prompt()), tensors(image=b"img-bytes", audio=b"wav"), cfg)
    assert [m for m, _ in stages.calls] == ["llm"]
    thinker = stages.calls[0][1]
    assert base64.b64decode(thinker[LLM.IMAGE][0]) == b"img-bytes"
    assert bytes(thinker[LLM.AUDIO][0]) == b"wav"
    assert not {LLM.IMAGE_EMBEDS, LLM.AUDIO_FEATURES} & set(thinker)
    prompt = thinker[LLM.TEXT_INPUT][0].decode()
    assert prompt.index("<|AUDIO|>") < prompt.index("<|IMAGE|>") < prompt.index("hello")
    assert "system" not in prompt  # the family has no system prompt of its own


def test_image_output_uses_the_reply_as_the_prompt():
    cfg = config()
    stages = ScriptedStages(reply_tokens=3)
    events = run(OmniPipeline(cfg, stages, tiny_chat_prompt()), tensors(modalities=["text", "image"]), cfg)
    (dit_inputs,) = [i for m, i in stages.calls if m == "dit"]
    assert dit_inputs[DIT.PROMPT].reshape(-1)[0] == b"w0 w1 w2 "
    assert [type(e) for e in events[-2:]] == [ImageOut, Final]


@pytest.mark.parametrize("failing,role", [("talker", "talker"), ("dec", "audio_decoder"),
                                          ("llm", "thinker"), ("aenc", "audio_encoder")])
def test_a_failing_stage_is_named_and_no_child_stream_is_left_open(failing, role):
    cfg = config()
    stages = ScriptedStages(reply_tokens=30, fail=failing)
    with pytest.raises(StageFailedError) as err:
        run(OmniPipeline(cfg, stages, tiny_chat_prompt()), tensors(audio=b"wav", modalities=["audio"]), cfg)
    assert str(err.value) == f"stage '{role}' (model {failing}) failed: {failing} refuses"
    assert err.value.code == "INVALID_ARG"
    assert not stages.open_streams
    if role in ("talker", "audio_decoder"):
        assert "llm" in stages.closed_early  # the thinker was stopped, not left running
    assert not any(os.path.exists(p) for p in stages.thinker_files)


def test_a_silent_stage_times_out_as_unavailable():
    cfg = config(stage_timeout_s=0.2)
    stages = ScriptedStages(reply_tokens=3, hang="dec")
    with pytest.raises(StageFailedError) as err:
        run(OmniPipeline(cfg, stages, tiny_chat_prompt()), tensors(modalities=["audio"]), cfg)
    assert err.value.code == "UNAVAILABLE" and "audio_decoder" in str(err.value)


def test_cancelling_the_request_closes_every_child_stream():
    cfg = config()
    stages = ScriptedStages(reply_tokens=200, token_delay=0.01)

    async def scenario():
        req = parse_request("r1", tensors(modalities=["audio"]), cfg)
        task = asyncio.create_task(OmniPipeline(cfg, stages, tiny_chat_prompt()).run(req, lambda e: None))
        while not any(m == "talker" for m, _ in stages.calls):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert not stages.open_streams
    assert "llm" in stages.closed_early
    assert stages.thinker_files and not any(os.path.exists(p) for p in stages.thinker_files)


@pytest.mark.parametrize("extra,field,message", [
    ({OMNI.MODALITIES: ["video"]}, "modalities", "unknown or unavailable modality 'video'"),
    ({OMNI.IMAGE: b""}, "image", "is empty"),
    ({OMNI.IMAGE: b"x" * 2000}, "image", "is 2000 bytes; at most 1000 are allowed"),
    ({OMNI.MODALITIES: ['["text", 1]']}, "modalities", "must be a list of strings"),
    ({OMNI.SAMPLING_PARAMETERS: b"{nope"}, "sampling_parameters", "invalid JSON"),
    ({OMNI.SAMPLING_PARAMETERS: b'{"n": 2}'}, "sampling_parameters.n",
     "must be 1: the omni model answers with one reply; got 2"),
])
def test_bad_requests_name_the_input(extra, field, message):
    cfg = config(max_media_bytes=1000)
    with pytest.raises(RequestError) as err:
        parse_request("r", tensors(**extra), cfg)
    assert err.value.field == field and message in err.value.message


def test_modalities_need_their_stages():
    cfg = config(stages={"thinker": "llm"})
    with pytest.raises(RequestError, match="'audio' needs a talker and an audio_decoder stage, "
                       "which this pipeline has not .*; it offers \\['text'\\]"):
        parse_request("r", tensors(modalities=["audio"]), cfg)
    with pytest.raises(RequestError, match="this pipeline offers \\['text'\\]"):
        parse_request("r", tensors(modalities=["image"]), cfg)
    with pytest.raises(RequestError, match="no audio encoder stage"):
        parse_request("r", tensors(audio=b"wav"), cfg)
    req = parse_request("r", tensors(modalities=['["audio", "text"]']), config())
    assert req.modalities == ("audio", "text")


@pytest.mark.parametrize("key,value,says", [
    ("transport", "grpc", "the stages are always called over Triton gRPC"),
    ("mode", "sequential", "the orchestrator always pipelines"),
])
def test_an_engine_json_with_a_removed_setting_says_what_to_do_instead(key, value, says):
    with pytest.raises(ValueError, match=f"{key}: removed: {says} .*Delete the key"):
        config(**{key: value})


@pytest.mark.parametrize("argv,url", [
    (["tritonserver", "--model-repository=/r"], "127.0.0.1:8001"),
    (["tritonserver", "--model-repository", "/r", "--grpc-port", "9101"], "127.0.0.1:9101"),
    (["tritonserver", "--grpc-port=9102", "--grpc-address=10.0.0.5"], "10.0.0.5:9102"),
    (["tritonserver", "--grpc-address", "0.0.0.0", "--grpc-port=7"], "127.0.0.1:7"),
])
def test_the_local_grpc_endpoint_comes_from_the_server_command_line(argv, url):
    from omni_serve.orchestrator.locality import grpc_url_from_args

    assert grpc_url_from_args(argv) == url


def test_a_server_without_grpc_is_refused_with_the_reason():
    from omni_serve.orchestrator.locality import grpc_url_from_args

    with pytest.raises(ValueError, match="--allow-grpc=false"):
        grpc_url_from_args(["tritonserver", "--allow-grpc=false"])


@pytest.mark.parametrize("text", ["", "  \n"])
def test_a_chat_turn_may_be_media_alone_but_not_empty(text):
    cfg = config()
    req = parse_request("r", tensors(text, **{OMNI.AUDIO: b"RIFF"}), cfg)
    assert req.text == ""
    prompt = tiny_chat_prompt()
    chat = prompt.render("sys", req.text, ["audio"])
    # the user's turn is its audio, with no empty text part after it
    assert chat.endswith("<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|><|im_end|>\n"
                         "<|im_start|>assistant\n")
    for extra in ({}, {OMNI.AUDIO: b"RIFF", OMNI.TASK: b"speech"}):
        with pytest.raises(RequestError) as err:
            parse_request("r", tensors(text, **extra), cfg)
        assert err.value.field == "text_input" and "a chat turn may be media alone" in err.value.message

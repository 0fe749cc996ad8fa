"""A `video` through the omni entry model to a thinker that takes it raw, without a server.

Runs in the pytest process. The orchestrator's side: request parsing (which families take
video), the clip's header checked before any stage runs, the thinker's inputs (the file's
bytes, the chat template's video placeholder) and, for speech, the talker's (the video's grid
and time scale, for its positions). The llm stage's side: the `video` tensor parsed, and the
frames vLLM's processor gets, which are the ones the family's processor samples
(omni_serve.encoder.video, itself checked against transformers in test_video_decode.py).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omni_serve import families
from omni_serve.contract import LLM, OMNI, TALKER
from omni_serve.encoder.config import MediaLimits, VideoLimits
from omni_serve.encoder.video import decode_video
from omni_serve.errors import RequestError
from omni_serve.llm import media as llm_media
from omni_serve.llm.render import raw_media_data
from omni_serve.llm.request import parse_request as parse_llm_request
from omni_serve.orchestrator.pipeline import OmniPipeline
from omni_serve.orchestrator.prompt import ChatPrompt
from omni_serve.orchestrator.request import parse_request
from tests.unit.test_orchestrator import ScriptedStages, config, tensors
from tests.video_clip import clip

QWEN3 = families.get("qwen3_omni_moe")


@pytest.fixture(scope="module")
def video() -> bytes:
    return clip(fps=10, frames=25)  # 2.5 s: 4 frames at Qwen3-Omni's 1 frame a second


@pytest.fixture(scope="module")
def long_clip() -> bytes:
    """125 s: over the default max_video_seconds (120)."""
    assert MediaLimits().max_video_seconds == 120
    return clip(fps=1, frames=125)


@pytest.fixture(scope="module")
def qwen3_prompt() -> ChatPrompt:
    from omni_tools.tiny_qwen3_omni import QWEN3_OMNI_CHAT_TEMPLATE, build_qwen3_omni_tokenizer

    tokenizer = build_qwen3_omni_tokenizer()
    tokenizer.chat_template = QWEN3_OMNI_CHAT_TEMPLATE
    return ChatPrompt(tokenizer)


def qwen3_config(**overrides):
    return config(family="qwen3_omni_moe", stages={"thinker": "llm"}, **overrides)


def run(cfg, stages, prompt, request_tensors) -> None:
    req = parse_request("r1", request_tensors, cfg)
    asyncio.run(OmniPipeline(cfg, stages, prompt).run(req, lambda event: None))


# --- the omni entry model ------------------------------------------------------------------


def test_a_video_goes_to_a_raw_media_thinker_as_its_file_with_the_templates_placeholder(
        video, qwen3_prompt):
    cfg = qwen3_config()
    stages = ScriptedStages(reply_tokens=2)
    run(cfg, stages, qwen3_prompt, tensors("what happens?", video=video))
    assert [m for m, _ in stages.calls] == ["llm"]  # no encoder stage
    thinker = stages.calls[0][1]
    assert bytes(thinker[LLM.VIDEO][0]) == video
    prompt = thinker[LLM.TEXT_INPUT][0].decode()
    assert prompt.count("<|vision_start|><|video_pad|><|vision_end|>") == 1
    assert prompt.index("<|video_pad|>") < prompt.index("what happens?")


def test_a_bad_clip_is_refused_naming_video_before_any_stage_runs(qwen3_prompt, long_clip):
    cfg = qwen3_config()
    stages = ScriptedStages(reply_tokens=2)
    garbage = np.random.default_rng(0).bytes(5000)
    with pytest.raises(RequestError) as err:
        run(cfg, stages, qwen3_prompt, tensors(video=garbage))
    assert err.value.field == "video" and "not a decodable video file" in err.value.message
    assert stages.calls == []
    with pytest.raises(RequestError, match=r"video: .*at most 120 s .*\(max_video_seconds\)"):
        run(cfg, stages, qwen3_prompt, tensors(video=long_clip))  # from its header alone
    assert stages.calls == []


def test_speech_about_a_video_gives_the_talker_its_grid_and_seconds_a_grid_step(video,
                                                                                 qwen3_prompt):
    """The talker's M-RoPE positions need the video's grid and time scale: the processor's
    grid of the 4 sampled frames (384x384, patch 16: 2 x 24 x 24) and 2 s a grid step (2
    frames at Qwen3-Omni's 1 frame a second). The thinker gets neither: it reads the file."""
    cfg = config(family="qwen3_omni_moe",
                 stages={"thinker": "llm", "talker": "talker", "audio_decoder": "dec"})
    stages = ScriptedStages(reply_tokens=4, talker_codes=0)  # no frames to decode
    run(cfg, stages, qwen3_prompt, tensors("what happens?", video=video,
                                           **{OMNI.MODALITIES: ["text", "audio"]}))
    (talker,) = stages.talker_requests()
    assert talker[TALKER.VIDEO_GRID_THW].dtype == np.int64
    assert talker[TALKER.VIDEO_GRID_THW].tolist() == [[2, 24, 24]]
    assert talker[TALKER.VIDEO_SECOND_PER_GRID].tolist() == [2.0]
    assert not {TALKER.IMAGE_GRID_THW, TALKER.AUDIO_FEATURE_LENGTHS} & set(talker)
    (thinker,) = stages.thinker_requests()
    assert not {TALKER.VIDEO_GRID_THW, TALKER.VIDEO_SECOND_PER_GRID} & set(thinker)


@pytest.mark.parametrize("extra,message", [
    ({OMNI.VIDEO: b""}, "is empty"),
    ({OMNI.VIDEO: b"x" * 2000}, "is 2000 bytes; at most 1000 are allowed (max_video_bytes)"),
])
def test_bad_video_requests_name_video(extra, message):
    cfg = config(family="qwen3_omni_moe", video_limits={"max_video_bytes": 1000},
                 stages={"thinker": "llm", "talker": "talker", "audio_decoder": "dec"})
    with pytest.raises(RequestError) as err:
        parse_request("r", tensors(**extra), cfg)
    assert err.value.field == "video" and message in err.value.message


def test_a_clips_size_is_limited_by_max_video_bytes_not_max_media_bytes():
    cfg = config(family="qwen3_omni_moe", max_media_bytes=1000, stages={"thinker": "llm"})
    assert parse_request("r", tensors(video=b"x" * 2000), cfg).video == b"x" * 2000
    with pytest.raises(RequestError) as err:
        parse_request("r", tensors(audio=b"x" * 2000), cfg)
    assert err.value.field == "audio" and "at most 1000 are allowed (max_media_bytes)" in \
        err.value.message


@pytest.mark.parametrize("limits,message", [
    ({"max_video_seconds": 2}, "video is 2.50 s long; at most 2 s are accepted (max_video_seconds)"),
    ({"max_video_frames": 20}, "has 25 frames; at most 20 frames are accepted (max_video_frames)"),
    ({"max_video_pixels": 64 * 64 - 1}, "64x64 = 4096 pixels; the limit is 4095 pixels a frame "
                                        "(max_video_pixels)"),
])
def test_the_orchestrator_enforces_its_configured_video_limits(video, qwen3_prompt, limits,
                                                                message):
    """The 2.5 s, 25-frame, 64x64 clip is within the defaults; each configured limit under it
    refuses it from its header, naming the limit, before any stage runs."""
    stages = ScriptedStages(reply_tokens=2)
    with pytest.raises(RequestError) as err:
        run(qwen3_config(video_limits=limits), stages, qwen3_prompt, tensors(video=video))
    assert err.value.field == "video" and message in err.value.message
    assert stages.calls == []


def test_a_raised_video_limit_lets_a_clip_over_the_default_through(long_clip, qwen3_prompt):
    stages = ScriptedStages(reply_tokens=2)
    run(qwen3_config(video_limits={"max_video_seconds": 200}), stages, qwen3_prompt,
        tensors(video=long_clip))
    assert [m for m, _ in stages.calls] == ["llm"]


def test_a_family_whose_thinker_takes_no_raw_video_refuses_it():
    import dataclasses

    families.register(dataclasses.replace(families.get("qwen2_5_omni"), name="no_video",
                                          model_types=("no_video",), raw_media=(), video=None))
    try:
        with pytest.raises(RequestError) as err:
            parse_request("r", tensors(video=b"clip"), config(family="no_video"))
    finally:
        families.unregister("no_video")
    assert err.value.field == "video" and "(no_video) takes no video" in err.value.message


def test_qwen25_omni_takes_a_video_raw_beside_its_encoded_image():
    req = parse_request("r", tensors(video=b"clip"), config())  # Qwen2.5-Omni, encoder stages
    assert req.video == b"clip"


# --- the llm stage -------------------------------------------------------------------------


def llm_tensors(**extra) -> dict:
    out = {LLM.TEXT_INPUT: np.array([b"<|video_pad|> what happens?"], dtype=np.object_)}
    out.update({k: np.array(v, dtype=np.object_) for k, v in extra.items()})
    return out


def test_the_llm_stage_takes_video_files_and_refuses_empty_ones_or_no_prompt(video):
    req = parse_llm_request("r", llm_tensors(video=[video, video]))
    assert req.videos == [video, video]
    with pytest.raises(RequestError) as err:
        parse_llm_request("r", llm_tensors(video=[video, b""]))
    assert err.value.field == "video[1]" and "is empty; send a video file's bytes" in err.value.message
    with pytest.raises(RequestError) as err:
        parse_llm_request("r", {LLM.PROMPT_TOKEN_IDS: np.array([1, 2]),
                                LLM.VIDEO: np.array([video], dtype=np.object_)})
    assert err.value.field == "video" and "needs a text_input" in err.value.message


def test_vllm_gets_the_frames_the_familys_processor_samples(video):
    req = parse_llm_request("r", llm_tensors(video=[video]))
    data = asyncio.run(raw_media_data(req, "llm", 16000, QWEN3.video))
    (frames,) = data["video"]
    want = decode_video(video, MediaLimits(), QWEN3.video)
    assert frames.dtype == np.uint8 and frames.shape == (4, 64, 64, 3)
    np.testing.assert_array_equal(frames, want.frames)
    assert set(data) == {"video"}


def test_a_bad_clip_at_the_llm_stage_names_its_element(video):
    req = parse_llm_request("r", llm_tensors(video=[video, b"no video at all" * 10]))
    with pytest.raises(RequestError) as err:
        asyncio.run(raw_media_data(req, "llm", 16000, QWEN3.video))
    assert err.value.field == "video[1]" and "not a decodable video file" in err.value.message
    with pytest.raises(RequestError, match="stage llm serves a model that takes no video"):
        asyncio.run(raw_media_data(req, "llm", 16000, None))


def test_the_llm_stage_decodes_within_its_configured_video_limits(video, heard_video, long_clip):
    limits = VideoLimits(max_video_frames=20)
    for clip_, flag in ((video, False), (heard_video, True)):  # frames alone, and with sound
        request = llm_tensors(video=[clip_])
        request[LLM.USE_AUDIO_IN_VIDEO] = np.array([flag])
        req = parse_llm_request("r", request)
        with pytest.raises(RequestError) as err:
            asyncio.run(raw_media_data(req, "llm", 16000, QWEN3.video, limits))
        assert err.value.field == "video[0]"
        assert "25 frames; at most 20 frames are accepted (max_video_frames)" in err.value.message
    req = parse_llm_request("r", llm_tensors(video=[long_clip]))  # over the default 120 s
    raised = VideoLimits(max_video_seconds=200)
    (frames,) = asyncio.run(raw_media_data(req, "llm", 16000, QWEN3.video, raised))["video"]
    assert frames.shape[0] == QWEN3.video.sampled_count(125, 1.0)


def test_the_llm_stage_takes_its_video_limits_from_engine_json(monkeypatch):
    """The spec's video_limits, as omni-gen-repo writes them into engine.json: the stage's,
    not vLLM's arguments, given to each request's decode; a bad value fails the load."""
    from omni_serve.llm import stage as llm_stage

    stage = llm_stage.LLMStage({"model": "fake", "video_limits": {"max_video_frames": 20}},
                               name="fake")
    assert stage.video_limits == VideoLimits(max_video_frames=20)
    assert "video_limits" not in stage.host.engine_args
    rendered = []

    async def render_request(*args):
        rendered.append(args)

    monkeypatch.setattr(llm_stage.render, "render_request", render_request)
    asyncio.run(stage._render(parse_llm_request("r", llm_tensors(video=[b"clip"]))))
    assert rendered[0][-1] is stage.video_limits
    assert llm_stage.LLMStage({"model": "fake"}, name="fake").video_limits == VideoLimits()
    with pytest.raises(ValueError, match=r"^video_limits\.max_video_seconds: Input should be "
                                         r"greater than 0 \(got 0\)$"):
        llm_stage.LLMStage({"model": "fake", "video_limits": {"max_video_seconds": 0}})


def test_the_stage_finds_its_familys_video_sampling_in_the_checkpoint_config():
    from types import SimpleNamespace as Config

    thinker = Config(model_type="qwen3_omni_moe_thinker", vision_config=Config())
    assert llm_media.video_sampling(Config(model_type="qwen3_omni_moe", thinker_config=thinker)) \
        is QWEN3.video
    assert llm_media.video_sampling(Config(model_type="qwen2", vision_config=None)) is None
    assert llm_media.video_sampling(Config(model_type="llava", vision_config=Config())) is None


# --- audio in video (use_audio_in_video) ---------------------------------------------------


@pytest.fixture(scope="module")
def heard_video() -> bytes:
    return clip(fps=10, frames=25, sound="tone", sound_codec="pcm_s16le")


@pytest.mark.parametrize("extra,message", [
    ({}, "needs a video"),
    ({OMNI.VIDEO: b"clip", OMNI.AUDIO: b"RIFF"}, "cannot be combined with audio"),
])
def test_hearing_a_clip_needs_a_video_and_no_other_sound(extra, message):
    request = tensors(**extra)
    request[OMNI.USE_AUDIO_IN_VIDEO] = np.array([True])
    with pytest.raises(RequestError) as err:
        parse_request("r", request, qwen3_config())
    assert err.value.field == "use_audio_in_video" and message in err.value.message


def test_a_heard_clip_goes_to_the_thinker_with_the_flag(heard_video, qwen3_prompt):
    stages = ScriptedStages(reply_tokens=2)
    request = tensors("what happens?", video=heard_video)
    request[OMNI.USE_AUDIO_IN_VIDEO] = np.array([True])
    run(qwen3_config(), stages, qwen3_prompt, request)
    (thinker,) = stages.thinker_requests()
    assert thinker[LLM.USE_AUDIO_IN_VIDEO].tolist() == [True]
    assert bytes(thinker[LLM.VIDEO][0]) == heard_video
    # the chat template renders the video's placeholder alone; vLLM's processor expands it
    assert "<|audio_start|>" not in thinker[LLM.TEXT_INPUT][0].decode()


@pytest.mark.parametrize("flag", [False, None])
def test_a_clip_not_heard_sends_no_flag(heard_video, video, qwen3_prompt, flag):
    """False, or no flag with a silent clip (no processor default to read then)."""
    stages = ScriptedStages(reply_tokens=2)
    request = tensors("what happens?", video=heard_video if flag is False else video)
    if flag is not None:
        request[OMNI.USE_AUDIO_IN_VIDEO] = np.array([flag])
    run(qwen3_config(), stages, qwen3_prompt, request)
    assert LLM.USE_AUDIO_IN_VIDEO not in stages.thinker_requests()[0]


def test_hearing_a_clip_without_sound_is_refused_before_any_stage(video, qwen3_prompt):
    stages = ScriptedStages(reply_tokens=2)
    request = tensors("what happens?", video=video)
    request[OMNI.USE_AUDIO_IN_VIDEO] = np.array([True])
    with pytest.raises(RequestError) as err:
        run(qwen3_config(), stages, qwen3_prompt, request)
    assert err.value.field == "use_audio_in_video" and "no audio stream" in err.value.message
    assert stages.calls == []


def test_the_llm_stage_gives_vllm_each_clips_soundtrack_as_its_audio(heard_video):
    request = llm_tensors(video=[heard_video])
    request[LLM.USE_AUDIO_IN_VIDEO] = np.array([True])
    req = parse_llm_request("r", request)
    assert req.use_audio_in_video
    data = asyncio.run(raw_media_data(req, "llm", 16000, QWEN3.video))
    want = decode_video(heard_video, MediaLimits(), QWEN3.video)
    ((samples, rate),) = data["audio"]
    assert rate == 16000 and samples.shape == (40000,)  # 2.5 s of PCM at 16 kHz
    np.testing.assert_array_equal(samples, want.audio)
    np.testing.assert_array_equal(data["video"][0], want.frames)


def test_the_llm_stage_refuses_hearing_without_a_video_or_sound(video):
    flag = {LLM.USE_AUDIO_IN_VIDEO: np.array([True])}
    with pytest.raises(RequestError) as err:
        parse_llm_request("r", {**llm_tensors(), **flag})
    assert err.value.field == "use_audio_in_video" and "needs video" in err.value.message
    with pytest.raises(RequestError) as err:
        parse_llm_request("r", {**llm_tensors(video=[video], audio=[b"RIFF"]), **flag})
    assert err.value.field == "use_audio_in_video" and "cannot be combined" in err.value.message
    req = parse_llm_request("r", {**llm_tensors(video=[video]), **flag})
    with pytest.raises(RequestError) as err:
        asyncio.run(raw_media_data(req, "llm", 16000, QWEN3.video))
    assert err.value.field == "video[0]" and "has no audio stream" in err.value.message


def test_the_talker_takes_the_flag_with_a_grid_and_the_soundtracks_lengths():
    from omni_serve.talker.request import parse_request as parse_talker_request

    base = {TALKER.THINKER_HIDDEN_STATES_FILE: np.array([b"/dev/shm/x"], dtype=np.object_),
            TALKER.PROMPT_TOKEN_IDS: np.array([1, 2], dtype=np.int64),
            TALKER.USE_AUDIO_IN_VIDEO: np.array([True])}
    grid = {TALKER.VIDEO_GRID_THW: np.array([[2, 24, 24]], dtype=np.int64),
            TALKER.VIDEO_SECOND_PER_GRID: np.array([2.0], dtype=np.float32)}
    req = parse_talker_request("r", {**base, **grid,
                                     TALKER.AUDIO_FEATURE_LENGTHS: np.array([300])})
    assert req.feed.use_audio_in_video and req.feed.audio_feature_lengths.tolist() == [300]
    for tensors_, field in ((base, "use_audio_in_video"), ({**base, **grid}, "use_audio_in_video")):
        with pytest.raises(RequestError) as err:
            parse_talker_request("r", tensors_)
        assert err.value.field == field

"""Qwen3-Omni's thinker through the omni model: replies equal transformers', token for token.

The tiny random-weight Qwen3-Omni (omni_tools.tiny_qwen3_omni: MoE thinker with the vision
tower's deepstack and the AuT audio encoder) in a pipeline spec written here as a user
writes one (a thinker stage and an orchestrator, model names of their own), generated with
omni-gen-repo and loaded into the session's text-chat server (servers.loaded), so no server
of its own starts. The family's thinker takes images and audio raw (its own vLLM processor
and towers), so the spec has no encoder stage. Speech: the family's talker (its vLLM model
with the code predictor, omni_talker; compiled, as the preset runs it) and Code2Wav
(omni_audio) load with the thinker, as one group, so their engines load side by side; so
does a Thinking folder's thinker with an orchestrator of its own (text only).

Reference: transformers' Qwen3OmniMoeForConditionalGeneration on the same folder, greedy,
fp32, inputs from the checkpoint's own Qwen3OmniMoeProcessor (tests/qwen3_reference): the
thinker's reply, and for speech its talker's 16 codes of every frame and the waveform.
Speech about an image also checks the thinker's rows the talker reads at the image's
positions (the output of layer accept_hidden_layer, before its deepstack addition): the
last layer's, or one with deepstack, gives the talker another prompt and other codes.

The same through omni-openai (one process in front of the server, the official `openai`
client): speech in an OpenAI voice, an image part, a video part (data: and file:// URLs),
the model list, the Thinking model's refusal of audio. Across turns: a conversation whose
turns carry the earlier ones in `history` gets transformers' reply to the whole chat each
turn, and the thinker's prefix cache (KV blocks of BLOCK_SIZE tokens) finds the
conversation so far.
"""
from __future__ import annotations

import base64
import functools
import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import soundfile as sf
import yaml
from PIL import Image

from omni_tools.server import OpenAIFrontend
from omni_tools.tiny_models import ensure_model
from tests.qwen3_reference import load, processor_inputs, reference, thinker_reply
from tests.video_clip import clip, clip_soundtrack
from tests.wav_check import STEP

from .llm_io import cancel_limit, metric, wait_idle
from .omni_io import (
    OmniResult,
    OmniStream,
    absorb,
    audio_amid_text,
    error_code,
    omni_inputs,
    png,
    run_omni,
    run_omni_hearing,
    tone,
    wav,
)
from .servers import gen_repo, loaded

pytestmark = pytest.mark.integration

THINKER, TALKER, DECODER, OMNI_MODEL = "qwen3_thinker", "qwen3_talker", "qwen3_code2wav", "qwen3_omni"
THINKING, THINKING_OMNI = "qwen3_thinking_thinker", "qwen3_thinking"
GREEDY = {"temperature": 0, "max_tokens": 16}
# the random tiny talker seldom samples its end code: its frames are bounded
GREEDY_TALKER = {"temperature": 0, "max_tokens": 20}
SEED = 0
QUESTION = "what do you see and hear?"
# vLLM caches whole KV blocks only; the CPU default (128 tokens) would hide a short
# conversation's prefix-cache hits
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def folder() -> str:
    return str(ensure_model("qwen3-omni-tiny"))


@pytest.fixture(scope="module")
def server(text_chat_server, folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-omni")
    spec = {"pipeline": "qwen3-omni-chat", "entry": OMNI_MODEL, "stages": {
        THINKER: {"backend": "omni_llm", "model": folder, "engine_args": {
            "limit_mm_per_prompt": {"image": 1, "audio": 1, "video": 1},
            "max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32",
            "enforce_eager": True, "block_size": BLOCK_SIZE}},
        # compiled, as the preset runs it (the thinker's compiled path is vLLM's own)
        TALKER: {"backend": "omni_talker", "model": folder, "engine_args": {
            "max_model_len": 2048, "max_num_seqs": 4, "dtype": "float32"},
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
        DECODER: {"backend": "omni_audio", "model": folder, "max_batch_size": 4},
        OMNI_MODEL: {"backend": "omni_orchestrator", "engine_args": {"stages": {
            "thinker": THINKER, "talker": TALKER, "audio_decoder": DECODER}}}}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    repo = gen_repo([root / "spec.yaml"], root / "repo")
    # A Thinking folder as the hub ships it (no talker or Code2Wav weights): its thinker
    # and an orchestrator without speech stages, as omni-gen-repo --preset omni-chat
    # writes them for it (test_checkpoint_folder), here under names of their own so they
    # load beside the rest, side by side.
    thinking = {"pipeline": "qwen3-omni-thinking", "entry": THINKING_OMNI, "stages": {
        THINKING: {**spec["stages"][THINKER], "model": str(ensure_model("qwen3-omni-thinking-tiny"))},
        THINKING_OMNI: {"backend": "omni_orchestrator",
                        "engine_args": {"stages": {"thinker": THINKING}}}}}
    (root / "thinking.yaml").write_text(yaml.safe_dump(thinking))
    for stage in gen_repo([root / "thinking.yaml"], root / "thinking").iterdir():
        if stage.is_dir():
            shutil.copytree(stage, repo / stage.name)
    with loaded(text_chat_server, repo, [
            (THINKER, TALKER, DECODER, OMNI_MODEL, THINKING, THINKING_OMNI)]) as server:
        yield server


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.grpc_url


def _reference(folder: str, image: bytes | None, audio) -> list[int]:
    parts = ([{"type": "audio", "audio": audio}] if audio is not None else []) + (
        [{"type": "image", "image": Image.open(io.BytesIO(image)).convert("RGB")}] if image else [])
    return thinker_reply(folder, [{"role": "user", "content": [
        *parts, {"type": "text", "text": QUESTION}]}], max_new_tokens=GREEDY["max_tokens"])


CASES = {
    "text": {},
    "text + image": {"image": png(300, 200, seed=2)},  # the processor resizes it
    "text + audio": {"audio": tone(1.0, freq=330.0)},
}


@functools.lru_cache(maxsize=8)
def _case_reply(folder: str, case: str) -> list[int]:
    """transformers' reply ids to QUESTION with CASES[case]'s media (asked once a folder)."""
    return _reference(folder, CASES[case].get("image"), CASES[case].get("audio"))


def _text(folder: str, ids: list[int]) -> str:
    """The reply text of `ids` as the server sends it (vLLM holds back a reply's last bytes
    while they are no whole UTF-8 character)."""
    return load(folder)[1].tokenizer.decode(ids, skip_special_tokens=True).removesuffix("\ufffd")


@pytest.mark.parametrize("case", CASES)
def test_the_reply_equals_qwen3_omni_in_transformers(url, folder, case):
    media = CASES[case]
    want = _case_reply(folder, case)
    result = run_omni(url, model=OMNI_MODEL, text=QUESTION, sampling=GREEDY,
                      image=media.get("image"),
                      audio=wav(media["audio"]) if "audio" in media else None)
    assert result.error is None, result.error
    assert result.text == _text(folder, want)
    assert result.metrics["usage"]["completion_tokens"] == len(want)


# --- video (without its sound) -----------------------------------------------------------

VIDEO_QUESTION = "what happens in this video?"


def _video_messages(folder: str, data: bytes) -> list[dict]:
    """VIDEO_QUESTION about the video file `data`, its frames transformers' own: its pyav
    loading, with its video processor's sampling at the family's 1 frame a second
    (torchcodec, its default reader, is not installed here)."""
    import tempfile
    from pathlib import Path

    from transformers.video_utils import load_video

    sample = functools.partial(load(folder)[1].video_processor.sample_frames, fps=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "clip.mp4").write_bytes(data)
        frames, _ = load_video(str(Path(tmp) / "clip.mp4"), backend="pyav",
                               sample_indices_fn=sample)
    assert tuple(frames.shape) == (4, 64, 64, 3)
    return [{"role": "user", "content": [{"type": "video", "video": np.asarray(frames)},
                                         {"type": "text", "text": VIDEO_QUESTION}]}]


@functools.lru_cache(maxsize=2)
def _video_reference(folder: str, data: bytes) -> tuple[list[int], int]:
    """transformers' (reply ids, prompt tokens) to VIDEO_QUESTION about the video file `data`."""
    messages = _video_messages(folder, data)
    prompt_tokens = processor_inputs(load(folder)[1], messages)["input_ids"].shape[1]
    return thinker_reply(folder, messages, max_new_tokens=GREEDY["max_tokens"]), prompt_tokens


def test_a_video_gets_the_reply_of_qwen3_omni_in_transformers(url, folder):
    """A 2.5 s clip (10 fps, 64x64): 4 frames, resized to 384x384, 2 x 12 x 12 video tokens at
    M-RoPE times 0 and 26 (2 s a grid x 13 positions a second). The reply depends on both:
    these frames reversed, or positions of 1 s a grid, give other replies."""
    data = clip(fps=10, frames=25, size=(64, 64))
    want, prompt_tokens = _video_reference(folder, data)
    result = run_omni(url, model=OMNI_MODEL, text=VIDEO_QUESTION, sampling=GREEDY, video=data)
    assert result.error is None, result.error
    assert result.text == _text(folder, want)
    assert result.metrics["usage"] == {"prompt_tokens": prompt_tokens,
                                       "completion_tokens": len(want)}


def test_a_bad_clip_is_invalid_arg_naming_video_and_the_next_request_succeeds(url, folder):
    garbage = run_omni(url, model=OMNI_MODEL, text=VIDEO_QUESTION, sampling=GREEDY,
                       video=np.random.default_rng(0).bytes(5000))
    assert error_code(garbage.error) == "INVALID_ARG"
    assert "video: not a decodable video file" in str(garbage.error)
    # cut inside its frames, its index first: the header passes, the thinker's decoding fails
    whole = clip(fps=10, frames=25, size=(64, 64), faststart=True)
    cut = run_omni(url, model=OMNI_MODEL, text=VIDEO_QUESTION, sampling=GREEDY,
                   video=whole[: len(whole) * 6 // 10])
    assert error_code(cut.error) == "INVALID_ARG"
    assert "thinker" in str(cut.error) and "video[0]: truncated or corrupt video" in str(cut.error)
    ok = run_omni(url, model=OMNI_MODEL, text=VIDEO_QUESTION, sampling=GREEDY, video=whole)
    assert ok.error is None, ok.error
    assert ok.text == _text(folder, _video_reference(folder, whole)[0])


def test_speech_about_a_video_equals_qwen3_omni_in_transformers(url, folder):
    """The talker's prompt holds the video's rows at the thinker's M-RoPE positions, which
    need the clip's grid (2 x 24 x 24) and its 2 s a grid step: the orchestrator reads both
    from the clip's header and the family's sampling, for the talker."""
    data = clip(fps=10, frames=25, size=(64, 64))
    want_ids, want_codes, want_wave = reference(
        folder, _video_messages(folder, data), speaker="chelsie", seed=SEED,
        max_new_tokens=GREEDY["max_tokens"], talker_max_new_tokens=GREEDY_TALKER["max_tokens"])
    result = run_omni(url, model=OMNI_MODEL, text=VIDEO_QUESTION, modalities=["text", "audio"],
                      sampling=GREEDY, talker_sampling=GREEDY_TALKER, seed=SEED, voice="chelsie",
                      return_codec_ids=True, video=data)
    assert result.error is None, result.error
    assert result.text == _text(folder, want_ids)
    assert len(want_codes) > 1 and result.codec_ids == want_codes.tolist()
    assert np.abs(result.audio - want_wave).max() < 1e-4


# --- video with its sound (use_audio_in_video) ------------------------------------------

# PCM: 3 s are a whole number of 10 ms feature frames (an AAC soundtrack, 49152 samples, is
# not: test_a_clip_heard_with_its_aac_sound_equals_qwen3_omni_in_transformers).
HEARD_CLIP = functools.partial(clip, fps=10, frames=30, size=(64, 64), sound="chirp",
                               sound_codec="pcm_s16le")


def _heard_messages(folder: str, data: bytes) -> list[dict]:
    """_video_messages with the clip's soundtrack as its video part's audio (PyAV's samples)."""
    messages = _video_messages(folder, data)
    messages[0]["content"][0]["soundtrack"] = clip_soundtrack(data)
    return messages


def test_a_clip_heard_with_its_sound_equals_qwen3_omni_in_transformers(url, folder):
    """use_audio_in_video: a 3 s clip with a chirp (PCM, MOV): 4 frames at 1 a second (2 x 12 x
    12 video tokens, 2 s a grid step) and its sound's audio tokens (12.5 a second),
    interleaved token by token by time (13 position ids a second). Its reply is
    transformers' with the flag; without the flag the same clip's is the silent one."""
    data = HEARD_CLIP()
    want = thinker_reply(folder, _heard_messages(folder, data),
                         max_new_tokens=GREEDY["max_tokens"], use_audio_in_video=True)
    deaf = _video_reference(folder, data)[0]
    assert want != deaf, "the soundtrack does not change transformers' reply: no test"
    heard = run_omni_hearing(url, True, model=OMNI_MODEL, text=VIDEO_QUESTION,
                             sampling=GREEDY, video=data)
    assert heard.error is None, heard.error
    assert heard.text == _text(folder, want)
    assert heard.metrics["usage"]["completion_tokens"] == len(want)
    silent = run_omni_hearing(url, False, model=OMNI_MODEL, text=VIDEO_QUESTION,
                              sampling=GREEDY, video=data)
    assert silent.error is None, silent.error
    assert silent.text == _text(folder, deaf)
    # a clip without sound cannot be heard: INVALID_ARG naming the flag
    mute = run_omni_hearing(url, True, model=OMNI_MODEL, text=VIDEO_QUESTION,
                            sampling=GREEDY, video=clip(fps=10, frames=30, size=(64, 64)))
    assert error_code(mute.error) == "INVALID_ARG"
    assert "use_audio_in_video: is true but the video has no audio stream" in str(mute.error)


def test_speech_about_a_clip_heard_with_its_sound_equals_qwen3_omni_in_transformers(url, folder):
    """The talker's positions interleave the clip's frames and sound as the thinker's do
    (get_rope_index with use_audio_in_video and the soundtrack's feature frames)."""
    data = HEARD_CLIP()
    want_ids, want_codes, want_wave = reference(
        folder, _heard_messages(folder, data), speaker="chelsie", seed=SEED,
        max_new_tokens=GREEDY["max_tokens"], talker_max_new_tokens=GREEDY_TALKER["max_tokens"],
        use_audio_in_video=True)
    result = run_omni_hearing(url, True, model=OMNI_MODEL, text=VIDEO_QUESTION,
                              modalities=["text", "audio"], sampling=GREEDY,
                              talker_sampling=GREEDY_TALKER, seed=SEED, voice="chelsie",
                              return_codec_ids=True, video=data)
    assert result.error is None, result.error
    assert result.text == _text(folder, want_ids)
    assert len(want_codes) > 1 and result.codec_ids == want_codes.tolist()
    assert np.abs(result.audio - want_wave).max() < 1e-4


def test_a_clip_heard_with_its_aac_sound_equals_qwen3_omni_in_transformers(url, folder):
    """AAC codes sound in 1024-sample frames: the 3 s clip's soundtrack is 49152 samples, 307
    feature frames in transformers (vLLM 0.32's own processor: 308, and another reply)."""
    data = clip(fps=10, frames=30, size=(64, 64), sound="chirp", sound_codec="aac")
    messages = _heard_messages(folder, data)
    assert messages[0]["content"][0]["soundtrack"].size % 160
    want = thinker_reply(folder, messages, max_new_tokens=GREEDY["max_tokens"],
                         use_audio_in_video=True)
    heard = run_omni_hearing(url, True, model=OMNI_MODEL, text=VIDEO_QUESTION,
                             sampling=GREEDY, video=data)
    assert heard.error is None, heard.error
    assert heard.text == _text(folder, want)
    assert heard.metrics["usage"]["completion_tokens"] == len(want)


def test_a_thinking_folder_replies_as_transformers_and_refuses_audio(url):
    folder = str(ensure_model("qwen3-omni-thinking-tiny"))
    want = _reference(folder, None, None)
    result = run_omni(url, model=THINKING_OMNI, text=QUESTION, sampling=GREEDY)
    assert result.error is None, result.error
    text = load(folder)[1].tokenizer.decode(want, skip_special_tokens=True)
    assert result.text == text.removesuffix("\ufffd")
    audio = run_omni(url, model=THINKING_OMNI, text=QUESTION, modalities=["text", "audio"],
                     sampling=GREEDY)
    assert error_code(audio.error) == "INVALID_ARG"
    assert all(word in str(audio.error) for word in ("modalities", "talker", "audio_decoder"))


SEA = "say something about the sea"


@functools.lru_cache(maxsize=8)
def _spoken(folder: str, question: str, speaker: str):
    return reference(folder, [{"role": "user", "content": [{"type": "text", "text": question}]}],
                     speaker=speaker, seed=SEED, max_new_tokens=GREEDY["max_tokens"],
                     talker_max_new_tokens=GREEDY_TALKER["max_tokens"])


@pytest.mark.parametrize("stream_audio", [False, True], ids=["whole", "streamed"])
def test_speech_equals_qwen3_omni_in_transformers(url, folder, stream_audio):
    question = SEA
    want_ids, want_codes, want_wave = _spoken(folder, SEA, "ethan")
    assert len(want_codes) > 1, "the reference talker produced no frames"
    result = run_omni(url, model=OMNI_MODEL, text=question, modalities=["text", "audio"],
                      sampling=GREEDY, talker_sampling=GREEDY_TALKER, seed=SEED, voice="ethan",
                      stream_audio=stream_audio, return_codec_ids=True)
    assert result.error is None, result.error
    text = load(folder)[1].tokenizer.decode(want_ids, skip_special_tokens=True)
    assert result.text == text.removesuffix("\ufffd")
    assert result.codec_ids == want_codes.tolist()  # all 16 codes of every frame
    assert result.sample_rate == 24000
    # the whole utterance from the reference's sample 0, whatever the chunking (causal
    # decoder, exact left context)
    assert len(result.chunks) == 1 if not stream_audio else len(result.chunks) > 1
    if stream_audio:  # the first chunk was sized from the pace: 4 to 12 frames (1920 samples)
        first = result.metrics["first_chunk_codes"]
        rest = sum(chunk.size for chunk in result.chunks[1:])
        assert 4 <= first <= 12 and rest == (len(want_codes) - first) * 1920, (first, rest)
    assert result.audio.shape == want_wave.shape
    assert np.abs(result.audio - want_wave).max() < 1e-4


def _heard(samples: np.ndarray) -> np.ndarray:
    """What the server hears of `samples` sent as a WAV file (16-bit PCM)."""
    return sf.read(io.BytesIO(wav(samples)), dtype="float32")[0]


# Speech about media, each with its speaker. The tiny random talker's logits are nearly
# flat, so some inputs put two codes within 1e-3 of each other at some step, where the
# fp32 sums of vLLM and transformers may pick either; these inputs' reference choices all
# win by more than 1.5e-3 (tools: a forward hook on every head, top-1 minus top-2).
MEDIA_SPEECH = {
    "image": (png(300, 200, seed=2), None, "chelsie"),
    "audio": (None, tone(1.0, freq=220.0), "ethan"),
    "image + audio": (png(300, 200, seed=2), tone(1.0, freq=180.0), "ethan"),
}


@pytest.mark.parametrize("case", MEDIA_SPEECH)
def test_speech_about_media_equals_qwen3_omni_in_transformers(url, folder, case):
    """The talker's prompt holds the media's rows at the thinker's M-RoPE positions, which
    need the image's grid and the audio's length (the orchestrator reads them with the
    checkpoint's processor)."""
    image, audio, speaker = MEDIA_SPEECH[case]
    parts = ([{"type": "audio", "audio": _heard(audio)}] if audio is not None else []) + (
        [{"type": "image", "image": Image.open(io.BytesIO(image)).convert("RGB")}] if image else [])
    want_ids, want_codes, want_wave = reference(
        folder, [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],
        speaker=speaker, seed=SEED, max_new_tokens=GREEDY["max_tokens"],
        talker_max_new_tokens=GREEDY_TALKER["max_tokens"])
    result = run_omni(url, model=OMNI_MODEL, text=QUESTION, modalities=["text", "audio"],
                      sampling=GREEDY, talker_sampling=GREEDY_TALKER, seed=SEED, voice=speaker,
                      return_codec_ids=True, image=image,
                      audio=wav(audio) if audio is not None else None)
    assert result.error is None, result.error
    text = load(folder)[1].tokenizer.decode(want_ids, skip_special_tokens=True)
    assert result.text == text.removesuffix("\ufffd")
    assert len(want_codes) > 1 and result.codec_ids == want_codes.tolist()
    assert np.abs(result.audio - want_wave).max() < 1e-4


# --- sound that is no whole number of 10 ms hops ----------------------------------------

# 16072 samples at 16 kHz (1.0045 s, 72 past the 100th 160-sample hop): transformers'
# processor makes 100 feature frames (n // 160) and 13 audio tokens of it; vLLM 0.32's own
# Qwen3-Omni processor pads it to 16160 samples, 101 frames and 14 tokens. The family's
# thinker (qwen3_omni_moe/thinker_processor.py) makes transformers' frames, and the
# orchestrator reads the same 100 for the talker's positions (processor_media_shapes).
ODD_SOUND = (0.3 * np.sin(2 * np.pi * 260.0 * np.arange(16072) / 16000)).astype(np.float32)


def test_speech_about_a_sound_of_an_odd_length_equals_qwen3_omni_in_transformers(url, folder):
    heard = _heard(ODD_SOUND)
    inputs = processor_inputs(load(folder)[1], [{"role": "user", "content": [
        {"type": "audio", "audio": heard}, {"type": "text", "text": QUESTION}]}])
    assert heard.size % 160 and inputs["feature_attention_mask"].sum() == heard.size // 160
    want_ids, want_codes, want_wave = reference(
        folder, inputs, speaker="ethan", seed=SEED, max_new_tokens=GREEDY["max_tokens"],
        talker_max_new_tokens=GREEDY_TALKER["max_tokens"])
    result = run_omni(url, model=OMNI_MODEL, text=QUESTION, modalities=["text", "audio"],
                      sampling=GREEDY, talker_sampling=GREEDY_TALKER, seed=SEED, voice="ethan",
                      return_codec_ids=True, audio=wav(ODD_SOUND))
    assert result.error is None, result.error
    # the thinker's prompt holds transformers' 13 audio tokens, not vLLM's 14
    assert result.metrics["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert result.text == _text(folder, want_ids)
    assert result.metrics["usage"]["completion_tokens"] == len(want_ids)
    assert len(want_codes) > 1 and result.codec_ids == want_codes.tolist()
    assert np.abs(result.audio - want_wave).max() < 1e-4


# (question, voice, the config's speaker it names, stream_audio); onyx is OpenAI's name
# mapped to ethan (the family's voice_map)
TOGETHER = [(SEA, "aiden", "aiden", False), ("hello there", "chelsie", "chelsie", True),
            (SEA, "onyx", "ethan", True), ("hello there", "ethan", "ethan", False)]


@pytest.mark.parametrize("concurrency", [2, 4])
def test_every_speaker_together_equals_qwen3_omni_in_transformers(url, folder, concurrency):
    """Each of several requests at once (a continuous batch in the talker, a dynamic one in
    Code2Wav) equals transformers alone, for each speaker of the checkpoint and for an
    OpenAI voice name."""
    requests = TOGETHER[:concurrency]
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: run_omni(
            url, model=OMNI_MODEL, text=r[0], modalities=["text", "audio"], sampling=GREEDY,
            talker_sampling=GREEDY_TALKER, seed=SEED, voice=r[1], stream_audio=r[3],
            return_codec_ids=True), requests))
    for (question, voice, speaker, _), result in zip(requests, results, strict=True):
        assert result.error is None, (voice, result.error)
        want_ids, want_codes, want_wave = _spoken(folder, question, speaker)
        assert result.codec_ids == want_codes.tolist(), voice
        assert np.abs(result.audio - want_wave).max() < 1e-4, voice
    # the speakers matter: the same question in another voice is other speech
    assert _spoken(folder, SEA, "aiden")[1].tolist() != _spoken(folder, SEA, "ethan")[1].tolist()


def test_first_audio_comes_before_a_long_reply_ends(url):
    """Pipelined: the talker speaks the reply's first tokens while the thinker still writes."""
    assert 0 < len(audio_amid_text(url, OMNI_MODEL, seed=SEED).deltas) < 500


def _generated(server, model: str) -> float:
    return metric(server.metrics(), "omni_llm_generation_tokens_total", model)


def test_cancelling_mid_speech_leaves_every_engine_idle(server, url):
    thinker_before, talker_before = _generated(server, THINKER), _generated(server, TALKER)
    long = {"temperature": 0, "max_tokens": 1500, "ignore_eos": True}
    stream = OmniStream(url, OMNI_MODEL)
    stream.send(omni_inputs("speak for a long time", modalities=["audio"], sampling=long))
    sent = OmniResult()  # what had reached the client when it cancelled
    try:
        while "audio" not in sent.kinds:  # the talker and Code2Wav run: mid-speech
            response, error = stream.next(timeout=60)
            assert error is None, error
            assert not absorb(sent, response), "the request ended before any audio"
        stream.received(sent)
    finally:
        stream.close(cancel=True)
    idle = wait_idle(server, (THINKER, TALKER), (OMNI_MODEL,))
    assert not any(idle.values()), idle  # so no token comes after the counts below
    # Both engines stopped early: of what the thinker had left when the client cancelled,
    # it generated less than half; the talker (a frame per reply token) likewise.
    thinker = _generated(server, THINKER) - thinker_before
    assert 0 < thinker < cancel_limit(len(sent.deltas), long["max_tokens"]), len(sent.deltas)
    assert _generated(server, TALKER) - talker_before < long["max_tokens"] / 2
    assert run_omni(url, model=OMNI_MODEL, text="still there?", sampling=GREEDY).error is None


# --- omni-openai ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """The folder omni-openai reads file:// media URLs from (--allowed-local-media-path)."""
    return tmp_path_factory.mktemp("qwen3-omni-media")


@pytest.fixture(scope="module")
def openai_client(server, media_dir, tmp_path_factory):
    """The official `openai` client on omni-openai in front of the module's server."""
    log = tmp_path_factory.mktemp("qwen3-omni-openai") / "omni-openai.log"
    with OpenAIFrontend(server.grpc_url, log_path=log,
                        extra_args=["--allowed-local-media-path", str(media_dir)]) as frontend, \
            openai.OpenAI(
            base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0,
            timeout=180) as client:
        yield client


def _user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_openai_models_lists_the_entry_models_and_the_thinker_chats(openai_client, folder):
    """As for Qwen2.5-Omni: the orchestrators are omni models, each thinker an LLM of its own
    (text chat through its chat template), the talker and Code2Wav are not offered."""
    models = {m.id: m.model_extra["kind"] for m in openai_client.models.list().data}
    assert models[OMNI_MODEL] == models[THINKING_OMNI] == "omni"
    assert models[THINKER] == models[THINKING] == "llm"
    assert not {TALKER, DECODER} & set(models)
    want = _case_reply(folder, "text")
    reply = openai_client.chat.completions.create(
        model=THINKER, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        seed=SEED, max_tokens=GREEDY["max_tokens"])
    assert reply.choices[0].message.content == _text(folder, want)
    assert reply.usage.completion_tokens == len(want)


def test_openai_speech_equals_qwen3_omni_in_transformers(openai_client, folder):
    """An OpenAI voice name (onyx: the family's voice_map says ethan) speaks the reference's
    speech: the WAV's samples are its waveform within one PCM16 step; streamed, the WAV's
    samples within one step (the stream's first chunk is sized from the pace, so its chunk
    bounds, and with them float rounding, may differ from run to run)."""
    want_ids, want_codes, want_wave = _spoken(folder, SEA, "ethan")
    assert len(want_codes) > 1, "the reference talker produced no frames"
    kwargs = dict(model=OMNI_MODEL, messages=_user({"type": "text", "text": SEA}),
                  modalities=["text", "audio"], temperature=0, seed=SEED,
                  max_tokens=GREEDY["max_tokens"],
                  extra_body={"talker_sampling_parameters": GREEDY_TALKER})
    whole = openai_client.chat.completions.create(**kwargs, audio={"voice": "onyx", "format": "wav"})
    audio = whole.choices[0].message.audio
    assert audio.transcript == _text(folder, want_ids)
    assert whole.usage.completion_tokens == len(want_ids)
    wav_bytes = base64.b64decode(audio.data)
    samples, rate = sf.read(io.BytesIO(wav_bytes), dtype="float32")
    assert rate == 24000 and samples.shape == want_wave.shape
    assert np.abs(samples - np.clip(want_wave, -1, 1)).max() <= STEP + 1e-4

    transcript, pcm = [], []
    for chunk in openai_client.chat.completions.create(
            **kwargs, audio={"voice": "onyx", "format": "pcm16"}, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.audio  # openai's ChoiceDeltaAudio
            if delta:
                transcript.append(getattr(delta, "transcript", None) or "")
                if getattr(delta, "data", None):
                    pcm.append(np.frombuffer(base64.b64decode(delta.data), "<i2"))
    assert len(pcm) > 1  # audio arrived in several chunks
    assert "".join(transcript) == audio.transcript
    streamed = np.concatenate(pcm).astype(np.int32)
    wav = np.frombuffer(wav_bytes[44:], "<i2").astype(np.int32)
    assert streamed.shape == wav.shape and np.abs(streamed - wav).max() <= 1


def test_openai_image_part_gets_the_reply_of_transformers(openai_client, folder):
    want = _case_reply(folder, "text + image")
    url = "data:image/png;base64," + base64.b64encode(CASES["text + image"]["image"]).decode()
    reply = openai_client.chat.completions.create(
        model=OMNI_MODEL, temperature=0, seed=SEED, max_tokens=GREEDY["max_tokens"],
        messages=_user({"type": "image_url", "image_url": {"url": url}},
                       {"type": "text", "text": QUESTION}))
    assert reply.choices[0].message.content == _text(folder, want)
    assert reply.usage.completion_tokens == len(want)


def test_openai_video_url_gets_the_reply_of_transformers_and_the_omni_models_speech(
        openai_client, url, folder, media_dir):
    """A `video_url` part (vLLM's) as a data: URL, with speech in an OpenAI voice (nova:
    chelsie): the transcript is transformers' reply, the WAV the omni model's own speech
    for the same request within one PCM16 step. The same clip as a file:// URL inside the
    allowed folder gets the same reply."""
    data = clip(fps=10, frames=25, size=(64, 64))
    want = _text(folder, _video_reference(folder, data)[0])
    omni = run_omni(url, model=OMNI_MODEL, text=VIDEO_QUESTION, modalities=["text", "audio"],
                    sampling=GREEDY, talker_sampling=GREEDY_TALKER, seed=SEED, voice="chelsie",
                    video=data)
    assert omni.error is None, omni.error
    part = {"type": "video_url",
            "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}
    reply = openai_client.chat.completions.create(
        model=OMNI_MODEL, messages=_user(part, {"type": "text", "text": VIDEO_QUESTION}),
        modalities=["text", "audio"], audio={"voice": "nova", "format": "wav"}, temperature=0,
        seed=SEED, max_tokens=GREEDY["max_tokens"],
        extra_body={"talker_sampling_parameters": GREEDY_TALKER})
    audio = reply.choices[0].message.audio
    assert audio.transcript == omni.text == want
    samples, rate = sf.read(io.BytesIO(base64.b64decode(audio.data)), dtype="float32")
    assert rate == 24000 and samples.shape == omni.audio.shape and samples.size > 0
    assert np.abs(samples - np.clip(omni.audio, -1, 1)).max() <= STEP + 1e-4
    (media_dir / "clip.mp4").write_bytes(data)
    local = {"type": "video_url", "video_url": {"url": (media_dir / "clip.mp4").as_uri()}}
    text = openai_client.chat.completions.create(
        model=OMNI_MODEL, messages=_user(local, {"type": "text", "text": VIDEO_QUESTION}),
        temperature=0, seed=SEED, max_tokens=GREEDY["max_tokens"])
    assert text.choices[0].message.content == want


def test_openai_audio_from_the_thinking_model_is_a_400_naming_why(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=THINKING_OMNI, messages=_user({"type": "text", "text": QUESTION}),
            modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
            max_tokens=4)
    # the gRPC error's reason, as test_a_thinking_folder_replies_as_transformers_and_refuses_audio
    assert all(word in info.value.message for word in ("modalities", "talker", "audio_decoder"))
    ok = openai_client.chat.completions.create(
        model=THINKING_OMNI, messages=_user({"type": "text", "text": QUESTION}), max_tokens=2)
    assert ok.usage.completion_tokens == 2


# --- across turns -----------------------------------------------------------------------

# a long first message, then follow-ups long enough that each turn's prompt passes at least
# one more KV block than the last
CONVERSATION = [
    "Tell me a story about a lighthouse keeper who finds a message in a bottle on the shore "
    "one stormy night, reads it by the light of the lamp, and decides to find its writer.",
    "Who wrote the message, and where did the keeper travel to find that person in the end?",
    "Did the keeper answer it before the winter came, or did the letter wait until the spring?",
]
QUERIES, HITS = "omni_llm_prefix_cache_queries_total", "omni_llm_prefix_cache_hits_total"


def _prefix_cache(server) -> tuple[float, float]:
    text = server.metrics()
    return metric(text, QUERIES, THINKER), metric(text, HITS, THINKER)


def test_a_conversation_replies_as_transformers_and_its_prefix_cache_hits_rise(server, url,
                                                                                folder):
    """Each turn carries the earlier ones in `history`: its reply is transformers' to the
    whole conversation in the checkpoint's chat template, and the thinker finds the
    conversation so far in its prefix cache (every full block of the previous prompt)."""
    history: list[dict] = []
    turns = []
    for i, text in enumerate(CONVERSATION):
        want = _text(folder, thinker_reply(folder, [*history, {"role": "user", "content": text}],
                                           max_new_tokens=GREEDY["max_tokens"]))
        queries, hits = _prefix_cache(server)
        result = run_omni(url, model=OMNI_MODEL, text=text, sampling=GREEDY,
                          session_id="qwen3-conversation", history=history)
        assert result.error is None, result.error
        assert result.text == want, i
        idle = wait_idle(server, (THINKER,), (OMNI_MODEL,))
        assert not any(idle.values()), idle  # so the counters below are final
        after = _prefix_cache(server)
        turns.append({"queries": after[0] - queries, "hits": after[1] - hits,
                      "prompt": result.metrics["usage"]["prompt_tokens"]})
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": want}]
    print("\nprefix cache per turn (hits/queries): " + "; ".join(
        f"{t['hits']:.0f}/{t['queries']:.0f}" for t in turns))
    assert [t["queries"] for t in turns] == [t["prompt"] for t in turns], turns
    assert turns[0]["hits"] == 0, turns  # nothing of this conversation was cached yet
    for previous, turn in zip(turns, turns[1:]):
        assert turn["hits"] >= previous["prompt"] // BLOCK_SIZE * BLOCK_SIZE, turns
    assert turns[0]["hits"] < turns[1]["hits"] < turns[2]["hits"], turns


def test_an_earlier_spoken_turn_is_heard_as_qwen3_omni_in_transformers(url, folder):
    """history [user: audio A + text, assistant: text], then a text turn: the reply is
    transformers' to the same chat with A heard (the thinker takes it raw, in history),
    not the one to its text alone."""
    clip_wav = wav(tone(1.2, freq=523.0))
    heard = sf.read(io.BytesIO(clip_wav), dtype="float32")[0]
    said, question = "I hear it.", "what did I play you?"
    chat = [{"role": "user", "content": [{"type": "audio", "audio": heard},
                                         {"type": "text", "text": "listen"}]},
            {"role": "assistant", "content": said}, {"role": "user", "content": question}]
    want = thinker_reply(folder, chat, max_new_tokens=GREEDY["max_tokens"])
    unheard = thinker_reply(folder, [{"role": "user", "content": "listen"}, *chat[1:]],
                            max_new_tokens=GREEDY["max_tokens"])
    assert want != unheard, "the earlier clip does not change transformers' reply: no test"
    history = [{"role": "user", "content": [
                   {"type": "audio", "audio": base64.b64encode(clip_wav).decode()},
                   {"type": "text", "text": "listen"}]},
               {"role": "assistant", "content": said}]
    result = run_omni(url, model=OMNI_MODEL, text=question, sampling=GREEDY, history=history)
    assert result.error is None, result.error
    assert result.text == _text(folder, want)
    assert result.metrics["usage"]["completion_tokens"] == len(want)

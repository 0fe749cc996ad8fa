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
"""
from __future__ import annotations

import functools
import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf
import torch
import yaml
from PIL import Image

from omni_tools.tiny_models import ensure_model
from tests.qwen3_reference import load, processor_inputs, reference

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


@pytest.fixture(scope="module")
def folder() -> str:
    return str(ensure_model("qwen3-omni-tiny"))


@pytest.fixture(scope="module")
def server(text_chat_server, folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-omni")
    spec = {"pipeline": "qwen3-omni-chat", "entry": OMNI_MODEL, "stages": {
        THINKER: {"backend": "omni_llm", "model": folder, "engine_args": {
            "limit_mm_per_prompt": {"image": 1, "audio": 1, "video": 0},
            "max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32",
            "enforce_eager": True}},
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


def _reference(folder: str, image: bytes | None, audio) -> str:
    model, processor = load(folder)
    parts = ([{"type": "audio", "audio": audio}] if audio is not None else []) + (
        [{"type": "image", "image": Image.open(io.BytesIO(image)).convert("RGB")}] if image else [])
    inputs = processor_inputs(processor, [{"role": "user", "content": [
        *parts, {"type": "text", "text": QUESTION}]}])
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=GREEDY["max_tokens"],
                                     do_sample=False, eos_token_id=im_end)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


CASES = {
    "text": {},
    "text + image": {"image": png(300, 200, seed=2)},  # the processor resizes it
    "text + audio": {"audio": tone(1.0, freq=330.0)},
}


@pytest.mark.parametrize("case", CASES)
def test_the_reply_equals_qwen3_omni_in_transformers(url, folder, case):
    media = CASES[case]
    want = _reference(folder, media.get("image"), media.get("audio"))
    result = run_omni(url, model=OMNI_MODEL, text=QUESTION, sampling=GREEDY,
                      image=media.get("image"),
                      audio=wav(media["audio"]) if "audio" in media else None)
    assert result.error is None, result.error
    text = load(folder)[1].tokenizer.decode(want, skip_special_tokens=True)
    # vLLM holds back a reply's last bytes while they are no whole UTF-8 character
    assert result.text == text.removesuffix("\ufffd")
    assert result.metrics["usage"]["completion_tokens"] == len(want)


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

"""Qwen3-Omni's thinker through the omni model: replies equal transformers', token for token.

The tiny random-weight Qwen3-Omni (omni_tools.tiny_qwen3_omni: MoE thinker with the vision
tower's deepstack and the AuT audio encoder) in a pipeline spec written here as a user
writes one (a thinker stage and an orchestrator, model names of their own), generated with
omni-gen-repo and loaded into the session's text-chat server (servers.loaded), so no server
of its own starts. The family's thinker takes images and audio raw (its own vLLM processor
and towers), so the spec has no encoder stage. Speech: the family's talker (its vLLM model
with the code predictor, omni_talker) and Code2Wav (omni_audio) load with the thinker, as one
group, so their engines load side by side.

Reference: transformers' Qwen3OmniMoeForConditionalGeneration on the same folder, greedy,
fp32, inputs from the checkpoint's own Qwen3OmniMoeProcessor (tests/qwen3_reference): the
thinker's reply, and for speech its talker's 16 codes of every frame and the waveform.
Speech about an image also checks the thinker's rows the talker reads at the image's
positions (the output of layer accept_hidden_layer, before its deepstack addition): the
last layer's, or one with deepstack, gives the talker another prompt and other codes.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from omni_tools.tiny_models import ensure_model
from tests.qwen3_reference import load, processor_inputs, reference

from .omni_io import png, run_omni, tone, wav
from .servers import gen_repo, loaded

pytestmark = pytest.mark.integration

THINKER, TALKER, DECODER, OMNI_MODEL = "qwen3_thinker", "qwen3_talker", "qwen3_code2wav", "qwen3_omni"
GREEDY = {"temperature": 0, "max_tokens": 16}
# the random tiny talker seldom samples its end code: its frames are bounded
GREEDY_TALKER = {"temperature": 0, "max_tokens": 20}
SEED = 0
QUESTION = "what do you see and hear?"


@pytest.fixture(scope="module")
def folder() -> str:
    return str(ensure_model("qwen3-omni-tiny"))


@pytest.fixture(scope="module")
def url(text_chat_server, folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-omni")
    spec = {"pipeline": "qwen3-omni-chat", "entry": OMNI_MODEL, "stages": {
        THINKER: {"backend": "omni_llm", "model": folder, "engine_args": {
            "limit_mm_per_prompt": {"image": 1, "audio": 1, "video": 0},
            "max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32",
            "enforce_eager": True}},
        TALKER: {"backend": "omni_talker", "model": folder, "engine_args": {
            "max_model_len": 2048, "max_num_seqs": 4, "dtype": "float32", "enforce_eager": True},
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
        DECODER: {"backend": "omni_audio", "model": folder, "max_batch_size": 4},
        OMNI_MODEL: {"backend": "omni_orchestrator", "engine_args": {"stages": {
            "thinker": THINKER, "talker": TALKER, "audio_decoder": DECODER}}}}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    repo = gen_repo([root / "spec.yaml"], root / "repo")
    with loaded(text_chat_server, repo, [(THINKER, TALKER, DECODER), OMNI_MODEL]) as server:
        yield server.grpc_url


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


SEA = "say something about the sea"


@pytest.fixture(scope="module")
def sea_reference(folder):
    return reference(folder, [{"role": "user", "content": [{"type": "text", "text": SEA}]}],
                     speaker="ethan", seed=SEED, max_new_tokens=GREEDY["max_tokens"],
                     talker_max_new_tokens=GREEDY_TALKER["max_tokens"])


@pytest.mark.parametrize("stream_audio", [False, True], ids=["whole", "streamed"])
def test_speech_equals_qwen3_omni_in_transformers(url, folder, sea_reference, stream_audio):
    question = SEA
    want_ids, want_codes, want_wave = sea_reference
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


def test_speech_about_an_image_equals_qwen3_omni_in_transformers(url, folder):
    """The talker's prompt holds the image's rows at the thinker's M-RoPE positions, which
    need the image's grid (the orchestrator reads it with the checkpoint's processor)."""
    image = png(300, 200, seed=2)
    part = {"type": "image", "image": Image.open(io.BytesIO(image)).convert("RGB")}
    want_ids, want_codes, want_wave = reference(
        folder, [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
        speaker="chelsie", seed=SEED, max_new_tokens=GREEDY["max_tokens"],
        talker_max_new_tokens=GREEDY_TALKER["max_tokens"])
    result = run_omni(url, model=OMNI_MODEL, text=QUESTION, modalities=["text", "audio"],
                      sampling=GREEDY, talker_sampling=GREEDY_TALKER, seed=SEED, voice="chelsie",
                      return_codec_ids=True, image=image)
    assert result.error is None, result.error
    assert len(want_codes) > 1 and result.codec_ids == want_codes.tolist()
    assert np.abs(result.audio - want_wave).max() < 1e-4


def test_an_openai_voice_speaks_with_its_mapped_speaker(url):
    runs = [run_omni(url, model=OMNI_MODEL, text="hello there", modalities=["text", "audio"],
                     sampling=GREEDY, talker_sampling=GREEDY_TALKER, seed=SEED, voice=voice,
                     stream_audio=False, return_codec_ids=True) for voice in ("onyx", "ethan", "chelsie")]
    assert all(r.error is None for r in runs), [r.error for r in runs]
    onyx, ethan, chelsie = runs
    assert onyx.codec_ids == ethan.codec_ids and onyx.codec_ids != chelsie.codec_ids

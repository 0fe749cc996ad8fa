"""Qwen3-Omni's thinker through the omni model: replies equal transformers', token for token.

The tiny random-weight Qwen3-Omni (omni_tools.tiny_qwen3_omni: MoE thinker with the vision
tower's deepstack and the AuT audio encoder) in a pipeline spec written here as a user
writes one (a thinker stage and an orchestrator, model names of their own), generated with
omni-gen-repo and loaded into the session's text-chat server (servers.loaded), so no server
of its own starts. The family's thinker takes images and audio raw (its own vLLM processor
and towers), so the spec has no encoder stage; the family has no speech feed yet, so audio
out is refused clearly.

Reference: transformers' Qwen3OmniMoeForConditionalGeneration's thinker on the same folder,
greedy, fp32, inputs from the checkpoint's own Qwen3OmniMoeProcessor (tests/qwen3_reference).
"""
from __future__ import annotations

import io

import pytest
import torch
import yaml
from PIL import Image

from omni_tools.tiny_models import ensure_model
from tests.qwen3_reference import load, processor_inputs

from .omni_io import error_code, png, run_omni, tone, wav
from .servers import gen_repo, loaded

pytestmark = pytest.mark.integration

THINKER, OMNI_MODEL = "qwen3_thinker", "qwen3_omni"
GREEDY = {"temperature": 0, "max_tokens": 16}
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
        OMNI_MODEL: {"backend": "omni_orchestrator",
                     "engine_args": {"stages": {"thinker": THINKER}}}}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    repo = gen_repo([root / "spec.yaml"], root / "repo")
    with loaded(text_chat_server, repo, [THINKER, OMNI_MODEL]) as server:
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


def test_the_media_reach_the_thinker(url):
    replies = {run_omni(url, model=OMNI_MODEL, text=QUESTION, sampling=GREEDY, **media).text
               for media in ({}, {"image": png(300, 200, seed=2)}, {"image": png(64, 64, seed=5)},
                             {"audio": wav(tone(1.0, freq=330.0))})}
    assert len(replies) == 4


def test_speech_out_is_refused_naming_what_the_pipeline_offers(url):
    result = run_omni(url, model=OMNI_MODEL, text=QUESTION, modalities=["text", "audio"])
    assert result.error is not None and error_code(result.error) == "INVALID_ARG"
    assert "'audio' needs a talker and an audio_decoder stage" in result.error.message()
    assert run_omni(url, model=OMNI_MODEL, text=QUESTION, sampling=GREEDY).text

"""omni-chat against a real tritonserver: encoders -> thinker -> talker -> Token2Wav (gRPC)."""
from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image
from tritonclient.utils import InferenceServerException

from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.prompt import ChatPrompt
from tests.video_clip import clip, clip_frames, clip_soundtrack

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

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "max_tokens": 16}
LONG = {"temperature": 0, "max_tokens": 160, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(omni_chat_server):
    return omni_chat_server.grpc_url


def _engine(server, model: str) -> dict:
    return json.loads((Path(server.repository) / model / "engine.json").read_text())


def _running(server, model: str) -> float:
    return metric(server.metrics(), "omni_llm_engine_running_requests", model)


def _generated(server, model: str) -> float:
    return metric(server.metrics(), "omni_llm_generation_tokens_total", model)


# --- text ---------------------------------------------------------------------------

def test_text_only_streams_text_and_skips_the_speech_stages(url, omni_chat_server):
    talker_before = _generated(omni_chat_server, "talker")
    result = run_omni(url, text="hello there", sampling=GREEDY)
    assert result.error is None
    assert len(result.deltas) > 1 and result.text.strip()
    assert result.chunks == [] and result.images == []
    assert result.finish_reason in ("length", "stop")
    assert result.metrics["time_to_first_token_s"] < result.metrics["total_s"]
    assert set(result.metrics["stage_seconds"]) == {"thinker"}
    assert _generated(omni_chat_server, "talker") == talker_before


def test_the_thinker_gets_the_same_prompt_as_the_llm_model(url, omni_chat_server):
    """Text-only omni equals the plain `llm` model given the orchestrator's chat prompt."""
    from .llm_io import run as run_llm

    cfg = OrchestratorConfig.model_validate(_engine(omni_chat_server, "omni"))
    prompt = ChatPrompt.load(cfg.tokenizer).render(cfg.system_prompt, "hello there")
    direct = run_llm(url, prompt, stream=False, sampling=GREEDY)
    assert run_omni(url, text="hello there", sampling=GREEDY).text == direct.text


# --- media in: the answer equals Qwen2.5-Omni in transformers, token for token ------------
# Reference: transformers' Qwen2_5OmniForConditionalGeneration (its thinker, greedy, fp32) on
# the same checkpoint folder, with inputs built by the checkpoint's own Qwen2_5OmniProcessor.

@pytest.fixture(scope="module")
def reference(omni_chat_server):
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

    torch.set_num_threads(1)
    path = _engine(omni_chat_server, "llm")["model"]
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return {"thinker": model.thinker, "processor": Qwen2_5OmniProcessor.from_pretrained(path),
            "system": OrchestratorConfig.model_validate(_engine(omni_chat_server, "omni")).system_prompt}


def _reference_ids(ref, user_text: str, image: bytes | None = None,
                   audio: np.ndarray | None = None, max_tokens: int = GREEDY["max_tokens"],
                   video: bytes | None = None, use_audio_in_video: bool = False) -> list[int]:
    parts = ([{"type": "audio"}] if audio is not None else []) + (
        [{"type": "image"}] if image is not None else []) + (
        [{"type": "video"}] if video is not None else [])
    messages = [{"role": "system", "content": [{"type": "text", "text": ref["system"]}]},
                {"role": "user", "content": [*parts, *([{"type": "text", "text": user_text}]
                                                       if user_text else [])]}]
    processor = ref["processor"]
    heard = {"use_audio_in_video": True} if use_audio_in_video else {}
    if use_audio_in_video:  # the clip's sound, as the caller of the processor passes it
        audio = clip_soundtrack(video)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                           **heard)
    inputs = processor(text=prompt, return_tensors="pt",
                       images=[Image.open(io.BytesIO(image)).convert("RGB")] if image else None,
                       audio=[audio] if audio is not None else None,
                       videos=[clip_frames(processor, video, fps=2.0)] if video else None, **heard)
    with torch.no_grad():
        out = ref["thinker"].generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                      **heard)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


CASES = {
    "text": {},
    "text + image": {"image": png(100, 80)},
    "text + resized image": {"image": png(300, 200, seed=2)},  # the processor resizes it
    "text + audio": {"audio": tone(1.0, freq=330.0)},
    "text + image + audio": {"image": png(300, 200, seed=2), "audio": tone(1.5, freq=220.0)},
    "audio alone": {"audio": tone(1.0, freq=330.0), "question": ""},  # a spoken turn
    # 2.5 s at 10 fps, 64x64: 4 frames at 2 a second, resized to 112x112, 2 x 4 x 4 tokens
    "text + video": {"video": clip(fps=10, frames=25, size=(64, 64))},
    # beside a video the image goes to the thinker as its file too (not the encoder stage)
    "text + image + video": {"image": png(100, 80), "video": clip(fps=10, frames=25, size=(96, 64))},
}


@pytest.mark.parametrize("case", CASES)
def test_the_reply_equals_qwen25_omni_in_transformers(url, reference, case):
    media = CASES[case]
    question = media.get("question", "what do you see and hear?")
    want = _reference_ids(reference, question, media.get("image"), media.get("audio"),
                          video=media.get("video"))
    result = run_omni(url, text=question, sampling=GREEDY, image=media.get("image"),
                      audio=wav(media["audio"]) if "audio" in media else None,
                      video=media.get("video"))
    assert result.error is None, result.error
    tokens = reference["processor"].tokenizer.decode(want, skip_special_tokens=True)
    # a reply cut by max_tokens inside a character: vLLM's streamed detokenizer holds its
    # first bytes back, a whole decode shows them as U+FFFD
    assert result.text.rstrip("\ufffd") == tokens.rstrip("\ufffd")
    assert result.metrics["usage"]["completion_tokens"] == len(want)


def test_a_clip_heard_with_its_sound_equals_qwen25_omni_in_transformers(url, reference):
    """use_audio_in_video: a 3 s clip (10 fps, 64x64) with a chirp (AAC): 6 frames at 2 a
    second, 3 x 12 x 12 video tokens, and 77 audio tokens interleaved with them in 2 s
    chunks (50 position ids). Its reply is transformers' with the flag; without the flag,
    the same clip's reply is the silent one, and the two differ."""
    data = clip(fps=10, frames=30, size=(64, 64), sound="chirp")
    question = "what do you see and hear?"
    want = _reference_ids(reference, question, video=data, use_audio_in_video=True)
    deaf = _reference_ids(reference, question, video=data)
    assert want != deaf, "the soundtrack does not change transformers' reply: no test"
    decode = reference["processor"].tokenizer.decode
    heard = run_omni_hearing(url, True, text=question, sampling=GREEDY, video=data)
    assert heard.error is None, heard.error
    assert heard.text == decode(want, skip_special_tokens=True)
    assert heard.metrics["usage"]["completion_tokens"] == len(want)
    silent = run_omni_hearing(url, False, text=question, sampling=GREEDY, video=data)
    assert silent.error is None, silent.error
    assert silent.text == decode(deaf, skip_special_tokens=True)
    # the default (the processor's: False) is the silent reply too
    assert run_omni(url, text=question, sampling=GREEDY, video=data).text == silent.text


def test_vllm_backends_image_input_on_the_thinker_equals_transformers(url, reference):
    """vllm_backend's `image` (base64 bytes) on the thinker's own `llm` model: vLLM's
    Qwen2.5-Omni processor takes the raw image, and the greedy reply is transformers'."""
    import base64

    import tritonclient.grpc as grpcclient

    from .llm_io import Stream, llm_inputs

    image = png(300, 200, seed=2)  # the processor resizes it
    question = "what do you see?"
    want = _reference_ids(reference, question, image)
    messages = [{"role": "system", "content": [{"type": "text", "text": reference["system"]}]},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = reference["processor"].apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=False)
    inputs = llm_inputs(prompt, stream=False, sampling=GREEDY)
    tensor = grpcclient.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([base64.b64encode(image)], dtype=object))
    s = Stream(url)
    try:
        s.send([*inputs, tensor])
        result = s.collect()
    finally:
        s.close()
    assert result.error is None, result.error
    assert result.text == reference["processor"].tokenizer.decode(want, skip_special_tokens=True)
    assert result.num_output_tokens == len(want)


def test_the_media_matter(url):
    question = "what is in the picture?"
    replies = {run_omni(url, text=question, image=png(100, 80, seed=s), sampling=GREEDY).text
               for s in (0, 1)}
    replies.add(run_omni(url, text=question, sampling=GREEDY).text)
    assert len(replies) == 3


@pytest.mark.parametrize("concurrency", [2, 4])
def test_concurrent_media_requests_answer_as_each_alone(url, concurrency):
    from concurrent.futures import ThreadPoolExecutor

    requests = [dict(text=f"question {i}?", image=png(120 + 40 * i, 90, seed=i),
                     audio=wav(tone(0.5 + 0.25 * i, freq=200.0 + 50 * i)) if i % 2 else None,
                     video=clip(frames=15 + 5 * i) if i % 2 == 0 else None,
                     sampling=GREEDY) for i in range(concurrency)]
    alone = [run_omni(url, **r).text for r in requests]
    with ThreadPoolExecutor(concurrency) as pool:
        together = list(pool.map(lambda r: run_omni(url, **r).text, requests))
    assert together == alone and all(alone)


def test_speech_chunks_arrive_before_the_text_is_finished(url):
    """Pipelined: audio comes out while the thinker still writes (a long reply, then cancel)."""
    assert len(audio_amid_text(url).text) > 0


def test_speech_out_is_playable_audio_with_its_metrics(url, tmp_path):
    result = run_omni(url, text="tell me a story", modalities=["text", "audio"],
                      sampling={"temperature": 0, "max_tokens": 48, "ignore_eos": True}, seed=7,
                      return_codec_ids=True)
    assert result.error is None, result.error
    # every code voiced once: 480 samples a code (2 mel frames x 240)
    assert result.sample_rate == 24000 and result.audio.size == 480 * len(result.codec_ids) > 0
    audio = result.audio
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0 and audio.std() > 1e-3
    m = result.metrics
    assert m["audio_seconds"] == pytest.approx(audio.size / 24000, abs=1e-3)
    assert m["time_to_first_audio_s"] < m["total_s"] and m["audio_rtf"] > 0
    assert {"thinker", "talker", "audio_decoder"} <= set(m["stage_seconds"])
    # playable: a WAV file of the chunks reads back as the same samples
    path = tmp_path / "reply.wav"
    sf.write(path, audio, result.sample_rate)
    back, rate = sf.read(path, dtype="float32")
    assert rate == 24000 and back.shape == audio.shape


def test_image_output_is_a_png_of_the_requested_size(url):
    result = run_omni(url, text="draw a cat", modalities=["text", "image"], sampling=GREEDY, seed=3)
    assert result.error is None, result.error
    (image,) = result.images
    assert Image.open(io.BytesIO(image)).size == (64, 64)
    assert result.kinds[-1] == "image"


def test_the_omni_metrics_reach_prometheus(url, omni_chat_server):
    run_omni(url, text="hi", modalities=["audio"], sampling=GREEDY)
    text = omni_chat_server.metrics()
    assert metric(text, "omni_time_to_first_audio_seconds_count", "omni") >= 1
    assert metric(text, "omni_audio_real_time_factor_count", "omni") >= 1
    assert metric(text, "omni_stage_latency_seconds_count", "omni", stage="talker") >= 1


# --- failures and cancellation ------------------------------------------------------

def _expect_error(result, code: str, *fragments: str) -> str:
    assert result.error is not None, "expected an error"
    assert error_code(result.error) == code, result.error
    for fragment in fragments:
        assert fragment in result.error.message(), result.error.message()
    return result.error.message()


@pytest.mark.parametrize("kwargs,code,fragments", [
    (dict(sampling={"max_tokenz": 5}), "INVALID_ARG",
     ("stage 'thinker' (model llm) failed", "sampling_parameters.max_tokenz: unknown sampling")),
    (dict(modalities=["audio"], voice="Nobody", sampling=GREEDY), "INVALID_ARG",
     ("voice: unknown voice 'Nobody'", "Chelsie", "Ethan")),
    (dict(image=b"\x89PNG\r\n\x1a\n this is not a png"), "INVALID_ARG",
     ("stage 'image_encoder' (model image_encoder) failed", "media:")),
    (dict(audio=b"RIFF....WAVE but not really"), "INVALID_ARG",
     ("stage 'audio_encoder' (model audio_encoder) failed", "media:")),
    (dict(image=wav(tone(0.2))), "INVALID_ARG", ("stage 'image_encoder'", "media:")),
    (dict(modalities=["video"]), "INVALID_ARG", ("modalities: unknown or unavailable",)),
    (dict(text=""), "INVALID_ARG", ("text_input: is required",)),
])
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(url, kwargs, code, fragments):
    _expect_error(run_omni(url, **kwargs), code, *fragments)
    assert run_omni(url, text="still there?", sampling=GREEDY).error is None


def test_absurd_image_sizes_are_rejected_before_decoding(url):
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, "PNG")  # 400 megapixels, a few kB on the wire
    message = _expect_error(run_omni(url, image=buf.getvalue()), "INVALID_ARG",
                            "stage 'image_encoder'", "media:")
    assert "400000000 pixels" in message and "limit is" in message
    assert run_omni(url, text="still there?", sampling=GREEDY).error is None


def test_cancelling_mid_stream_stops_every_engine(url, omni_chat_server):
    server = omni_chat_server
    thinker_before = _generated(server, "llm")
    talker_before = _generated(server, "talker")
    long = {"temperature": 0, "max_tokens": 1500, "ignore_eos": True}
    stream = OmniStream(url)
    stream.send(omni_inputs("speak for a long time", modalities=["audio"], sampling=long))
    response, error = stream.next(timeout=60)  # the first text: the thinker runs
    assert error is None, error
    # until the talker runs too (its first segment is 8 tokens, so that takes ~0.1 s); at most
    # 1.5 s, while the thinker is still far from its 1500 tokens (~300 tokens/s here)
    deadline = time.monotonic() + 1.5
    while _running(server, "talker") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    sent = OmniResult()  # what had reached the client when it cancelled
    absorb(sent, response)
    stream.received(sent)
    stream.close(cancel=True)
    idle = wait_idle(server, ("llm", "talker"), ("omni",))
    assert not any(idle.values()), idle  # so no token comes after the counts below
    thinker_tokens = _generated(server, "llm")
    talker_codes = _generated(server, "talker")
    # Both engines stopped early (the whole reply would be 1500 tokens and ~6000 codes): of
    # what the thinker had left when the client cancelled, it generated less than half.
    limit = cancel_limit(len(sent.deltas), long["max_tokens"])
    assert 0 < thinker_tokens - thinker_before < limit, len(sent.deltas)
    assert talker_codes - talker_before < long["max_tokens"] * 4 / 2
    assert run_omni(url, text="still there?", sampling=GREEDY).error is None


def test_llm_and_text_to_image_answer_on_their_own(url):
    from .llm_io import run as run_llm

    assert run_llm(url, "hello", stream=False, sampling=GREEDY).num_output_tokens > 0
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    prompt = grpcclient.InferInput("prompt", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[b"a red square"]], dtype=object))
    out = client.infer("text_to_image", [prompt], outputs=[grpcclient.InferRequestedOutput("image")])
    assert Image.open(io.BytesIO(out.as_numpy("image")[0, 0])).size == (64, 64)


def test_a_stage_error_is_not_a_hang(url):
    """An INVALID request to the talker surfaces quickly (no stage waits forever)."""
    t0 = time.monotonic()
    result = run_omni(url, modalities=["audio"], voice="Nobody", sampling=GREEDY)
    assert isinstance(result.error, InferenceServerException)
    assert time.monotonic() - t0 < 30

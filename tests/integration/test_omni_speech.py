"""Speech out of omni-chat equals Qwen2.5-Omni in transformers (real tritonserver, tiny checkpoint).

Reference: `Qwen2_5OmniForConditionalGeneration.generate(return_audio=True,
thinker_do_sample=False, talker_do_sample=False, speaker=...)` in fp32 after
`torch.manual_seed(seed)`. transformers 5.x drops an all-ones attention mask
before the talker's forward, and without a mask that forward skips the
talker's own rope index and its codec pad/bos inputs (a padded batch keeps
them); the reference passes the mask through, so it runs the talker as the
model defines it and as a padded batch runs it.
"""
from __future__ import annotations

import functools
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from omni_serve.orchestrator.config import OrchestratorConfig
from tests.video_clip import clip, clip_frames, clip_soundtrack

from .omni_io import error_code, png, run_omni, run_omni_hearing, tone, wav
from .servers import loaded

pytestmark = pytest.mark.integration

THINKER = {"temperature": 0, "max_tokens": 12}
TALKER = {"temperature": 0, "max_tokens": 40}
# The streamed goldens measure chunk seams: 40 codes are under the family's first chunk
# (48), so they go through an orchestrator over the same stages whose first chunk is 12.
SEAMS = "omni_seams"
SEED = 5
STREAMED_SNR_DB = 60.0  # measured 91-96 dB on the tiny default (see docs/omni-chat.md)


@pytest.fixture(scope="module")
def url(omni_chat_server):
    return omni_chat_server.grpc_url


@pytest.fixture(scope="module")
def seams(omni_chat_server, tmp_path_factory) -> str:
    """The preset's `omni` as `omni_seams`, first_chunk_codes 12, loaded beside it."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    root = tmp_path_factory.mktemp("seams")
    shutil.copytree(omni_chat_server.repository / "omni", root / SEAMS)
    engine = json.loads((root / SEAMS / "engine.json").read_text())
    (root / SEAMS / "engine.json").write_text(json.dumps({**engine, "first_chunk_codes": 12}))
    path = root / SEAMS / "config.pbtxt"
    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    config.name = SEAMS
    path.write_text(text_format.MessageToString(config))
    with loaded(omni_chat_server, root, [SEAMS]):
        yield SEAMS


@pytest.fixture(scope="module")
def reference(omni_chat_server):
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

    torch.set_num_threads(1)
    repo = Path(omni_chat_server.repository)
    engine = json.loads((repo / "talker" / "engine.json").read_text())
    path = engine["model"]
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    forward = model.talker.forward

    @functools.wraps(forward)  # generate checks the signature
    def talker_forward(*args, **kwargs):
        if kwargs.get("attention_mask") is None:
            past = kwargs.get("past_key_values")
            x = kwargs["inputs_embeds"] if kwargs.get("inputs_embeds") is not None \
                else kwargs["input_ids"]
            seen = past.get_seq_length() if past is not None else 0
            kwargs["attention_mask"] = torch.ones(1, seen + x.shape[1], dtype=torch.long)
        return forward(*args, **kwargs)

    model.talker.forward = talker_forward
    codes: dict[str, list[int]] = {}
    generate = model.talker.generate

    def talker_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        codes["last"] = out[0, kwargs["input_ids"].shape[1]:].tolist()
        return out

    model.talker.generate = talker_generate
    system = OrchestratorConfig.model_validate(
        json.loads((repo / "omni" / "engine.json").read_text())).system_prompt
    return {"model": model, "processor": Qwen2_5OmniProcessor.from_pretrained(path),
            "system": system, "codes": codes}


def _reference(ref, text: str, voice: str, image: bytes | None = None,
               audio: np.ndarray | None = None, video: bytes | None = None,
               use_audio_in_video: bool = False) -> tuple[str, list[list[int]], np.ndarray]:
    """(reply text, codec ids as [frames][1], waveform) of transformers' generate(return_audio=True)."""
    processor = ref["processor"]
    heard = {"use_audio_in_video": True} if use_audio_in_video else {}
    if audio is not None:  # what the server gets: the samples of the WAV file it is sent
        audio, _ = sf.read(io.BytesIO(wav(audio)), dtype="float32")
    if use_audio_in_video:  # the clip's sound, as the caller of the processor passes it
        audio = clip_soundtrack(video)
    parts = ([{"type": "audio"}] if audio is not None and not heard else []) + (
        [{"type": "image"}] if image is not None else []) + (
        [{"type": "video"}] if video is not None else [])
    messages = [{"role": "system", "content": [{"type": "text", "text": ref["system"]}]},
                {"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                           **heard)
    inputs = processor(text=prompt, return_tensors="pt",
                       images=[Image.open(io.BytesIO(image)).convert("RGB")] if image else None,
                       audio=[audio] if audio is not None else None,
                       videos=[clip_frames(processor, video, fps=2.0)] if video else None, **heard)
    for pixels in ("pixel_values", "pixel_values_videos"):
        if pixels in inputs:  # generate would hand them to the talker too, which refuses them
            inputs[f"thinker_{pixels}"] = inputs.pop(pixels)
    return _generate(ref, inputs, voice, **heard)


def _served(url: str, text: str, voice: str, *, stream_audio: bool, image=None, audio=None,
            video=None, model: str = "omni"):
    return run_omni(url, model, text=text, modalities=["text", "audio"], sampling=THINKER, seed=SEED,
                    voice=voice, talker_sampling=TALKER, stream_audio=stream_audio,
                    return_codec_ids=True, image=image, audio=wav(audio) if audio is not None else None,
                    video=video)


def _snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    return float(10 * np.log10((reference ** 2).sum() / ((test - reference) ** 2).sum()))


CASES = {
    "text": {},
    "text + image": {"image": png(100, 80)},
    "text + audio": {"audio": tone(1.0, freq=330.0)},
}


@pytest.mark.parametrize("voice", ["Chelsie", "Ethan"])
@pytest.mark.parametrize("case", CASES)
def test_speech_equals_qwen25_omni_in_transformers(url, seams, reference, case, voice):
    media = CASES[case]
    question = "tell me what you see and hear"
    want_text, want_codes, want_wave = _reference(reference, question, voice, **media)
    assert want_codes, "the reference talker produced no codes"

    whole = _served(url, question, voice, stream_audio=False, **media)
    assert whole.error is None, whole.error
    assert whole.text == want_text
    assert whole.codec_ids == want_codes
    assert len(whole.chunks) == 1
    assert whole.audio.shape == want_wave.shape
    assert np.abs(whole.audio - want_wave).max() < 1e-4

    streamed = _served(url, question, voice, stream_audio=True, model=seams, **media)
    assert streamed.error is None, streamed.error
    assert streamed.codec_ids == want_codes
    assert streamed.audio.shape == want_wave.shape
    assert _snr_db(want_wave, streamed.audio) > STREAMED_SNR_DB


@pytest.mark.parametrize("media", [
    {"video": clip(fps=10, frames=25, size=(64, 64))},
    # beside a video the image goes raw to the thinker too: its grid comes from the processor
    {"image": png(100, 80), "video": clip(fps=10, frames=15, size=(96, 64))},
], ids=["video", "image + video"])
def test_speech_about_a_video_equals_qwen25_omni_in_transformers(url, reference, media):
    """The talker's positions follow the clip's grid at 1 s a temporal step (2 frames at 2 a
    second): its codes and waveform are transformers'."""
    question = "tell me what happens"
    want_text, want_codes, want_wave = _reference(reference, question, "Chelsie", **media)
    assert want_codes, "the reference talker produced no codes"
    whole = _served(url, question, "Chelsie", stream_audio=False, **media)
    assert whole.error is None, whole.error
    assert whole.text == want_text
    assert whole.codec_ids == want_codes
    assert whole.audio.shape == want_wave.shape
    assert np.abs(whole.audio - want_wave).max() < 1e-4


def test_speech_about_a_clip_heard_with_its_sound_equals_qwen25_omni_in_transformers(url,
                                                                                  reference):
    """use_audio_in_video: the talker's positions interleave the clip's frames and its
    sound's tokens in 2 s chunks, as the thinker's do: codes and waveform are transformers'.
    Its 12th code is 2, the thinker's text eos in the checkpoint's generation_config.json,
    which the talker must speak on (it stops on its codec pad and end only)."""
    data = clip(fps=10, frames=30, size=(64, 64), sound="chirp")
    question = "tell me what happens"
    want_text, want_codes, want_wave = _reference(reference, question, "Chelsie", video=data,
                                                  use_audio_in_video=True)
    assert want_codes, "the reference talker produced no codes"
    whole = run_omni_hearing(url, True, text=question, modalities=["text", "audio"],
                             sampling=THINKER, seed=SEED, voice="Chelsie",
                             talker_sampling=TALKER, stream_audio=False,
                             return_codec_ids=True, video=data)
    assert whole.error is None, whole.error
    assert whole.text == want_text
    assert whole.codec_ids == want_codes
    assert whole.audio.shape == want_wave.shape
    assert np.abs(whole.audio - want_wave).max() < 1e-4


def test_the_voices_sound_different(url):
    a, b = (_served(url, "say something", s, stream_audio=False) for s in ("Chelsie", "Ethan"))
    assert a.error is None and b.error is None
    assert a.audio.shape == b.audio.shape and np.abs(a.audio - b.audio).max() > 1e-2


@pytest.mark.parametrize("concurrency", [2, 4])
def test_concurrent_speech_equals_each_alone(url, concurrency):
    requests = [dict(text=f"question number {i}?", voice=("Chelsie", "Ethan")[i % 2],
                     stream_audio=bool(i % 2)) for i in range(concurrency)]
    alone = [_served(url, **r) for r in requests]
    with ThreadPoolExecutor(concurrency) as pool:
        together = list(pool.map(lambda r: _served(url, **r), requests))
    for a, b in zip(alone, together, strict=True):
        assert a.error is None and b.error is None
        assert a.codec_ids and b.codec_ids == a.codec_ids and b.text == a.text
        assert b.audio.shape == a.audio.shape and np.abs(b.audio - a.audio).max() < 1e-4


def test_an_unknown_voice_is_invalid_and_names_the_known_ones(url):
    result = _served(url, "hello", "Nobody", stream_audio=False)
    assert error_code(result.error) == "INVALID_ARG"
    message = str(result.error)
    assert "voice" in message and "Chelsie" in message and "Ethan" in message
    assert run_omni(url, text="still serving?", sampling=THINKER).error is None


def test_an_openai_voice_speaks_with_its_mapped_voice(url):
    alloy = _served(url, "say something", "alloy", stream_audio=False)
    chelsie = _served(url, "say something", "Chelsie", stream_audio=False)
    assert alloy.error is None, alloy.error
    assert alloy.codec_ids == chelsie.codec_ids
    assert np.abs(alloy.audio - chelsie.audio).max() < 1e-4


def test_reading_text_aloud_voices_it(url):
    result = run_omni(url, text="the cat sat on the mat", task="speech", seed=SEED,
                      talker_sampling=TALKER, return_codec_ids=True, stream_audio=False)
    assert result.error is None, result.error
    assert result.codec_ids and result.audio.size == len(result.codec_ids) * 480
    other = run_omni(url, text="a different sentence to read", task="speech", seed=SEED,
                     talker_sampling=TALKER, return_codec_ids=True, stream_audio=False)
    assert other.codec_ids != result.codec_ids


def test_a_speech_timeline_names_each_stage_that_ran_in_order(url):
    result = run_omni(url, text="tell me about the sea", modalities=["text", "audio"],
                      sampling=THINKER, seed=SEED, talker_sampling=TALKER, return_timeline=True)
    assert result.error is None, result.error
    timeline = result.metrics["timeline"]
    calls = timeline["calls"]
    decoders = [c for c in calls if c["stage"] == "audio_decoder"]
    assert [c["stage"] for c in calls] == ["thinker", "talker"] + ["audio_decoder"] * len(decoders)
    assert len(decoders) == len(result.chunks) >= 1
    for call in calls:
        assert 0 <= call["sent_s"] <= call["first_s"] <= call["last_s"] <= timeline["end_s"]
    thinker, talker = calls[:2]
    assert thinker["first_s"] <= talker["sent_s"] and talker["first_s"] <= decoders[0]["sent_s"]
    outs = [s["at_s"] for s in timeline["steps"] if s["step"] == "audio_out"]
    assert len(outs) == len(result.chunks) and outs == sorted(outs)
    assert decoders[0]["last_s"] <= outs[0]
    assert "timeline" not in run_omni(url, text="tell me about the sea", sampling=THINKER).metrics


# --- audio in the history -------------------------------------------------------------

def _chat_reference(ref, chat: list[dict], audio: list[np.ndarray], voice: str,
                    ) -> tuple[str, list[list[int]], np.ndarray]:
    """_reference's (text, codec ids, waveform) for a whole chat after the system prompt,
    its audio parts' clips in `audio` (the samples of the WAV files the server is sent)."""
    processor = ref["processor"]
    messages = [{"role": "system", "content": [{"type": "text", "text": ref["system"]}]}, *chat]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, audio=audio or None, return_tensors="pt")
    return _generate(ref, inputs, voice)


def _generate(ref, inputs, voice: str, **kwargs) -> tuple[str, list[list[int]], np.ndarray]:
    """transformers' greedy generate(return_audio=True) on processor outputs: (reply text,
    codec ids as [frames][1] up to the talker's first stop code, waveform)."""
    model, processor = ref["model"], ref["processor"]
    cfg = model.config.talker_config
    stops = [cfg.tts_codec_pad_token_id, cfg.tts_codec_end_token_id]
    torch.manual_seed(SEED)
    with torch.no_grad():
        seq, waveform = model.generate(
            **inputs, speaker=voice, thinker_max_new_tokens=THINKER["max_tokens"],
            thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=TALKER["max_tokens"], talker_eos_token_id=stops, **kwargs)
    codes = ref["codes"]["last"]
    codes = codes[:next((i for i, c in enumerate(codes) if c in stops), len(codes))]
    reply = processor.tokenizer.decode(seq[0, inputs["input_ids"].shape[1]:],
                                       skip_special_tokens=True)
    return reply, [[c] for c in codes], waveform.numpy()  # one codebook: a code per frame


def test_speech_after_an_earlier_spoken_turn_equals_qwen25_omni_in_transformers(url, reference):
    """history [user: clip A + text, assistant: text], then a turn with clip B: the thinker
    hears both clips (A in its history turn), the talker's positions count both, and the
    text, codes and waveform are transformers' for the same chat; the reply differs from
    the one to the chat without A."""
    import base64

    first, second = wav(tone(1.2, freq=523.0)), wav(tone(0.8, freq=300.0))
    heard = [sf.read(io.BytesIO(data), dtype="float32")[0] for data in (first, second)]
    said, question = "I hear it.", "and this one?"
    chat = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "listen"}]},
            {"role": "assistant", "content": [{"type": "text", "text": said}]},
            {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": question}]}]
    want_text, want_codes, want_wave = _chat_reference(reference, chat, heard, "Ethan")
    unheard = [{"role": "user", "content": [{"type": "text", "text": "listen"}]}, *chat[1:]]
    assert want_text != _chat_reference(reference, unheard, heard[1:], "Ethan")[0], \
        "the earlier clip does not change transformers' reply: no test"
    assert want_codes, "the reference talker produced no codes"
    history = [{"role": "user", "content": [
                   {"type": "audio", "audio": base64.b64encode(first).decode()},
                   {"type": "text", "text": "listen"}]},
               {"role": "assistant", "content": said}]
    result = run_omni(url, "omni", text=question, modalities=["text", "audio"], sampling=THINKER,
                      seed=SEED, voice="Ethan", talker_sampling=TALKER, stream_audio=False,
                      return_codec_ids=True, audio=second, history=history)
    assert result.error is None, result.error
    assert result.text == want_text
    assert result.codec_ids == want_codes
    assert result.audio.shape == want_wave.shape
    assert np.abs(result.audio - want_wave).max() < 1e-4

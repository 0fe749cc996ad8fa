"""Audio out: every WAV a client gets is 16-bit PCM at the stage's rate, its header
carrying its real length (a streamed one an open-ended header), from one encoder
(omni_client.media.encode_audio). Read back with Python's `wave` module and with
soundfile; samples within one PCM16 step of the float stream."""
from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
import soundfile as sf
from fastapi.testclient import TestClient

from omni_client import ChatResult, ModelInfo, SpeechResult
from omni_client.errors import BadRequestError
from omni_client.media import (
    AUDIO_FORMATS,
    audio_format,
    encode_audio,
    streaming_wav_header,
    write_audio,
)
from omni_client.openai_server.app import create_app
from omni_client.types import AudioChunk, Final, TextDelta, Usage
from tests.wav_check import STEP, assert_pcm16_wav, assert_within_one_step, read_wave

from .test_openai_talker_options import FakeOmni

RATE = 24000


def speech(n: int = 4800, seed: int = 0) -> np.ndarray:
    """A tone with noise, plus values at and beyond full scale (clipped)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / RATE
    x = 0.6 * np.sin(2 * np.pi * 440 * t) + 0.2 * rng.standard_normal(n)
    x[:4] = [1.0, -1.0, 1.7, -3.0]
    return x.astype(np.float32)


# --- the encoder -------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [24000, 16000])
def test_wav_is_16_bit_pcm_with_its_real_length(rate):
    samples = speech(3001)

    assert_pcm16_wav(encode_audio(samples, rate, "wav"), samples, rate)


def test_pcm_is_the_wav_data_raw_little_endian():
    samples = speech()

    pcm = encode_audio(samples, RATE, "pcm")

    assert len(pcm) == 2 * samples.size
    assert_within_one_step(np.frombuffer(pcm, "<i2"), samples)
    assert encode_audio(samples, RATE, "wav").endswith(pcm)  # one quantizer for both


def test_a_streamed_wav_is_an_open_ended_header_then_the_pcm_chunks():
    samples = speech(4800)
    chunks = np.split(samples, [1000, 1001, 3500])

    header = streaming_wav_header(RATE)
    streamed = header + b"".join(encode_audio(c, RATE, "pcm") for c in chunks)

    whole = encode_audio(samples, RATE, "wav")
    assert len(header) == 44 and len(streamed) == len(whole)
    assert header[4:8] == header[40:44] == b"\xff\xff\xff\xff"  # sizes: unknown
    # the same file but for the two sizes
    assert streamed[8:40] == whole[8:40] and streamed[44:] == whole[44:]
    pcm, rate, frames = read_wave(streamed)  # `wave` reads on to the end of the data
    assert rate == RATE and frames == 0xFFFFFFFF // 2
    assert_within_one_step(pcm, samples)


@pytest.mark.parametrize("fmt, atol", [("flac", STEP), ("ogg", 0.2)])
def test_flac_and_ogg_round_trip(fmt, atol):
    samples = 0.5 * np.sin(2 * np.pi * 440 * np.arange(4800) / RATE).astype(np.float32)

    back, rate = sf.read(io.BytesIO(encode_audio(samples, RATE, fmt)), dtype="float32")

    assert rate == RATE and back.shape == samples.shape
    assert np.abs(back - samples).max() <= atol


@pytest.mark.parametrize(("args", "match"), [
    ((speech(), 24000, "mp3"), "^audio: unknown audio format 'mp3'"),
    ((speech(), 0, "wav"), "^audio: sample_rate must be a positive int"),
    ((speech(), 24000.0, "wav"), "sample_rate"),
    ((np.zeros((2, 10), np.float32), 24000, "wav"), "1-D"),
    ((np.array(["a"]), 24000, "wav"), "numeric"),
])
def test_encode_audio_rejects_bad_arguments(args, match):
    with pytest.raises(BadRequestError, match=match):
        encode_audio(*args)


def test_the_format_comes_from_the_suffix_or_is_refused_naming_the_field(tmp_path):
    assert [audio_format(f"x.{f.upper()}") for f in AUDIO_FORMATS] == list(AUDIO_FORMATS)
    assert audio_format("x.out", "flac") == "flac"
    with pytest.raises(BadRequestError, match=r"^--output: cannot tell .*'x\.mp3'.* or --format"):
        audio_format("x.mp3", field="--output", fmt_option="--format")
    with pytest.raises(BadRequestError, match="^path: unknown audio format 'mp3'"):
        write_audio(tmp_path / "x.wav", speech(), RATE, "mp3")


# --- the SDK's files -----------------------------------------------------------------------------


def test_the_sdk_saves_16_bit_pcm_wav(tmp_path):
    first, second = speech(2400, seed=1), speech(1200, seed=2)
    ChatResult.from_events([AudioChunk(first, RATE), AudioChunk(second, RATE)]).save_audio(
        tmp_path / "reply.wav")
    SpeechResult(first, RATE).save(tmp_path / "speech.WAV")

    assert_pcm16_wav((tmp_path / "reply.wav").read_bytes(), np.concatenate([first, second]),
                     RATE)
    assert_pcm16_wav((tmp_path / "speech.WAV").read_bytes(), first, RATE)
    SpeechResult(first, RATE).save(tmp_path / "speech.flac")
    back, rate = sf.read(tmp_path / "speech.flac", dtype="float32")
    assert rate == RATE and np.abs(back - np.clip(first, -1, 1)).max() <= STEP
    with pytest.raises(BadRequestError, match="cannot tell the audio format"):
        SpeechResult(first, RATE).save(tmp_path / "speech.mp3")


# --- omni-openai (a fake AsyncOmniClient behind it, no Triton) -----------------------------------

CHUNKS = [speech(2400, seed=3), speech(7, seed=4), speech(1900, seed=5)]
EVENTS = [TextDelta("Hi"), *(AudioChunk(c, RATE) for c in CHUNKS), Final("stop", Usage(3, 1))]
ALL = np.concatenate(CHUNKS)


@pytest.fixture
def client():
    app = create_app("triton:8001")
    front = app.state.front
    front.client = FakeOmni(EVENTS)
    front._models = (time.monotonic() + 3600, [ModelInfo("omni", "omni", "omni_orchestrator")])
    return TestClient(app)


def test_chat_audio_wav_is_16_bit_pcm_with_its_real_length(client):
    response = client.post("/v1/chat/completions", json={
        "model": "omni", "messages": [{"role": "user", "content": "hello"}],
        "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}})

    assert response.status_code == 200, response.text
    assert_pcm16_wav(base64.b64decode(response.json()["choices"][0]["message"]["audio"]["data"]),
                     ALL, RATE)


def _speech(client: TestClient, **body) -> bytes:
    response = client.post("/v1/audio/speech", json={"model": "omni", "voice": "alloy",
                                                     "input": "hello", **body})
    assert response.status_code == 200, response.text
    return response.content


def test_speech_wav_is_one_file_with_its_real_length(client):
    assert_pcm16_wav(_speech(client, response_format="wav"), ALL, RATE)
    assert_pcm16_wav(_speech(client), ALL, RATE)  # wav is the default


def test_speech_wav_streamed_on_request_keeps_the_open_ended_header(client):
    streamed = _speech(client, response_format="wav", stream_format="audio")
    assert streamed[:44] == streaming_wav_header(RATE)
    pcm, rate, _ = read_wave(streamed)
    assert rate == RATE
    assert_within_one_step(pcm, ALL)


def test_speech_pcm_stays_raw_16_bit(client):
    pcm = _speech(client, response_format="pcm")
    assert len(pcm) == 2 * ALL.size
    assert_within_one_step(np.frombuffer(pcm, "<i2"), ALL)

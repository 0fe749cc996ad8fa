"""omni-openai's speech extensions (talker_sampling_parameters, stream_audio,
return_codec_ids) and voices, mapped onto omni_client calls (a fake AsyncOmniClient,
no Triton)."""
from __future__ import annotations

import base64
import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from omni_client import ModelInfo
from omni_client.errors import BadRequestError
from omni_client.openai_server.app import create_app
from omni_client.types import AudioChunk, CodecIds, Final, TextDelta, Usage

EVENTS = [TextDelta("Hi"), CodecIds([[7, 70], [3, 30]]),
          AudioChunk(np.full(240, 0.1, np.float32), 24000), CodecIds([[5, 50]]),
          Final("stop", Usage(3, 1))]
FRAMES = [[7, 70], [3, 30], [5, 50]]  # [frames][groups]


class FakeOmni:
    """The AsyncOmniClient calls omni-openai makes, recorded; answers with `events`."""

    def __init__(self, events=EVENTS, error: Exception | None = None):
        self.events = events
        self.error = error
        self.calls: list[dict] = []

    async def stream(self, text, **kwargs):
        self.calls.append({"text": text, **kwargs})
        if self.error is not None:
            raise self.error
        for event in self.events:
            yield event


@pytest.fixture
def served():
    app = create_app("triton:8001")
    front = app.state.front
    front.client = FakeOmni()
    front._models = (time.monotonic() + 3600, [ModelInfo("omni", "omni", "omni_orchestrator")])
    return TestClient(app), front


def chat(client: TestClient, **body):
    payload = {"model": "omni", "messages": [{"role": "user", "content": "hello"}],
               "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
               **body}
    return client.post("/v1/chat/completions", json=payload)


def test_chat_passes_the_talker_extensions_and_the_voice_as_it_came(served):
    client, front = served
    response = chat(client, talker_sampling_parameters={"temperature": 0, "top_k": 5},
                    stream_audio=False, return_codec_ids=True)

    assert response.status_code == 200, response.text
    call = front.client.calls[0]
    assert call["talker_sampling"] == {"temperature": 0, "top_k": 5}
    assert call["stream_audio"] is False and call["return_codec_ids"] is True
    assert call["voice"] == "alloy"  # the orchestrator's voice_map maps it
    audio = response.json()["choices"][0]["message"]["audio"]
    assert audio["codec_ids"] == FRAMES and audio["transcript"] == "Hi"


def test_chat_without_the_extensions_sends_defaults_and_returns_no_codec_ids(served):
    client, front = served
    response = chat(client)

    call = front.client.calls[0]
    assert call["talker_sampling"] is None and call["stream_audio"] is None
    assert call["return_codec_ids"] is False
    assert "codec_ids" not in response.json()["choices"][0]["message"]["audio"]


def test_streamed_chat_sends_codec_ids_as_audio_deltas_in_order(served):
    client, _ = served
    response = chat(client, stream=True, audio={"voice": "echo", "format": "pcm16"},
                    return_codec_ids=True)

    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    audio = [c["choices"][0]["delta"].get("audio") for c in chunks if c["choices"]]
    codec = [a["codec_ids"] for a in audio if a and "codec_ids" in a]
    assert codec == [[[7, 70], [3, 30]], [[5, 50]]]
    assert any(a and "data" in a for a in audio)


def test_codec_ids_without_audio_are_a_400_naming_the_parameter(served):
    client, front = served
    response = client.post("/v1/chat/completions", json={
        "model": "omni", "messages": [{"role": "user", "content": "hi"}],
        "return_codec_ids": True})

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "return_codec_ids"
    assert not front.client.calls


def test_text_chat_does_not_send_the_talker_extensions(served):
    client, front = served
    client.post("/v1/chat/completions", json={
        "model": "omni", "messages": [{"role": "user", "content": "hi"}],
        "talker_sampling_parameters": {"temperature": 0.5}, "stream_audio": False})

    call = front.client.calls[0]
    assert call["modalities"] == ["text"]
    assert "talker_sampling" not in call and "stream_audio" not in call


@pytest.mark.parametrize("body,param", [
    ({"talker_sampling_parameters": [1]}, "talker_sampling_parameters"),
    ({"stream_audio": "maybe"}, "stream_audio"),
    ({"return_codec_ids": "please"}, "return_codec_ids"),
])
def test_malformed_extensions_are_a_400_naming_them(served, body, param):
    client, _ = served
    response = chat(client, **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_server_side_range_error_comes_back_as_a_400(served):
    client, front = served
    front.client = FakeOmni(error=BadRequestError(
        "talker_sampling_parameters.top_p: must be a number in (0, 1], got 3"))

    response = chat(client, talker_sampling_parameters={"top_p": 3})

    assert response.status_code == 400
    assert "talker_sampling_parameters.top_p" in response.json()["error"]["message"]


def test_speech_passes_the_talker_extensions(served):
    client, front = served
    response = client.post("/v1/audio/speech", json={
        "model": "omni", "input": "read this", "voice": "Nova", "response_format": "pcm",
        "talker_sampling_parameters": {"repetition_penalty": 1.2}, "stream_audio": False})

    assert response.status_code == 200, response.text
    call = front.client.calls[0]
    assert call["task"] == "speech" and call["voice"] == "Nova"
    assert call["talker_sampling"] == {"repetition_penalty": 1.2}
    assert call["stream_audio"] is False
    assert len(response.content) == 240 * 2  # pcm16 of the one chunk


def test_speech_has_no_codec_ids_extension(served):
    client, _ = served
    response = client.post("/v1/audio/speech", json={
        "model": "omni", "input": "read this", "voice": "alloy", "return_codec_ids": True})
    assert response.status_code == 400
    assert "unrecognized request argument supplied: return_codec_ids" in (
        response.json()["error"]["message"])


def test_the_openai_client_sends_the_extensions_through_extra_body(served):
    openai = pytest.importorskip("openai")
    client, front = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    completion = api.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "hello"}],
        modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"},
        extra_body={"talker_sampling_parameters": {"temperature": 0},
                    "stream_audio": False, "return_codec_ids": True})

    call = front.client.calls[0]
    assert call["talker_sampling"] == {"temperature": 0} and call["return_codec_ids"] is True
    audio = completion.choices[0].message.audio
    assert audio.model_extra["codec_ids"] == FRAMES
    assert base64.b64decode(audio.data)[:4] == b"RIFF"


def test_vllm_sampling_extensions_reach_the_thinker_as_sent(served):
    """What AIPerf sends with `--extra-inputs ignore_eos:true` and friends."""
    client, front = served
    extensions = {"ignore_eos": True, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                  "min_tokens": 4, "stop_token_ids": [7], "skip_special_tokens": False,
                  "include_stop_str_in_output": True}
    response = client.post("/v1/chat/completions", json={
        "model": "omni", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
        **extensions})

    assert response.status_code == 200, response.text
    assert front.client.calls[0]["sampling_parameters"] == {"max_tokens": 9, **extensions}


@pytest.mark.parametrize("body,param", [
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids.0"), ({"best_of_all": 2}, "best_of_all"),
])
def test_bad_sampling_extensions_are_a_400_naming_them(served, body, param):
    client, front = served
    response = client.post("/v1/chat/completions", json={
        "model": "omni", "messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    assert not front.client.calls

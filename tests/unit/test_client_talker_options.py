"""The SDK's talker options and codec ids: input tensors, response events, results, and the
sync and asyncio clients in step (fake transports, no server)."""
from __future__ import annotations

import asyncio
import inspect
import json

import numpy as np
import pytest

from omni_client import AsyncOmniClient, CodecIds, OmniClient, _calls
from omni_client import _pipeline_io as pio
from omni_client import aio as aio_module
from omni_client.errors import BadRequestError
from omni_client.types import AudioChunk, ChatResult, Final, TextDelta
from omni_serve.contract import OMNI, OMNI_CONTRACT
from tests.unit.test_client_pipelines import (
    DIT_CONFIG,
    LLM_CONFIG,
    OMNI_CONFIG,
    OMNI_STREAM,
    FakeServer,
    client_over,
    infer_result,
    tensor_values,
    tone,
)

CODEC_FRAMES = [[7, 70], [3, 30], [5, 50]]  # [frames][groups] across the stream
CODEC_STREAM = [
    (infer_result(OMNI_CONTRACT, {OMNI.TEXT_OUTPUT: np.array([b"Hi"], object),
                                  OMNI.CODEC_IDS: np.array([[7, 70], [3, 30]], np.int64)}), None),
    (infer_result(OMNI_CONTRACT, {OMNI.AUDIO_CHUNK: tone(240),
                                  OMNI.SAMPLE_RATE: np.array([24000], np.int32),
                                  OMNI.CODEC_IDS: np.array([[5, 50]], np.int64)}), None),
    (infer_result(OMNI_CONTRACT, {OMNI.FINISH_REASON: np.array([b"stop"], object),
                                  OMNI.METRICS: np.array([b"{}"], object)}, final=True), None),
]


# --- input tensors -------------------------------------------------------------------

def test_the_talker_options_become_their_contract_tensors():
    tensors = pio.omni_inputs("hi", modalities=["text", "audio"],
                              talker_sampling={"temperature": 0, "top_k": 5},
                              stream_audio=False, return_codec_ids=True)

    by_name = {t.name(): t for t in tensors}
    for name in (OMNI.TALKER_SAMPLING_PARAMETERS, OMNI.STREAM_AUDIO, OMNI.RETURN_CODEC_IDS):
        assert by_name[name].datatype() == OMNI_CONTRACT.input(name).wire_dtype
        assert by_name[name].shape() == [1]
    values = tensor_values(tensors)
    assert json.loads(values[OMNI.TALKER_SAMPLING_PARAMETERS][0]) == {"temperature": 0,
                                                                       "top_k": 5}
    assert values[OMNI.STREAM_AUDIO].dtype == np.bool_ and not values[OMNI.STREAM_AUDIO][0]
    assert values[OMNI.RETURN_CODEC_IDS][0]


def test_unset_talker_options_send_nothing():
    names = {t.name() for t in pio.omni_inputs("hi", talker_sampling={}, stream_audio=None,
                                               return_codec_ids=False)}
    assert names == {OMNI.TEXT_INPUT}
    # stream_audio=True is sent as given; the server's default is the same
    values = tensor_values(pio.omni_inputs("hi", stream_audio=True))
    assert values[OMNI.STREAM_AUDIO][0]


@pytest.mark.parametrize("kwargs,message", [
    (dict(talker_sampling=[("temperature", 1)]), "talker_sampling must be a dict"),
    (dict(talker_sampling={"temperature": float("nan")}), "talker_sampling must be JSON"),
    (dict(stream_audio="no"), "stream_audio must be True, False or None"),
    (dict(return_codec_ids=1), "return_codec_ids must be True, False or None"),
])
def test_bad_talker_options_are_bad_requests(kwargs, message):
    with pytest.raises(BadRequestError, match=message):
        pio.omni_inputs("hi", **kwargs)


def test_codec_ids_are_requested_only_when_asked_for():
    plain = _calls.prepare_stream("omni", OMNI_CONFIG, "hi")
    asked = _calls.prepare_stream("omni", OMNI_CONFIG, "hi", modalities=["text", "audio"],
                                  return_codec_ids=True)
    assert OMNI.CODEC_IDS not in {o.name() for o in plain.outputs}
    assert OMNI.CODEC_IDS in {o.name() for o in asked.outputs}
    assert tensor_values(asked.inputs)[OMNI.RETURN_CODEC_IDS][0]


@pytest.mark.parametrize("config,kind", [(LLM_CONFIG, "llm"), (DIT_CONFIG, "image")])
@pytest.mark.parametrize("kwargs", [dict(talker_sampling={"temperature": 0}),
                                    dict(stream_audio=False), dict(return_codec_ids=True)])
def test_models_without_a_talker_refuse_the_talker_options(config, kind, kwargs):
    with pytest.raises(BadRequestError, match=f"is a {kind} model: it takes no "
                                              f"{next(iter(kwargs))}"):
        _calls.prepare_stream("m", config, "hi", **kwargs)


# --- responses and results -----------------------------------------------------------

def test_a_codec_ids_output_is_a_codec_ids_event_after_text_and_audio():
    events = pio.parse_omni(infer_result(OMNI_CONTRACT, {
        OMNI.TEXT_OUTPUT: np.array([b"x"], object), OMNI.CODEC_IDS: np.array([[4], [2]], np.int64)}))
    assert events == [TextDelta("x"), CodecIds([[4], [2]])]  # [frames][groups]
    assert all(type(i) is int for frame in events[1].frames for i in frame)


def test_chat_results_concatenate_the_codec_ids_and_default_to_none():
    result = ChatResult.from_events([CodecIds([[1], [2]]), TextDelta("a"), CodecIds([[3]]),
                                     Final("stop")])
    assert result.codec_ids == [[1], [2], [3]]
    assert ChatResult.from_events([TextDelta("a"), Final("stop")]).codec_ids == []


def test_the_sync_client_sends_the_options_and_gathers_the_codec_ids():
    fake = FakeServer(CODEC_STREAM)

    reply = client_over(fake).chat("hi", modalities=["text", "audio"], voice="alloy",
                                   talker_sampling={"top_p": 0.5}, stream_audio=False,
                                   return_codec_ids=True)

    values = tensor_values(fake.requests[0]["inputs"])
    assert json.loads(values[OMNI.TALKER_SAMPLING_PARAMETERS][0]) == {"top_p": 0.5}
    assert not values[OMNI.STREAM_AUDIO][0] and values[OMNI.RETURN_CODEC_IDS][0]
    assert values[OMNI.VOICE][0] == b"alloy"  # the orchestrator maps voices, not the SDK
    assert reply.codec_ids == CODEC_FRAMES and reply.text == "Hi" and reply.audio.size == 240


def test_sync_speech_passes_the_options_and_returns_the_codec_ids():
    fake = FakeServer(CODEC_STREAM)

    speech = client_over(fake).speech("read", voice="Ethan", talker_sampling={"temperature": 0},
                                      return_codec_ids=True)

    values = tensor_values(fake.requests[0]["inputs"])
    assert values[OMNI.TASK][0] == b"speech"
    assert json.loads(values[OMNI.TALKER_SAMPLING_PARAMETERS][0]) == {"temperature": 0}
    assert speech.codec_ids == CODEC_FRAMES
    plain = client_over(FakeServer(OMNI_STREAM)).speech("read")
    assert plain.codec_ids == []


# --- the asyncio client, in step -----------------------------------------------------

def _public(cls) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_")}


def test_both_clients_have_the_same_calls_with_the_same_arguments_and_defaults():
    sync, async_ = _public(OmniClient), _public(AsyncOmniClient)
    assert set(sync) == set(async_), set(sync) ^ set(async_)
    for name, signature in sync.items():
        params = [(p.name, p.kind, p.default, p.annotation)
                  for p in signature.parameters.values()]
        assert params == [(p.name, p.kind, p.default, p.annotation)
                          for p in async_[name].parameters.values()], name
    assert {"generate", "generate_stream", "generate_image", "stream", "speech"} <= set(sync)


def test_the_stream_and_image_options_are_what_the_requests_take():
    from omni_client import _calls, _pipeline_io
    from omni_client._base import ImageOptions, StreamOptions

    def keywords(fn) -> set[str]:
        return {p.name for p in inspect.signature(fn).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}

    assert set(StreamOptions.__annotations__) == keywords(_calls.prepare_stream)
    assert set(ImageOptions.__annotations__) == keywords(_pipeline_io.image_inputs)


def test_the_async_client_sends_the_options_and_gathers_the_codec_ids(monkeypatch):
    sent: list[dict] = []

    async def fake_stream_request(client, model, inputs, outputs, **kwargs):
        sent.append({"model": model, "inputs": inputs, "outputs": outputs})
        for result, _ in CODEC_STREAM:
            yield result

    monkeypatch.setattr(aio_module, "stream_request", fake_stream_request)

    async def scenario():
        client = AsyncOmniClient("triton:8001", strict_stream_errors=False)
        client._configs["omni"] = OMNI_CONFIG
        try:
            chat = await client.chat("hi", model="omni", modalities=["text", "audio"],
                                     talker_sampling={"max_tokens": 9}, stream_audio=False,
                                     return_codec_ids=True)
            speech = await client.speech("read", model="omni", return_codec_ids=True)
        finally:
            await client.close()
        return chat, speech

    chat, speech = asyncio.run(scenario())
    values = sent[0]["inputs"]  # numpy arrays by name, as omni_serve.grpc_stream takes them
    assert json.loads(values[OMNI.TALKER_SAMPLING_PARAMETERS][0]) == {"max_tokens": 9}
    assert not values[OMNI.STREAM_AUDIO][0] and values[OMNI.RETURN_CODEC_IDS][0]
    assert OMNI.CODEC_IDS in set(sent[0]["outputs"])  # output names
    assert chat.codec_ids == CODEC_FRAMES and speech.codec_ids == CODEC_FRAMES
    assert isinstance(chat, ChatResult) and isinstance(speech, AudioChunk)

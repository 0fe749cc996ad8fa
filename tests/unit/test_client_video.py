"""A video through the SDK and the CLI: a path or the file's bytes become the omni entry model's
`video` input, from the sync and asyncio clients and `omni-client chat --video` (fake
transports, no server)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omni_client import AsyncOmniClient, _calls
from omni_client import _pipeline_io as pio
from omni_client import aio as aio_module
from omni_client.errors import BadRequestError
from omni_client.media import video_bytes
from omni_serve.contract import OMNI, OMNI_CONTRACT
from tests.unit.test_client_pipelines import (
    DIT_CONFIG,
    LLM_CONFIG,
    OMNI_CONFIG,
    OMNI_STREAM,
    FakeServer,
    client_over,
    fake_client,  # noqa: F401 (a fixture)
    run_cli,
    tensor_values,
)

CLIP = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4  # what the SDK sends is these bytes


def test_a_video_may_be_a_path_or_the_files_bytes(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(CLIP)

    assert video_bytes(path) == CLIP
    assert video_bytes(str(path)) == CLIP
    assert video_bytes(CLIP) == CLIP
    assert video_bytes(bytearray(CLIP)) == CLIP
    assert video_bytes(memoryview(CLIP)) == CLIP


@pytest.mark.parametrize("value,message", [
    (b"", "^video: is empty"),
    (np.zeros((4, 8, 8, 3), np.uint8), "^video: expected a path or the video file's bytes, got ndarray"),
    (3, "^video: expected a path"),
])
def test_empty_or_unsupported_videos_are_rejected(value, message):
    with pytest.raises(BadRequestError, match=message):
        video_bytes(value)


def test_an_unreadable_video_path_names_the_field_and_the_path(tmp_path):
    with pytest.raises(BadRequestError, match=r"^--video: cannot read .*nope\.mp4"):
        video_bytes(tmp_path / "nope.mp4", field="--video")


def test_the_video_is_one_bytes_element_of_the_contracts_video_input():
    tensors = pio.omni_inputs("what happens?", video=CLIP)

    (tensor,) = [t for t in tensors if t.name() == OMNI.VIDEO]
    assert tensor.datatype() == OMNI_CONTRACT.input(OMNI.VIDEO).wire_dtype == "BYTES"
    assert tensor.shape() == [1]
    assert tensor_values(tensors)[OMNI.VIDEO][0] == CLIP
    assert OMNI.VIDEO not in {t.name() for t in pio.omni_inputs("hi")}


def test_an_omni_model_gets_the_video_beside_the_other_media(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(CLIP)

    prepared = _calls.prepare_stream("omni", OMNI_CONFIG, "hi", video=path, image=b"png",
                                     modalities=["text", "audio"])

    values = tensor_values(prepared.inputs)
    assert values[OMNI.VIDEO][0] == CLIP and values[OMNI.IMAGE][0] == b"png"


@pytest.mark.parametrize("config,kind", [(LLM_CONFIG, "llm"), (DIT_CONFIG, "image")])
def test_llm_and_image_models_refuse_a_video_naming_it(config, kind):
    with pytest.raises(BadRequestError, match=f"is a {kind} model: it takes no video"):
        _calls.prepare_stream("m", config, "hi", video=CLIP)


def test_the_sync_client_sends_the_video_on_chat():
    fake = FakeServer(OMNI_STREAM)

    reply = client_over(fake).chat("what happens?", video=CLIP, modalities=["text", "audio"])

    assert fake.requests[0]["model_name"] == "omni"
    assert tensor_values(fake.requests[0]["inputs"])[OMNI.VIDEO][0] == CLIP
    assert reply.text == "Hi there"


def test_the_async_client_sends_the_video_on_chat(monkeypatch, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(CLIP)
    sent: list[dict] = []

    async def fake_stream_request(client, model, inputs, outputs, **kwargs):
        sent.append(inputs)
        for result, _ in OMNI_STREAM:
            yield result

    monkeypatch.setattr(aio_module, "stream_request", fake_stream_request)

    async def scenario():
        client = AsyncOmniClient("triton:8001", strict_stream_errors=False)
        client._configs["omni"] = OMNI_CONFIG
        try:
            return await client.chat("what happens?", model="omni", video=str(path))
        finally:
            await client.close()

    reply = asyncio.run(scenario())
    assert bytes(sent[0][OMNI.VIDEO][0]) == CLIP
    assert reply.text == "Hi there"


def test_cli_chat_video_sends_the_path_to_the_sdk(fake_client, tmp_path):  # noqa: F811
    path = tmp_path / "clip.mp4"
    path.write_bytes(CLIP)

    code, out, _ = run_cli("chat", "what happens?", "--video", str(path))

    assert code == 0 and out == "Hello world\n"
    (client,) = fake_client.instances
    (name, args, kwargs), = client.calls
    assert (name, args) == ("stream", ("what happens?",))
    assert kwargs["video"] == str(path) and kwargs["image"] is None


# --- use_audio_in_video ------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [True, False])
def test_use_audio_in_video_is_a_bool_element_sent_only_when_given(flag):
    prepared = _calls.prepare_stream("omni", OMNI_CONFIG, "hi", video=CLIP,
                                     use_audio_in_video=flag)
    (tensor,) = [t for t in prepared.inputs if t.name() == OMNI.USE_AUDIO_IN_VIDEO]
    assert tensor.datatype() == OMNI_CONTRACT.input(OMNI.USE_AUDIO_IN_VIDEO).wire_dtype == "BOOL"
    assert tensor_values(prepared.inputs)[OMNI.USE_AUDIO_IN_VIDEO].tolist() == [flag]
    assert OMNI.USE_AUDIO_IN_VIDEO not in {t.name() for t in pio.omni_inputs("hi", video=CLIP)}
    with pytest.raises(BadRequestError, match="is a llm model: it takes no use_audio_in_video"):
        _calls.prepare_stream("m", LLM_CONFIG, "hi", use_audio_in_video=flag)


@pytest.mark.parametrize("args,flag", [(["--use-audio-in-video"], True),
                                       (["--no-use-audio-in-video"], False), ([], None)])
def test_cli_use_audio_in_video_goes_to_the_sdk(fake_client, tmp_path, args, flag):  # noqa: F811
    path = tmp_path / "clip.mp4"
    path.write_bytes(CLIP)

    code, _, _ = run_cli("chat", "what happens?", "--video", str(path), *args)

    assert code == 0
    (client,) = fake_client.instances
    (_, _, kwargs), = client.calls
    assert kwargs["use_audio_in_video"] is flag

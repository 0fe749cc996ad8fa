"""omni-openai against the real omni-chat stack, driven by the official `openai` package."""
from __future__ import annotations

import base64
import io
import json
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import soundfile as sf
from PIL import Image

from omni_client import OmniClient
from omni_client.media import streaming_wav_header
from omni_tools.server import OpenAIFrontend, free_port
from tests.integration.omni_io import png
from tests.wav_check import assert_pcm16_wav, read_wave

pytestmark = pytest.mark.integration

VOICE = "Ethan"  # a voice of the checkpoint
GREEDY = {"temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def client(openai_frontend):
    with openai.OpenAI(base_url=f"{openai_frontend}/v1", api_key="unused", max_retries=0,
                       timeout=180) as c:
        yield c


def _user(text: str, *parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def test_models_lists_the_entry_models_only(client):
    models = {m.id: m for m in client.models.list().data}
    assert {"omni", "llm", "text_to_image"} <= set(models)
    # stage models that only serve the pipeline are not offered
    assert not {"talker", "image_encoder", "audio_encoder", "audio_decoder"} & set(models)
    assert models["omni"].model_extra["kind"] == "omni"
    assert models["text_to_image"].model_extra["kind"] == "image"


def test_streamed_text_joins_into_the_whole_completion(client):
    kwargs = dict(model="omni", messages=_user("tell me a story"), max_tokens=20, **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True})
    deltas, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(deltas) > 1  # it streamed
    assert "".join(deltas) == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == finish == "length"
    assert whole.usage.completion_tokens == usage.completion_tokens == 20
    assert whole.usage.prompt_tokens == usage.prompt_tokens > 0


@pytest.mark.parametrize("model", ["omni", "llm"])
def test_vllm_sampling_extensions_reach_the_engine(client, model):
    """vLLM's OpenAI extensions, as AIPerf's --extra-inputs sends them: top_k 1 makes a
    temperature-1 sample the greedy reply, ignore_eos runs to max_tokens."""
    kwargs = dict(model=model, messages=_user("tell me a story"), max_tokens=16)
    greedy = client.chat.completions.create(**kwargs, temperature=0)
    sampled = [client.chat.completions.create(**kwargs, temperature=1.0, seed=s).choices[0]
               .message.content for s in (1, 2)]
    top1 = client.chat.completions.create(**kwargs, temperature=1.0, seed=1,
                                          extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    assert greedy.choices[0].message.content not in sampled  # so top_k is what made it greedy
    assert top1.usage.completion_tokens == 16 and top1.choices[0].finish_reason == "length"


def test_chat_with_audio_out_streamed_and_whole(client, omni_chat_server):
    # 96 codes: past the first chunk (48 codes), so the stream has more than one
    talker = {"min_tokens": 96, "max_tokens": 96}
    kwargs = dict(model="omni", messages=_user("say something"), max_tokens=16,
                  modalities=["text", "audio"], extra_body={"talker_sampling_parameters": talker},
                  **GREEDY)
    whole = client.chat.completions.create(**kwargs, audio={"voice": VOICE, "format": "wav"})
    audio = whole.choices[0].message.audio
    wav = base64.b64decode(audio.data)
    samples, rate = sf.read(io.BytesIO(wav), dtype="float32")
    assert rate == 24000 and samples.ndim == 1 and samples.size > 0
    assert whole.choices[0].message.content is None and audio.transcript
    # the same request through the SDK: its float samples are the WAV's, within one PCM16
    # step, read by Python's wave module as by soundfile (the header has the real length)
    with OmniClient(omni_chat_server.grpc_url) as sdk:
        floats = sdk.chat("say something", modalities=["text", "audio"], voice=VOICE,
                          seed=GREEDY["seed"], sampling_parameters={"max_tokens": 16, **GREEDY},
                          talker_sampling=talker)
    assert floats.text == audio.transcript
    assert_pcm16_wav(wav, floats.audio, 24000)

    transcript, pcm = [], []
    stream = client.chat.completions.create(**kwargs, audio={"voice": VOICE, "format": "pcm16"},
                                            stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            delta_audio = choice.delta.audio  # openai's ChoiceDeltaAudio
            if delta_audio:
                transcript.append(getattr(delta_audio, "transcript", None) or "")
                if getattr(delta_audio, "data", None):
                    pcm.append(np.frombuffer(base64.b64decode(delta_audio.data), "<i2"))
    assert len(pcm) > 1  # audio arrived in several chunks
    assert "".join(transcript) == audio.transcript
    # same seed, same greedy reply: the same speech, the WAV's very samples
    assert np.concatenate(pcm).tobytes() == wav[44:]


def test_openai_voices_speak_and_the_talker_options_pass_through(client):
    """What OpenAI apps send (voice alloy) maps onto a voice of the checkpoint; codec ids come back."""
    kwargs = dict(model="omni", messages=_user("say something"), max_tokens=16,
                  modalities=["text", "audio"], **GREEDY)
    extra = {"talker_sampling_parameters": {"temperature": 0, "max_tokens": 24},
             "stream_audio": False, "return_codec_ids": True, "seed": 5}
    alloy, chelsie = (client.chat.completions.create(
        **kwargs, audio={"voice": voice, "format": "wav"}, extra_body=extra).choices[0].message.audio
        for voice in ("alloy", "Chelsie"))
    codes = alloy.model_extra["codec_ids"]
    assert codes and len(codes) <= 24 and codes == chelsie.model_extra["codec_ids"]
    a, b = (sf.read(io.BytesIO(base64.b64decode(x.data)), dtype="float32")[0]
            for x in (alloy, chelsie))
    assert a.size == 480 * len(codes) and np.abs(a - b).max() < 1e-3  # 16-bit WAV rounding


def test_an_image_part_reaches_the_thinker(client):
    plain = client.chat.completions.create(model="omni", messages=_user("what is this"),
                                           max_tokens=4, **GREEDY)
    data_url = "data:image/png;base64," + base64.b64encode(png(seed=3)).decode()
    with_image = client.chat.completions.create(
        model="omni", max_tokens=4, **GREEDY,
        messages=_user("what is this", {"type": "image_url", "image_url": {"url": data_url}}))
    # the image's rows are part of the prompt the thinker read
    assert with_image.usage.prompt_tokens > plain.usage.prompt_tokens + 4


def test_plain_llm_model_chats_through_its_chat_template(client, omni_chat_server):
    """The chat a plain LLM model answers is the one its tokenizer's apply_chat_template
    renders (transformers' reference), as with vLLM's OpenAI server."""
    from transformers import AutoTokenizer

    from .llm_io import run as run_llm

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and then?"}]
    reply = client.chat.completions.create(model="llm", max_tokens=6, messages=chat, **GREEDY)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6 and reply.choices[0].message.content
    folder = json.loads((Path(omni_chat_server.repository) / "llm" / "engine.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder["model"])
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    direct = run_llm(omni_chat_server.grpc_url, prompt, stream=False,
                     sampling={"temperature": 0, "seed": 7, "max_tokens": 6})
    assert reply.choices[0].message.content == direct.text


def test_images_generate(client):
    result = client.images.generate(model="text_to_image", prompt="a red square", n=2,
                                    size="64x64", response_format="b64_json",
                                    extra_body={"seed": 11})
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in result.data]
    assert [im.size for im in images] == [(64, 64), (64, 64)]
    again = client.images.generate(model="text_to_image", prompt="a red square", n=1,
                                   size="64x64", response_format="b64_json",
                                   extra_body={"seed": 11})
    assert again.data[0].b64_json == result.data[0].b64_json  # seeded: the same image
    assert result.data[1].b64_json != result.data[0].b64_json  # n images get their own seeds


def test_audio_speech_formats_and_streaming(client, omni_chat_server):
    text = "one two three four five six seven eight nine ten"
    wav = client.audio.speech.create(model="omni", voice=VOICE, input=text,
                                     response_format="wav", extra_body={"seed": 5})
    samples, rate = sf.read(io.BytesIO(wav.content), dtype="float32")
    assert rate == 24000 and samples.size > 0
    # one 16-bit PCM file with its real length: the SDK's float samples within one step
    with OmniClient(omni_chat_server.grpc_url) as sdk:
        floats = sdk.speech(text, voice=VOICE, seed=5)
    assert_pcm16_wav(wav.content, floats.samples, floats.sample_rate)
    pcm = client.audio.speech.create(model="omni", voice=VOICE, input=text,
                                     response_format="pcm", extra_body={"seed": 5})
    assert pcm.content == wav.content[44:]  # raw: the WAV's data
    with client.audio.speech.with_streaming_response.create(
            model="omni", voice=VOICE, input=text, response_format="wav", stream_format="audio",
            extra_body={"seed": 5}) as response:
        streamed_wav = b"".join(response.iter_bytes())
    # streamed: an open-ended header (sizes 0xFFFFFFFF), then the same samples
    assert streamed_wav[:44] == streaming_wav_header(24000) and streamed_wav[44:] == pcm.content
    assert read_wave(streamed_wav)[0].tobytes() == pcm.content
    flac = client.audio.speech.create(model="omni", voice=VOICE, input=text,
                                      response_format="flac", extra_body={"seed": 5})
    flac_samples, flac_rate = sf.read(io.BytesIO(flac.content), dtype="float32")
    assert flac_rate == 24000 and flac_samples.size == samples.size
    with client.audio.speech.with_streaming_response.create(
            model="omni", voice=VOICE, input=text, response_format="pcm",
            extra_body={"seed": 5}) as response:
        pieces = [piece for piece in response.iter_bytes() if piece]
    assert b"".join(pieces) == pcm.content  # the same speech, streamed
    short = client.audio.speech.create(
        model="omni", voice=VOICE, input="one", response_format="pcm",
        extra_body={"seed": 5, "talker_sampling_parameters": {"max_tokens": 8}})
    assert 0 < len(short.content) <= 2 * 8 * 480  # at most 8 codes of 480 samples


@pytest.mark.parametrize("kwargs, status, param, message", [
    ({"model": "nope"}, 404, "model", "does not exist"),
    ({"n": 2}, 400, "n", "n must be 1"),
    ({"temperature": 5}, 400, "temperature", "less than or equal to 2"),
    ({"extra_body": {"bogus": 1}}, 400, "bogus", "unrecognized request argument"),
    ({"modalities": ["text", "audio"], "audio": {"voice": VOICE, "format": "wav"},
      "stream": True}, 400, "audio.format", "pcm16"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}},
     400, None, "voice: unknown voice 'nobody'"),
    ({"messages": _user("x", {"type": "image_url", "image_url": {"url": "http://x/y.png"}})},
     400, "messages.0.content.1.image_url.url", "data: URLs"),
    ({"messages": _user("x", {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}})},
     400, None, "image_encoder"),
    ({"model": "text_to_image"}, 400, "model", "is a image model"),
    # vLLM's video_url part: data: URLs always; remote and local files only when allowed
    ({"messages": _user("x", {"type": "video_url", "video_url": {"url": "http://x/y.mp4"}})},
     400, "messages.0.content.1.video_url.url", "--allow-remote-media"),
    ({"messages": _user("x", {"type": "video_url", "video_url": {"url": "file:///etc/passwd"}})},
     400, "messages.0.content.1.video_url.url", "--allowed-local-media-path"),
    ({"messages": _user("x", {"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64,@@"}})},
     400, "messages.0.content.1.video_url.url", "invalid base64"),
    ({"messages": _user("x", {"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()}})},
     400, None, "video: "),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(client, kwargs, status, param,
                                                               message):
    request = {"model": "omni", "messages": _user("hello"), "max_tokens": 4, **kwargs}
    stream = request.pop("stream", False)
    with pytest.raises(openai.APIStatusError) as info:
        result = client.chat.completions.create(**request, stream=stream)
        if stream:
            list(result)
    err = info.value
    assert err.status_code == status
    assert message in err.message
    if param is not None:
        assert err.body["param"].replace("[", ".").replace("]", "") == param
    ok = client.chat.completions.create(model="omni", messages=_user("hello"), max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_bad_speech_and_image_requests(client):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.audio.speech.create(model="omni", voice=VOICE, input="x", response_format="mp3")
    with pytest.raises(openai.BadRequestError, match="voice: unknown voice 'nobody'"):
        client.audio.speech.create(model="omni", voice="nobody", input="hello")
    with pytest.raises(openai.BadRequestError, match="size"):
        client.images.generate(model="text_to_image", prompt="x", size="big")
    with pytest.raises(openai.BadRequestError, match="height|width"):
        client.images.generate(model="text_to_image", prompt="x", size="64x100000")


def test_health_metrics_and_a_dead_triton(openai_frontend, tmp_path):
    with urllib.request.urlopen(f"{openai_frontend}/health") as r:
        assert json.load(r)["status"] == "ok"
    with urllib.request.urlopen(f"{openai_frontend}/metrics") as r:
        text = r.read().decode()
    assert 'omni_openai_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    # a frontend whose Triton is gone answers 503, not a hang or a 500
    with OpenAIFrontend(f"127.0.0.1:{free_port()}", log_path=tmp_path / "dead.log") as dead:
        dead_client = openai.OpenAI(base_url=f"{dead.base_url}/v1", api_key="x", max_retries=0,
                                    timeout=60)
        with pytest.raises(openai.APIStatusError) as info:
            dead_client.chat.completions.create(model="omni", messages=_user("hi"))
        assert info.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{dead.base_url}/health")
        assert health.value.code == 503


def test_earlier_turns_reach_the_thinker_and_system_is_refused(client):
    first = client.chat.completions.create(model="omni", messages=_user("hello"), max_tokens=8,
                                           **GREEDY)
    turns = [{"role": "user", "content": "hello"},
             {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model="omni", messages=turns, max_tokens=8,
                                            user="session-1", **GREEDY)
    # the whole conversation was in the thinker's prompt
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 8
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="omni", max_tokens=2,
            messages=[{"role": "system", "content": "be brief"}, *turns])
    assert info.value.body["param"] == "messages[0].role"

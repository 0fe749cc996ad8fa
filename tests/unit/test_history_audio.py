"""Audio in the omni entry model's `history`: parsed, rendered and sent to the thinker."""
from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from omni_serve.contract import LLM, OMNI
from omni_serve.errors import RequestError
from omni_serve.orchestrator.pipeline import OmniPipeline
from omni_serve.orchestrator.request import parse_request
from tests.unit.chat import tiny_chat_prompt
from tests.unit.test_orchestrator import MEL_BINS, ScriptedStages, config, run, tensors


def _audio(data: bytes) -> dict:
    return {"type": "audio", "audio": base64.b64encode(data).decode()}


def _history(*turns: dict) -> str:
    return json.dumps(list(turns))


SPOKEN = {"role": "user", "content": [_audio(b"first"), {"type": "text", "text": "hi"}]}
REPLY = {"role": "assistant", "content": "hello"}


def test_every_clip_of_the_conversation_reaches_the_thinker_in_prompt_order():
    cfg = config()
    stages = ScriptedStages(reply_tokens=2)
    later = {"role": "user", "content": [_audio(b"second-clip")]}
    run(OmniPipeline(cfg, stages, tiny_chat_prompt()),
        tensors("and now?", audio=b"wav", history=_history(SPOKEN, REPLY, later, REPLY)), cfg)
    sent = sorted(bytes(i[next(iter(i))].reshape(-1)[0]) for m, i in stages.calls if m == "aenc")
    assert sent == sorted([b"first", b"second-clip", b"wav"])
    thinker = stages.thinker_requests()[0]
    lengths = [20 + len(b"first"), 20 + len(b"second-clip"), 20 + len(b"wav")]
    assert thinker[LLM.AUDIO_FEATURE_LENGTHS].tolist() == lengths
    assert thinker[LLM.AUDIO_FEATURES].shape == (MEL_BINS, sum(lengths))
    prompt = thinker[LLM.TEXT_INPUT][0].decode()
    assert prompt.count("<|audio_bos|><|AUDIO|><|audio_eos|>") == 3
    assert prompt.index("<|AUDIO|>") < prompt.index("hi") < prompt.index("hello")


def test_a_raw_audio_family_gets_every_clip_as_a_file():
    cfg = config(family="qwen3_omni_moe", stages={"thinker": "llm"})
    stages = ScriptedStages(reply_tokens=2)
    run(OmniPipeline(cfg, stages, tiny_chat_prompt()),
        tensors("what was it?", history=_history(SPOKEN, REPLY)), cfg)
    thinker = stages.thinker_requests()[0]
    assert [bytes(b) for b in thinker[LLM.AUDIO]] == [b"first"]
    assert thinker[LLM.TEXT_INPUT][0].decode().count("<|AUDIO|>") == 1


def test_the_prompt_of_a_turn_extends_the_prompt_of_the_audio_turn_before_it():
    cfg = config()
    prompt = tiny_chat_prompt()
    first = parse_request("r", tensors("hi", audio=b"first"), cfg)
    second = parse_request("r", tensors("more", history=_history(SPOKEN, REPLY)), cfg)
    before = prompt.render(cfg.system_prompt, first.text, ["audio"], first.history)
    after = prompt.render(cfg.system_prompt, second.text, [], second.history)
    assert after.startswith(before) and "hello" in after[len(before):]


@pytest.mark.parametrize("turns,field,says", [
    ([{"role": "user", "content": [{"type": "audio", "audio": "!!"}]}],
     "history[0].content[0].audio", "base64"),
    ([REPLY, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}],
     "history[1].content[1].audio", "base64 of a sound file"),
    ([{"role": "assistant", "content": [_audio(b"x")]}], "history[0].content[0].audio",
     "only a user turn"),
    ([{"role": "user", "content": [{"type": "image", "image": "eA=="}]}],
     "history[0].content[0]", '"type": "audio"'),
    ([{"role": "user", "content": [_audio(b"x" * 1001)]}], "history[0].content[0].audio",
     "at most 1000 are allowed (max_media_bytes)"),
    ([{"role": "user", "content": [_audio(b"x")]}] * 3, "history",
     "at most 2 audio items per request (max_audio_items)"),
    ([{"role": "user", "content": []}], "history[0].content", "non-empty list"),
])
def test_bad_history_audio_names_the_part_and_the_limit(turns, field, says):
    cfg = config(max_media_bytes=1000, max_audio_items=2)
    with pytest.raises(RequestError) as err:
        parse_request("r", tensors("hi", history=json.dumps(turns)), cfg)
    assert err.value.field == field and says in err.value.message


def test_the_new_turns_audio_counts_toward_max_audio_items():
    cfg = config(max_audio_items=1)
    with pytest.raises(RequestError) as err:
        parse_request("r", tensors("hi", audio=b"wav", history=_history(SPOKEN)), cfg)
    assert err.value.field == OMNI.AUDIO and "(max_audio_items)" in err.value.message


def test_history_audio_needs_a_way_to_hear_it():
    cfg = config(stages={"thinker": "llm"})
    with pytest.raises(RequestError) as err:
        parse_request("r", tensors("hi", history=_history(SPOKEN)), cfg)
    assert err.value.field == "history[0].content[0].audio"
    assert "no audio encoder" in err.value.message


def test_an_earlier_chat_completions_audio_part_goes_as_history_audio():
    from omni_client.openai_server import protocol as p

    clip = base64.b64encode(b"RIFF-clip").decode()
    body = p.ChatRequest.model_validate({"model": "omni", "messages": [
        {"role": "user", "content": [{"type": "input_audio",
                                      "input_audio": {"data": clip, "format": "wav"}},
                                     {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]})
    assert p.history(body.messages, allow_system=False, audio=True) == [
        {"role": "user", "content": [{"type": "audio", "audio": clip},
                                     {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"}]
    with pytest.raises(p.OpenAIError) as err:  # a text model reads earlier turns as text
        p.history(body.messages, allow_system=True)
    assert err.value.param == "messages[0].content[0]"


def test_the_realtime_conversation_sends_an_earlier_audio_turn_as_its_audio():
    from omni_client.openai_server.realtime.audio import input_wav
    from omni_client.openai_server.realtime.conversation import Conversation, Item

    pcm = (np.sin(np.arange(4800) / 5) * 8000).astype("<i2").tobytes()
    talk = Conversation()
    for item in (Item("user", [("audio", pcm)]), Item("assistant", [("text", "a tone")]),
                 Item("user", [("text", "what was it?")])):
        talk.add(item)
    turn = talk.turn(audio_prompt="", system=None)
    clip = base64.b64encode(input_wav(pcm)).decode()
    assert turn.history == [{"role": "user", "content": [{"type": "audio", "audio": clip}]},
                            {"role": "assistant", "content": "a tone"}]
    assert turn.has_audio and turn.audio_wav is None and turn.text == "what was it?"
    prompted = talk.turn(audio_prompt="listen", system=None).history[0]["content"]
    assert prompted[1] == {"type": "text", "text": "listen"}


def test_the_talkers_positions_get_every_clips_length_in_prompt_order():
    from omni_serve.contract import TALKER

    cfg = config()
    stages = ScriptedStages(reply_tokens=4, talker_codes=4)
    run(OmniPipeline(cfg, stages, tiny_chat_prompt()),
        tensors("and now?", audio=b"wav", history=_history(SPOKEN, REPLY),
                **{OMNI.MODALITIES: ["text", "audio"]}), cfg)
    (talker,) = stages.talker_requests()
    assert talker[TALKER.AUDIO_FEATURE_LENGTHS].tolist() == [20 + len(b"first"), 20 + len(b"wav")]


def test_a_raw_audio_familys_talker_gets_each_clips_shape_in_prompt_order(monkeypatch):
    from omni_serve.contract import TALKER

    cfg = config(family="qwen3_omni_moe", stages={"thinker": "llm", "talker": "talker",
                                                  "audio_decoder": "dec"})
    pipeline = OmniPipeline(cfg, ScriptedStages(), tiny_chat_prompt())
    monkeypatch.setattr(pipeline, "_raw_shapes", lambda kind, data: {
        LLM.AUDIO_FEATURE_LENGTHS: np.array([len(data)], dtype=np.int64)})
    req = parse_request("r", tensors("and now?", audio=b"wav", history=_history(SPOKEN, REPLY),
                                     **{OMNI.MODALITIES: ["text", "audio"]}), cfg)
    from omni_serve.orchestrator.events import Timings

    media, _, shapes = asyncio.run(pipeline._encode(req, Timings()))
    assert [bytes(b) for b in media[LLM.AUDIO]] == [b"first", b"wav"]
    assert shapes[TALKER.AUDIO_FEATURE_LENGTHS].tolist() == [len(b"first"), len(b"wav")]

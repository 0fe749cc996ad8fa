"""The realtime session without a server: client events in, OpenAI's server events out (every
one validated by the openai package's RealtimeServerEvent models), the pipeline a stand-in
that streams text, audio and a Final, or hangs until cancelled."""
from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf
from openai.types.realtime import RealtimeServerEvent
from prometheus_client import CollectorRegistry
from pydantic import TypeAdapter

from omni_client.errors import BadRequestError
from omni_client.openai_server.realtime.config import SessionConfig
from omni_client.openai_server.realtime.metrics import RealtimeMetrics
from omni_client.openai_server.realtime.session import RealtimeSession
from omni_client.openai_server.realtime.settings import RealtimeSettings
from omni_client.types import AudioChunk, Final, TextDelta, Usage

SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
RATE = 24000


def chunk(n: int, rate: int = RATE, seed: int = 0) -> AudioChunk:
    return AudioChunk(np.random.default_rng(seed).uniform(-0.5, 0.5, n).astype(np.float32), rate)


REPLY = [TextDelta("Hel"), chunk(2400), TextDelta("lo"), chunk(1200, seed=1),
         Final("stop", Usage(11, 2))]


class Pipeline:
    """AsyncOmniClient.stream's stand-in: records each call, plays `script` (an Event, or
    "hang": wait until cancelled)."""

    def __init__(self, script=REPLY):
        self.script = script
        self.calls: list[tuple[str, dict]] = []
        self.closed = 0
        self.reached_hang = asyncio.Event()

    def __call__(self, text, **kwargs):
        self.calls.append((text, kwargs))
        return self._events()

    async def _events(self):
        try:
            for event in self.script:
                if event == "hang":
                    self.reached_hang.set()
                    await asyncio.Event().wait()
                if isinstance(event, Exception):
                    raise event
                await asyncio.sleep(0)
                yield event
        finally:
            self.closed += 1


class Harness:
    def __init__(self, script=REPLY, *, audio_out=True, system_turn=False, **settings):
        self.pipeline = Pipeline(script)
        self.events: list[dict] = []
        self.registry = CollectorRegistry()
        self.session = RealtimeSession(
            SessionConfig.create("omni", audio_out=audio_out, system_turn=system_turn),
            self.pipeline, self._emit, RealtimeSettings(**settings),
            RealtimeMetrics(self.registry).of("omni"))
        self.session.open()

    def _emit(self, event: dict) -> None:
        json.dumps(event)  # what the socket sends
        SERVER_EVENT.validate_python(event)  # an unknown or misshaped event fails the test
        self.events.append(event)

    async def send(self, **event) -> list[dict]:
        start = len(self.events)
        await self.session.handle(json.dumps(event))
        return self.events[start:]

    async def respond(self, **event) -> list[dict]:
        start = len(self.events)
        await self.session.handle(json.dumps({"type": "response.create", **event}))
        await self.session.response.task
        return self.events[start:]

    def metric(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def user_text(text: str) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": text}]}}


def pcm_b64(samples: np.ndarray) -> str:
    return base64.b64encode((samples * 32767).astype("<i2").tobytes()).decode()


def test_a_session_opens_with_its_configuration_and_updates_it():
    async def run():
        h = Harness()
        assert types(h.events) == ["session.created"]
        session = h.events[0]["session"]
        assert session["model"] == "omni" and session["output_modalities"] == ["audio"]
        assert session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
        out = await h.send(type="session.update", event_id="e1", session={
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"output": {"voice": "alloy", "format": {"type": "audio/pcm", "rate": 24000}},
                      "input": {"turn_detection": None}}})
        assert types(out) == ["session.updated"]
        assert out[0]["session"]["output_modalities"] == ["text"]
        assert out[0]["session"]["audio"]["output"]["voice"] == "alloy"
    asyncio.run(run())


@pytest.mark.parametrize("message, param, code", [
    ("{not json", None, "invalid_json"),
    (json.dumps({"type": "conversation.dance", "event_id": "e7"}), "type", "invalid_value"),
    (json.dumps({"type": "conversation.item.truncate", "event_id": "e7"}), "type",
     "unsupported_event"),
    (json.dumps({"type": "session.update", "event_id": "e7", "session": {
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}),
     "session.audio.input.format", "invalid_value"),
    (json.dumps({"type": "session.update", "event_id": "e7", "session": {
        "audio": {"output": {"format": {"type": "audio/pcmu"}}}}}),
     "session.audio.output.format", "invalid_value"),
    (json.dumps({"type": "session.update", "event_id": "e7", "session": {"voice": "x"}}),
     "session.voice", "unknown_parameter"),
    (json.dumps({"type": "session.update", "event_id": "e7",
                 "session": {"instructions": "be brief"}}), "session.instructions",
     "invalid_value"),
    (json.dumps({"type": "session.update", "event_id": "e7", "session": {
        "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}}),
     "session.audio.input.turn_detection.type", "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.append", "event_id": "e7", "audio": "***"}),
     "audio", "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.commit", "event_id": "e7"}),
     "input_audio_buffer", "input_audio_buffer_commit_empty"),
    (json.dumps({"type": "response.cancel", "event_id": "e7"}), "response_id",
     "response_cancel_not_active"),
    (json.dumps({"type": "response.create", "event_id": "e7"}), "response",
     "conversation_has_no_user_turn"),
    (json.dumps({"type": "conversation.item.create", "event_id": "e7", "item": {
        "type": "message", "role": "user", "content": [{"type": "output_text", "text": "x"}]}}),
     "item.content[0].type", "invalid_value"),
])
def test_a_bad_event_gets_an_error_naming_the_field_and_the_session_goes_on(message, param,
                                                                               code):
    async def run():
        h = Harness()
        await h.session.handle(message)
        (error,) = h.events[1:]
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert (error["error"]["param"], error["error"]["code"]) == (param, code)
        if code != "invalid_json":
            assert error["error"]["event_id"] == "e7"
        await h.send(**user_text("hi"))
        assert types(await h.respond())[-1] == "response.done"
    asyncio.run(run())


def test_a_spoken_reply_streams_as_openai_orders_its_events():
    async def run():
        h = Harness()
        added = await h.send(**user_text("hi"))
        assert types(added) == ["conversation.item.added", "conversation.item.done"]
        out = await h.respond()
        assert types(out) == [
            "response.created", "response.output_item.added", "conversation.item.added",
            "response.content_part.added",
            "response.output_audio_transcript.delta", "response.output_audio.delta",
            "response.output_audio_transcript.delta", "response.output_audio.delta",
            "response.output_audio.done", "response.output_audio_transcript.done",
            "response.content_part.done", "response.output_item.done", "conversation.item.done",
            "response.done"]
        ids = {e.get("response_id") for e in out if "response_id" in e}
        assert ids == {out[0]["response"]["id"]}
        pcm = b"".join(base64.b64decode(e["delta"]) for e in out
                       if e["type"] == "response.output_audio.delta")
        samples = np.concatenate([REPLY[1].samples, REPLY[3].samples])
        assert np.abs(np.frombuffer(pcm, "<i2") / 32768.0 - samples).max() <= 1 / 32768
        done = out[-1]["response"]
        assert done["status"] == "completed"
        assert done["usage"] == {"input_tokens": 11, "output_tokens": 2, "total_tokens": 13}
        assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": "Hello"}]
        text, kwargs = h.pipeline.calls[0]
        assert text == "hi" and kwargs["modalities"] == ["text", "audio"]
        assert kwargs["history"] is None and kwargs["session_id"] == h.session.config.id
        assert h.metric("omni_openai_realtime_turns_total", status="completed") == 1
        assert h.metric("omni_openai_realtime_first_audio_seconds_count", model="omni") == 1
    asyncio.run(run())


def test_the_second_turn_carries_the_first_and_the_session_options():
    async def run():
        h = Harness()
        await h.send(type="session.update", session={
            "audio": {"output": {"voice": "Ethan"}}, "max_output_tokens": 16, "seed": 7,
            "temperature": 0,
            "talker_sampling_parameters": {"max_tokens": 64}})
        await h.send(**user_text("hi"))
        await h.respond()
        await h.send(**user_text("and then?"))
        out = await h.respond(response={"output_modalities": ["text"]})
        text, kwargs = h.pipeline.calls[1]
        assert text == "and then?"
        assert kwargs["history"] == [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "Hello"}]
        assert kwargs["modalities"] == ["text"] and kwargs["voice"] is None
        assert kwargs["sampling_parameters"] == {"max_tokens": 16, "seed": 7, "temperature": 0}
        assert kwargs["seed"] == 7
        assert h.pipeline.calls[0][1]["voice"] == "Ethan"
        assert h.pipeline.calls[0][1]["talker_sampling"] == {"max_tokens": 64}
        assert "response.output_audio.delta" not in types(out)
        assert [e["delta"] for e in out if e["type"] == "response.output_text.delta"] == \
            ["Hel", "lo"]
        assert out[-1]["response"]["output"][0]["content"] == [
            {"type": "output_text", "text": "Hello"}]
    asyncio.run(run())


def test_committed_audio_reaches_the_pipeline_as_a_16khz_wav():
    async def run():
        h = Harness()
        tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(RATE) / RATE)
        for piece in np.array_split(tone, 3):
            assert await h.send(type="input_audio_buffer.append", audio=pcm_b64(piece)) == []
        out = await h.send(type="input_audio_buffer.commit")
        assert types(out) == ["input_audio_buffer.committed", "conversation.item.added",
                              "conversation.item.done"]
        assert out[1]["item"]["content"] == [{"type": "input_audio", "transcript": None}]
        await h.respond()
        text, kwargs = h.pipeline.calls[0]
        assert text == RealtimeSettings().audio_prompt  # an audio-only turn
        samples, rate = sf.read(io.BytesIO(kwargs["audio"]), dtype="float32")
        assert rate == 16000 and len(samples) == 16000
        # the 440 Hz tone, resampled: its spectrum peaks at 440 Hz
        assert abs(np.argmax(np.abs(np.fft.rfft(samples))) - 440) <= 1
        # the next commit starts empty
        assert (await h.send(type="input_audio_buffer.commit"))[0]["error"]["code"] == \
            "input_audio_buffer_commit_empty"
    asyncio.run(run())


async def _spoken_turns(h: Harness, n: int) -> None:
    """`n` committed audio turns (a distinct tone each), each answered."""
    for i in range(n):
        tone = 0.3 * np.sin(2 * np.pi * (200 + 10 * i) * np.arange(RATE // 10) / RATE)
        await h.send(type="input_audio_buffer.append", audio=pcm_b64(tone))
        await h.send(type="input_audio_buffer.commit")
        await h.respond()


def _heard(kwargs: dict) -> list[str]:
    """The audio turns a pipeline call sends: its history's, then its own."""
    clips = [part["audio"] for turn in kwargs["history"] or [] if not isinstance(turn["content"], str)
             for part in turn["content"] if part["type"] == "audio"]
    return clips + ([base64.b64encode(kwargs["audio"]).decode()] if kwargs["audio"] else [])


def test_past_the_audio_turn_limit_the_oldest_turns_are_left_out_at_one_cut():
    async def run():
        h = Harness(max_audio_turns=4)
        assert h.events[0]["session"]["truncation"] == "auto"  # OpenAI's default
        await _spoken_turns(h, 7)
        heard = [_heard(kwargs) for _, kwargs in h.pipeline.calls]
        assert [len(x) for x in heard] == [1, 2, 3, 4, 2, 3, 4]
        # the 5th turn cut the history to half the limit: its 4th turn and itself ...
        assert heard[4] == heard[3][3:] + heard[4][-1:]
        # ... and the next turns start from the same item, so each prompt extends the last
        assert heard[5][:2] == heard[4] and heard[6][:3] == heard[5]
        # the history after a cut starts with a user turn, and every turn is answered
        history = h.pipeline.calls[4][1]["history"]
        assert history[0]["role"] == "user" and history[1] == {"role": "assistant",
                                                                "content": "Hello"}
        assert types(h.events).count("response.done") == 7
        assert {e["response"]["status"] for e in h.events if e["type"] == "response.done"} == \
            {"completed"}
    asyncio.run(run())


def test_with_truncation_disabled_the_limit_fails_the_response_naming_it():
    async def run():
        h = Harness(max_audio_turns=2)
        out = await h.send(type="session.update", session={"type": "realtime",
                                                           "truncation": "disabled"})
        assert out[0]["session"]["truncation"] == "disabled"
        await _spoken_turns(h, 2)
        tone = 0.3 * np.sin(2 * np.pi * 300 * np.arange(RATE // 10) / RATE)
        await h.send(type="input_audio_buffer.append", audio=pcm_b64(tone))
        await h.send(type="input_audio_buffer.commit")
        (error,) = await h.send(type="response.create", event_id="e9")
        assert error["type"] == "error" and error["error"]["param"] == "session.truncation"
        assert "3 audio turns; at most 2" in error["error"]["message"]
        assert "--realtime-max-audio-turns" in error["error"]["message"]
        assert len(h.pipeline.calls) == 2  # nothing was sent; the session goes on
        await h.send(type="session.update", session={"type": "realtime", "truncation": "auto"})
        await h.respond()
        assert len(_heard(h.pipeline.calls[2][1])) == 1
    asyncio.run(run())


def test_the_buffer_limit_refuses_audio_past_it():
    async def run():
        h = Harness(max_buffer_bytes=4800)
        half = np.zeros(1200)
        assert await h.send(type="input_audio_buffer.append", audio=pcm_b64(half)) == []
        assert await h.send(type="input_audio_buffer.append", audio=pcm_b64(half)) == []
        (error,) = await h.send(type="input_audio_buffer.append", audio=pcm_b64(half))
        assert error["error"]["code"] == "input_audio_buffer_full"
        assert error["error"]["param"] == "audio" and "4800" in error["error"]["message"]
        assert types(await h.send(type="input_audio_buffer.clear")) == \
            ["input_audio_buffer.cleared"]
        assert await h.send(type="input_audio_buffer.append", audio=pcm_b64(half)) == []
    asyncio.run(run())


def test_cancel_closes_the_stream_and_keeps_what_was_sent():
    async def run():
        h = Harness([TextDelta("Hel"), chunk(2400), "hang", TextDelta("never")])
        await h.send(**user_text("hi"))
        await h.send(type="response.create")
        await h.pipeline.reached_hang.wait()
        busy = await h.send(type="response.create", event_id="e2")
        assert busy[0]["error"]["code"] == "conversation_already_has_active_response"
        out = await h.send(type="response.cancel", event_id="e3")
        assert h.pipeline.closed == 1  # the stream was closed: the request is cancelled
        assert types(out) == ["response.output_audio.done", "response.output_audio_transcript.done",
                              "response.content_part.done", "response.output_item.done",
                              "conversation.item.done", "response.done"]
        done = out[-1]["response"]
        assert done["status"] == "cancelled"
        assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        assert done["output"][0]["status"] == "incomplete"
        assert done["output"][0]["content"][0]["transcript"] == "Hel"
        assert h.metric("omni_openai_realtime_interruptions_total",
                        reason="client_cancelled") == 1
        assert h.metric("omni_openai_realtime_turns_total", status="cancelled") == 1
        # the truncated reply is history
        h.pipeline.script = REPLY
        await h.send(**user_text("go on"))
        await h.respond()
        assert h.pipeline.calls[1][1]["history"][-1] == {"role": "assistant", "content": "Hel"}
    asyncio.run(run())


def test_closing_the_session_cancels_the_running_response():
    async def run():
        h = Harness(["hang"])
        await h.send(**user_text("hi"))
        await h.send(type="response.create")
        await h.pipeline.reached_hang.wait()
        await h.session.close()
        assert h.pipeline.closed == 1 and not h.session.busy
        assert h.events[-1]["response"]["status"] == "cancelled"
        assert h.metric("omni_openai_realtime_interruptions_total", reason="disconnected") == 1
    asyncio.run(run())


def test_a_pipeline_error_fails_the_response_with_its_message():
    async def run():
        h = Harness([BadRequestError("voice: unknown voice 'nobody'")])
        await h.send(**user_text("hi"))
        out = await h.respond()
        error = next(e for e in out if e["type"] == "error")
        assert "unknown voice" in error["error"]["message"]
        assert out[-1]["response"]["status"] == "failed"
        assert out[-1]["response"]["status_details"]["error"]["type"] == "invalid_request_error"
    asyncio.run(run())


def test_a_text_model_takes_instructions_as_its_system_turn_and_no_audio():
    async def run():
        h = Harness(audio_out=False, system_turn=True)
        assert h.events[0]["session"]["output_modalities"] == ["text"]
        await h.send(type="session.update", session={"instructions": "be brief"})
        (error,) = await h.send(type="session.update", session={"output_modalities": ["audio"]})
        assert error["error"]["param"] == "session.output_modalities"
        await h.send(**user_text("hi"))
        await h.respond()
        text, kwargs = h.pipeline.calls[0]
        assert kwargs["history"] == [{"role": "system", "content": "be brief"}]
        assert "modalities" not in kwargs and "voice" not in kwargs
    asyncio.run(run())


def test_output_audio_at_another_rate_goes_out_at_24khz():
    async def run():
        h = Harness([chunk(1600, rate=16000), Final("stop", None)])
        await h.send(**user_text("hi"))
        out = await h.respond()
        (delta,) = [e for e in out if e["type"] == "response.output_audio.delta"]
        assert len(base64.b64decode(delta["delta"])) == 2400 * 2
        assert out[-1]["response"]["usage"] is None
    asyncio.run(run())


def test_an_unexpected_failure_still_ends_the_response():
    async def run():
        h = Harness([TextDelta("Hel"), RuntimeError("a bug")])
        await h.send(**user_text("hi"))
        out = await h.respond()
        assert [e["error"]["type"] for e in out if e["type"] == "error"] == ["server_error"]
        assert out[-1]["response"]["status"] == "failed"
        assert out[-1]["response"]["output"][0]["content"][0]["transcript"] == "Hel"
        await h.send(**user_text("again"))  # the session goes on
        h.pipeline.script = REPLY
        assert (await h.respond())[-1]["response"]["status"] == "completed"
    asyncio.run(run())

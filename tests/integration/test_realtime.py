"""`/v1/realtime` on omni-openai in front of the omni-chat stack, driven by the official `openai`
package's realtime client. Every server event is validated against the package's
`RealtimeServerEvent` models; replies are compared with the omni entry model's answer to the
same conversation through omni_client."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import websockets
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from omni_client import OmniClient
from omni_client.openai_server.realtime.audio import input_wav
from omni_client.openai_server.realtime.settings import RealtimeSettings
from omni_tools.server import OpenAIFrontend, metric_sample
from tests.wav_check import assert_within_one_step

from .llm_io import metric, wait_idle
from .omni_io import tone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
VOICE = "Ethan"
EVENT_TIMEOUT_S = 120.0  # one event of a CPU pipeline, at worst
SESSION = {"type": "realtime", "audio": {"output": {"voice": VOICE}}, "max_output_tokens": 16,
           "seed": 7, "temperature": 0,
           # past the first audio chunk (48 codes): the audio streams in pieces
           "talker_sampling_parameters": {"min_tokens": 96, "max_tokens": 96}}
# a reply long enough to cancel mid-way: the talker must make LONG codes unless stopped
LONG = 1500
LONG_SESSION = {**SESSION, "talker_sampling_parameters": {"min_tokens": LONG, "max_tokens": LONG}}
STAGES = (("llm", "talker"), ("omni",))


class Session:
    """One realtime connection: every event it receives is validated and kept."""

    def __init__(self, connection):
        self.connection = connection
        self.events: list = []

    async def recv(self):
        raw = await asyncio.wait_for(self.connection.recv_bytes(), EVENT_TIMEOUT_S)
        event = SERVER_EVENT.validate_json(raw)  # an unknown or misshaped event fails here
        self.events.append(event)
        return event

    async def until(self, kind: str) -> list:
        """The events up to and including the next one of type `kind`."""
        got = []
        while True:
            got.append(await self.recv())
            if got[-1].type == kind:
                return got

    async def send(self, **event) -> None:
        await self.connection.send(event)

    async def send_raw(self, text: str) -> None:
        await self.connection.send_raw(text)

    async def update(self, session: dict) -> None:
        await self.send(type="session.update", session=session)
        (updated,) = await self.until("session.updated")

    async def say(self, text: str) -> None:
        await self.send(type="conversation.item.create", item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        await self.until("conversation.item.done")

    async def answer(self, **response) -> list:
        await self.send(type="response.create", **({"response": response} if response else {}))
        return await self.until("response.done")


@contextlib.asynccontextmanager
async def realtime(base_url: str, model: str = "omni"):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    async with client.realtime.connect(model=model) as connection:
        session = Session(connection)
        assert (await session.recv()).type == "session.created"
        yield session


def transcript(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")


def pcm(events: list) -> np.ndarray:
    data = b"".join(base64.b64decode(e.delta) for e in events
                    if e.type == "response.output_audio.delta")
    return np.frombuffer(data, "<i2")


def frontend_metric(base_url: str, name: str, **labels) -> float:
    """A sample of omni-openai's /metrics (0 before a labelled series exists)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    try:
        return metric_sample(text, name, **labels)
    except KeyError:
        return 0.0


def reference(grpc_url: str, text: str, history=None, audio: bytes | None = None,
              speak: bool = True, cold: bool = False):
    """The omni entry model's answer to the same conversation, through omni_client;
    `cold`: computed whole, without reading the thinker's prefix cache."""
    speech = {"voice": VOICE, "seed": SESSION["seed"],
              "talker_sampling": SESSION["talker_sampling_parameters"]} if speak else {}
    sampling = {"max_tokens": 16, "seed": 7, "temperature": 0,
                **({"skip_reading_prefix_cache": True} if cold else {})}
    with OmniClient(grpc_url) as sdk:
        return sdk.chat(text, modalities=["text", "audio"] if speak else ["text"],
                        sampling_parameters=sampling, history=history, audio=audio, **speech)


def assert_stopped_at_the_limit(response) -> None:
    """max_output_tokens (16) ended the reply: OpenAI's `incomplete`."""
    assert response.status == "incomplete", response.status
    assert response.status_details.reason == "max_output_tokens"


def _run(coro):
    return asyncio.run(coro)


# --- turns -----------------------------------------------------------------------------

def test_a_text_turn_speaks_the_omni_models_answer(openai_frontend, omni_chat_server):
    async def run():
        async with realtime(openai_frontend) as rt:
            await rt.update(SESSION)
            await rt.say("say something")
            return await rt.answer()

    events = _run(run())
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.output_item.added",
                         "conversation.item.added", "response.content_part.added"]
    assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done",
                          "conversation.item.done", "response.done"]
    assert kinds.count("response.output_audio.delta") > 1  # it streamed
    done = events[-1].response
    assert_stopped_at_the_limit(done)
    assert done.usage.input_tokens > 0
    want = reference(omni_chat_server.grpc_url, "say something")
    assert transcript(events) == want.text and want.text
    assert events[-6 + 1].transcript == want.text
    assert done.output[0].content[0].transcript == want.text
    assert done.usage.output_tokens == want.usage.completion_tokens
    assert want.sample_rate == 24000
    assert_within_one_step(pcm(events), want.audio)  # same seed: the same speech


def test_an_audio_turn_committed_by_hand_is_heard(openai_frontend, omni_chat_server):
    samples = tone(1.0, rate=24000)
    data = (samples * 32767).astype("<i2").tobytes()

    async def run():
        async with realtime(openai_frontend) as rt:
            await rt.update(SESSION)
            for at in range(0, len(data), 4800):  # 100 ms appends
                await rt.send(type="input_audio_buffer.append",
                              audio=base64.b64encode(data[at:at + 4800]).decode())
            await rt.send(type="input_audio_buffer.commit")
            committed = await rt.until("conversation.item.done")
            return committed, await rt.answer()

    committed, events = _run(run())
    assert [e.type for e in committed] == ["input_audio_buffer.committed",
                                           "conversation.item.added", "conversation.item.done"]
    assert committed[1].item.content[0].type == "input_audio"
    want = reference(omni_chat_server.grpc_url, RealtimeSettings().audio_prompt,
                     audio=input_wav(data))
    assert_stopped_at_the_limit(events[-1].response)
    assert events[-1].response.usage.input_tokens == want.usage.prompt_tokens
    assert transcript(events) == want.text
    assert_within_one_step(pcm(events), want.audio)


def test_an_earlier_audio_turn_is_heard_at_the_next_turn(openai_frontend, omni_chat_server):
    """An audio turn committed by hand (answered in text), then a spoken text turn: its
    answer is the omni entry model's to the same chat with the first turn's audio in
    history, and its prompt holds that audio's tokens (not a text stand-in)."""
    data = (tone(1.0, rate=24000, freq=523.0) * 32767).astype("<i2").tobytes()

    async def run():
        async with realtime(openai_frontend) as rt:
            await rt.update({**SESSION, "output_modalities": ["text"]})
            await rt.send(type="input_audio_buffer.append", audio=base64.b64encode(data).decode())
            await rt.send(type="input_audio_buffer.commit")
            first = await rt.answer()
            await rt.update({**SESSION, "output_modalities": ["audio"]})
            await rt.say("what did you hear?")
            return first, await rt.answer()

    first, second = _run(run())
    (said,) = [e.text for e in first if e.type == "response.output_text.done"]
    clip = {"type": "audio", "audio": base64.b64encode(input_wav(data)).decode()}
    prompt = RealtimeSettings().audio_prompt
    spoken = [clip, *([{"type": "text", "text": prompt}] if prompt else [])]
    want = reference(omni_chat_server.grpc_url, "what did you hear?",
                     history=[{"role": "user", "content": spoken},
                              {"role": "assistant", "content": said}])
    stand_in = reference(omni_chat_server.grpc_url, "what did you hear?",
                         history=[{"role": "user", "content": "(the user spoke)"},
                                  {"role": "assistant", "content": said}], speak=False)
    assert want.text != stand_in.text, "the earlier audio does not change the reply: no test"
    assert transcript(second) == want.text and want.text
    assert_within_one_step(pcm(second), want.audio)
    usage = [events[-1].response.usage for events in (first, second)]
    assert usage[1].input_tokens == want.usage.prompt_tokens
    # turn 2's prompt holds turn 1's (its audio tokens and all) and its reply
    assert usage[1].input_tokens > usage[0].input_tokens + usage[0].output_tokens
    assert usage[1].input_tokens > stand_in.usage.prompt_tokens


QUERIES, HITS = "omni_llm_prefix_cache_queries_total", "omni_llm_prefix_cache_hits_total"
RECOMPUTED = "omni_llm_hidden_rows_recomputed_total"
CPU_BLOCK = 128  # vLLM's KV block on CPU: the prefix cache keeps whole blocks
TURNS = ("Tell me a story about a lighthouse keeper who finds a message in a bottle on the "
         "shore one stormy night, reads it by the light of the lamp, and decides to find its "
         "writer. Tell it slowly, with the sea, the wind, the gulls and the long walk along the "
         "cliffs.",
         "Who wrote the message, and where did the keeper travel to find that person?",
         "And what did the keeper say when they met at last, on the quay in the rain?")


def test_later_turns_carry_the_earlier_and_spoken_ones_hit_the_prefix_cache(openai_frontend,
                                                                             omni_chat_server):
    """A text reply, then two spoken ones. The talker reads the thinker's rows of every
    prompt position: the first spoken turn finds turn 1 in vLLM's prefix cache but no rows
    kept for it (a text reply keeps none), so it is computed again whole; the second finds
    the first spoken turn's blocks and their rows. Each spoken answer equals the omni
    entry model's answer computed cold (without reading the prefix cache)."""
    def cache():
        text = omni_chat_server.metrics()
        return (metric(text, QUERIES, "llm"), metric(text, HITS, "llm"),
                metric(text, RECOMPUTED, "llm"))

    async def run():
        turns = []
        async with realtime(openai_frontend) as rt:
            for i, text in enumerate(TURNS):
                await rt.update({**SESSION, "output_modalities": ["audio"] if i else ["text"]})
                assert not any(wait_idle(omni_chat_server, *STAGES, timeout=60).values())
                before = cache()
                await rt.say(text)
                events = await rt.answer()
                assert not any(wait_idle(omni_chat_server, *STAGES, timeout=60).values())
                after = cache()
                turns.append({"events": events, "queries": after[0] - before[0],
                              "hits": after[1] - before[1], "recomputed": after[2] - before[2],
                              "usage": events[-1].response.usage})
        return turns

    turns = _run(run())
    print("\nprompt tokens, prefix cache hits/queries, recomputed per turn: " + "; ".join(
        f"{t['usage'].input_tokens}: {t['hits']:.0f}/{t['queries']:.0f} {t['recomputed']:.0f}"
        for t in turns))
    prompts = [t["usage"].input_tokens for t in turns]
    for before, turn in zip(turns, turns[1:]):  # each prompt holds the one before and its reply
        assert turn["usage"].input_tokens > before["usage"].input_tokens + \
            before["usage"].output_tokens
    assert prompts[0] >= CPU_BLOCK  # so a block of it can be found again
    # turn 2: the engine found turn 1's blocks, kept no rows for them, and computed it again
    assert turns[1]["hits"] >= prompts[0] // CPU_BLOCK * CPU_BLOCK, turns[1]
    assert turns[1]["recomputed"] == 1, turns[1]
    # turn 3: read from the prefix cache, rows and all, once
    assert turns[2]["hits"] >= prompts[1] // CPU_BLOCK * CPU_BLOCK, turns[2]
    assert turns[2]["recomputed"] == 0 and turns[2]["queries"] == prompts[2], turns[2]
    # each reply is the omni model's to the whole conversation, computed cold
    history = []
    for i, (text, turn) in enumerate(zip(TURNS, turns)):
        events = turn["events"]
        if i == 0:
            (said,) = [e.text for e in events if e.type == "response.output_text.done"]
        else:
            want = reference(omni_chat_server.grpc_url, text, history=history, cold=True)
            said = transcript(events)
            assert said == want.text and said, i
            assert_within_one_step(pcm(events), want.audio)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": said}]


# --- cancellation ----------------------------------------------------------------------

def _talker_tokens(server) -> float:
    return metric(server.metrics(), "omni_llm_generation_tokens_total", "talker")


def test_response_cancel_stops_the_answer_and_every_stage(openai_frontend, omni_chat_server):
    before = _talker_tokens(omni_chat_server)
    cancels = frontend_metric(openai_frontend, "omni_openai_realtime_interruptions_total",
                              reason="client_cancelled")

    async def run():
        async with realtime(openai_frontend) as rt:
            await rt.update(LONG_SESSION)
            await rt.say("say something")
            await rt.send(type="response.create")
            head = await rt.until("response.output_audio.delta")
            await rt.send(type="response.cancel")
            tail = await rt.until("response.done")
            # the next event after response.done answers the next client event: nothing of
            # the cancelled response came in between
            await rt.send(type="session.update", session={"type": "realtime"})
            barrier = await rt.recv()
            return head, tail, barrier

    head, tail, barrier = _run(run())
    assert barrier.type == "session.updated"
    done = tail[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"
    deltas = [e for e in tail if e.type.endswith(".delta")]
    assert all(e.type != "response.output_audio.delta" for e in tail[len(deltas):])
    assert done.output[0].status == "incomplete"
    assert done.output[0].content[0].transcript == transcript(head + tail)
    idle = wait_idle(omni_chat_server, *STAGES, timeout=60)
    assert not any(idle.values()), idle
    assert _talker_tokens(omni_chat_server) - before < LONG / 2  # the talker was stopped
    assert frontend_metric(openai_frontend, "omni_openai_realtime_interruptions_total",
                           reason="client_cancelled") == cancels + 1


def test_a_socket_closed_mid_answer_cancels_it(openai_frontend, omni_chat_server):
    before = _talker_tokens(omni_chat_server)

    async def run():
        async with realtime(openai_frontend) as rt:
            await rt.update(LONG_SESSION)
            await rt.say("say something")
            await rt.send(type="response.create")
            await rt.until("response.output_audio.delta")
        # leaving the block closed the socket

    _run(run())
    idle = wait_idle(omni_chat_server, *STAGES, timeout=60)
    assert not any(idle.values()), idle
    assert _talker_tokens(omni_chat_server) - before < LONG / 2
    deadline = time.monotonic() + 30
    while frontend_metric(openai_frontend, "omni_openai_realtime_sessions", model="omni") and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert frontend_metric(openai_frontend, "omni_openai_realtime_sessions", model="omni") == 0


# --- bad events and limits ---------------------------------------------------------------

def test_bad_events_get_errors_and_the_session_still_answers(openai_frontend):
    async def run():
        async with realtime(openai_frontend) as rt:
            await rt.send_raw("{not json")
            errors = [await rt.recv()]
            await rt.send_raw(json.dumps({"type": "conversation.dance", "event_id": "e2"}))
            errors.append(await rt.recv())
            await rt.send(type="session.update", event_id="e3", session={
                "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}})
            errors.append(await rt.recv())
            await rt.update(SESSION)
            await rt.say("say something")
            return errors, await rt.answer()

    errors, events = _run(run())
    assert [e.type for e in errors] == ["error"] * 3
    assert [(e.error.type, e.error.param, e.error.event_id) for e in errors] == [
        ("invalid_request_error", None, None),
        ("invalid_request_error", "type", "e2"),
        ("invalid_request_error", "session.audio.input.format", "e3")]
    assert_stopped_at_the_limit(events[-1].response)
    assert pcm(events).size


def test_a_session_over_the_limit_is_refused(omni_chat_server, tmp_path):
    with OpenAIFrontend(omni_chat_server.grpc_url, log_path=tmp_path / "omni-openai.log",
                        extra_args=["--realtime-max-sessions", "1"]) as frontend:
        async def run():
            async with realtime(frontend.base_url):
                client = openai.AsyncOpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused")
                async with client.realtime.connect(model="omni") as second:
                    refused = Session(second)
                    error = await refused.recv()
                    with pytest.raises(websockets.ConnectionClosed) as closed:
                        await refused.recv()
            return error, closed.value

        error, closed = _run(run())
        assert error.type == "error" and error.error.code == "session_limit_reached"
        assert "--realtime-max-sessions" in error.error.message
        assert closed.rcvd.code == 1013

        async def again():  # the first session's slot is free once it closed
            deadline = time.monotonic() + 30
            while True:
                client = openai.AsyncOpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused")
                async with client.realtime.connect(model="omni") as connection:
                    first = SERVER_EVENT.validate_json(
                        await asyncio.wait_for(connection.recv_bytes(), EVENT_TIMEOUT_S))
                if first.type == "session.created" or time.monotonic() > deadline:
                    return first
                await asyncio.sleep(0.05)

        assert _run(again()).type == "session.created"


# --- server VAD --------------------------------------------------------------------------

VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
       "silence_duration_ms": 500}
APPEND_BYTES = 4800  # 100 ms


@pytest.fixture(scope="module")
def clip():
    from tests.speech_clip import turns

    return turns(["Hello there, how are you today?", "Tell me a story about the sea."],
                 lead_ms=1000, gap_ms=1500, tail_ms=1500)


async def _speak(rt: Session, data: bytes) -> None:
    for at in range(0, len(data), APPEND_BYTES):
        await rt.send(type="input_audio_buffer.append",
                      audio=base64.b64encode(data[at:at + APPEND_BYTES]).decode())


def test_server_vad_commits_the_speech_and_answers_it(openai_frontend, omni_chat_server, clip):
    first = clip.bytes[:(clip.spans[0][1] + 1200) * 48]

    async def run():
        async with realtime(openai_frontend) as rt:
            await rt.update({**SESSION, "audio": {**SESSION["audio"],
                                                  "input": {"turn_detection": VAD}}})
            await _speak(rt, first)
            return await rt.until("response.done")

    events = _run(run())
    kinds = [e.type for e in events]
    at = kinds.index("input_audio_buffer.speech_started")
    assert kinds[at:at + 6] == [
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
        "response.created"]
    started, stopped = events[at], events[at + 1]
    # the committed turn is the speech from its padded start to its stop: the omni model's
    # answer to those samples
    spoken = first[started.audio_start_ms * 48:stopped.audio_end_ms * 48]
    want = reference(omni_chat_server.grpc_url, RealtimeSettings().audio_prompt,
                     audio=input_wav(spoken))
    assert events[-1].response.usage.input_tokens == want.usage.prompt_tokens
    assert transcript(events) == want.text
    assert_within_one_step(pcm(events), want.audio)


def test_speech_during_an_answer_interrupts_it(openai_frontend, omni_chat_server, clip):
    """Barge-in: the second utterance's speech_started comes while the first answer speaks;
    that answer is cancelled before any more of it is sent, every stage stops, and the
    second utterance is answered."""
    split = (clip.spans[0][1] + 1200) * 48
    before = _talker_tokens(omni_chat_server)

    async def run():
        async with realtime(openai_frontend) as rt:
            await rt.update({**LONG_SESSION, "audio": {**SESSION["audio"],
                                                       "input": {"turn_detection": VAD}}})
            await _speak(rt, clip.bytes[:split])
            head = await rt.until("response.output_audio.delta")
            # the next answer (to the second utterance) is short
            await rt.update({"talker_sampling_parameters":
                             SESSION["talker_sampling_parameters"]})
            await _speak(rt, clip.bytes[split:])
            barge = await rt.until("input_audio_buffer.speech_started")
            started = time.perf_counter()
            cut = await rt.until("response.done")
            cancel_s = time.perf_counter() - started
            rest = await rt.until("response.done")
            return head, barge, cut, cancel_s, rest

    head, barge, cut, cancel_s, rest = _run(run())
    print(f"\nbarge-in: speech_started -> response.done (cancelled) {cancel_s * 1000:.1f} ms, "
          f"{sum(e.type.endswith('.delta') for e in cut)} deltas between")
    assert [e.type for e in cut if e.type.endswith(".delta")] == []  # nothing after the speech
    done = cut[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "turn_detected"
    assert done.id == next(e.response.id for e in head if e.type == "response.created")
    assert rest[-1].response.status in ("completed", "incomplete")  # the second turn answered
    idle = wait_idle(omni_chat_server, *STAGES, timeout=60)
    assert not any(idle.values()), idle
    assert _talker_tokens(omni_chat_server) - before < LONG / 2


# --- the docs ------------------------------------------------------------------------------

def test_the_docs_example_runs(openai_frontend, tmp_path):
    """docs/openai-api.md's realtime example, as a user runs it, against this frontend."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "openai-api.md").read_text()
    section = doc[doc.index("## Realtime"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "realtime_example.py"
    script.write_text(code.replace("http://127.0.0.1:9000", openai_frontend))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    status, seconds = re.search(r"\n (\w+) .*\n([\d.]+) s of speech", out.stdout).groups()
    # unseeded sampling may end before max_output_tokens
    assert status in ("completed", "incomplete") and float(seconds) > 0

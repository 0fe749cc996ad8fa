"""Server VAD turn detection in a realtime session (no server): espeak-ng speech appended in
100 ms pieces is committed at each speech stop and answered; speech during an answer cancels it
(barge-in). The pipeline is test_realtime_session's stand-in."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import soundfile as sf

from tests.speech_clip import turns

from .test_realtime_session import REPLY, Harness, types

APPEND_BYTES = 4800  # 100 ms of PCM16 24 kHz
VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
       "silence_duration_ms": 500}
# Silero decides on 32 ms windows: a start can come up to 3 windows after the sound's onset
# (then moved back by the prefix padding), a stop up to 6 windows after the silence began
ONSET_LATE_MS, OFFSET_LATE_MS = 96, 192


@pytest.fixture(scope="module")
def clip():
    return turns(["Hello there, how are you today?", "Tell me a story about the sea."],
                 lead_ms=1000, gap_ms=1500, tail_ms=1500)


async def speak(h: Harness, data: bytes) -> None:
    for at in range(0, len(data), APPEND_BYTES):
        await h.send(type="input_audio_buffer.append",
                     audio=base64.b64encode(data[at:at + APPEND_BYTES]).decode())


async def _called(pipeline, n: int) -> None:
    while len(pipeline.calls) < n:  # the response task calls the pipeline when it runs
        await asyncio.sleep(0)


def test_each_speech_stop_commits_the_speech_and_answers_it(clip):
    async def run():
        h = Harness()
        await h.send(type="session.update", session={"audio": {"input": {"turn_detection": VAD}}})
        assert h.events[-1]["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        first_end = (clip.spans[0][1] + 1200) * 48  # the first utterance and its silence
        await speak(h, clip.bytes[:first_end])
        await h.session.response.task
        kinds = types(h.events)
        at = kinds.index("input_audio_buffer.speech_started")
        assert kinds[at:at + 6] == [
            "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
            "response.created"]
        started, stopped, committed = h.events[at:at + 3]
        assert started["item_id"] == stopped["item_id"] == committed["item_id"]
        start, end = clip.spans[0]
        assert start - 300 <= started["audio_start_ms"] <= start - 300 + ONSET_LATE_MS
        assert end + 500 <= stopped["audio_end_ms"] <= end + 500 + OFFSET_LATE_MS
        # the committed turn is the speech from its padded start to its stop, at 16 kHz
        samples, rate = sf.read(io.BytesIO(h.pipeline.calls[0][1]["audio"]), dtype="float32")
        length_ms = stopped["audio_end_ms"] - started["audio_start_ms"]
        assert rate == 16000 and abs(len(samples) / 16 - length_ms) <= 2
        assert h.events[-1]["type"] == "response.done"
    asyncio.run(run())


def test_speech_during_an_answer_interrupts_it(clip):
    async def run():
        h = Harness([*REPLY[:2], "hang"])
        await h.send(type="session.update", session={"audio": {"input": {"turn_detection": VAD}}})
        split = (clip.spans[0][1] + 1200) * 48
        await speak(h, clip.bytes[:split])
        await h.pipeline.reached_hang.wait()
        answering = h.session.response
        await speak(h, clip.bytes[split:])
        kinds = types(h.events)
        second = [i for i, k in enumerate(kinds) if k == "input_audio_buffer.speech_started"][1]
        # the interruption's speech_started, then the answer's end: cancelled, nothing after
        done = kinds.index("response.done", second)
        assert all(not k.endswith(".delta") for k in kinds[second:done])
        assert h.events[done]["response"]["id"] == answering.id
        assert h.events[done]["response"]["status"] == "cancelled"
        assert h.events[done]["response"]["status_details"]["reason"] == "turn_detected"
        assert h.pipeline.closed == 1  # the first answer's stream was closed
        assert h.metric("omni_openai_realtime_interruptions_total", reason="turn_detected") == 1
        # the second utterance was committed and answered, the cut reply in its history
        assert kinds.count("input_audio_buffer.committed") == 2
        assert h.session.response is not answering and h.session.busy
        await asyncio.wait_for(_called(h.pipeline, 2), 10)
        assert h.pipeline.calls[1][1]["history"][-1] == {"role": "assistant", "content": "Hel"}
        await h.session.close()
    asyncio.run(run())


def test_clear_forgets_speech_in_progress(clip):
    async def run():
        h = Harness()
        await h.send(type="session.update", session={"audio": {"input": {"turn_detection": VAD}}})
        await speak(h, clip.bytes[:(clip.spans[0][0] + 800) * 48])  # into the first words
        assert "input_audio_buffer.speech_started" in types(h.events)
        await h.send(type="input_audio_buffer.clear")
        await speak(h, np.zeros(24000 * 2, np.int16).tobytes())
        assert "input_audio_buffer.speech_stopped" not in types(h.events)
        assert h.pipeline.calls == []
    asyncio.run(run())

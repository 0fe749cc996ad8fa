"""Server VAD (OpenAI server_vad semantics, Silero VAD) on espeak-ng speech: events land where
the clip's words are, whatever the feed sizes, with the session's parameters applied."""
from __future__ import annotations

import numpy as np
import pytest

from omni_client.openai_server.realtime.vad import ServerVad, VadEvent
from tests.speech_clip import turns

RATE = 24000
WINDOW_MS = 32  # Silero's window at 16 kHz: the VAD's time step
# Silero decides on whole windows and needs some sound in one: its onset comes up to this late
# after the envelope's, its first quiet window this late after the envelope's end.
ONSET_LATE_MS = 3 * WINDOW_MS
OFFSET_LATE_MS = 6 * WINDOW_MS

FIRST, SECOND = "Hello there, how are you today?", "Tell me a story about the sea."


@pytest.fixture(scope="module")
def clip():
    return turns([FIRST, SECOND], lead_ms=1000, gap_ms=1500, tail_ms=2500)


def kinds(events: list[VadEvent]) -> list[str]:
    return [e.kind for e in events]


def feed_in_pieces(vad: ServerVad, data: bytes, seed: int, largest: int) -> list[VadEvent]:
    rng = np.random.default_rng(seed)
    events, at = [], 0
    while at < len(data):
        size = int(rng.integers(1, largest))
        events += vad.feed(data[at: at + size])
        at += size
    return events


def test_silence_and_low_noise_give_no_events():
    assert ServerVad().feed(np.zeros(RATE * 3, np.int16).tobytes()) == []
    hiss = np.random.default_rng(0).normal(0, 0.003 * 32768, RATE * 3).astype(np.int16)
    assert ServerVad().feed(hiss.tobytes()) == []


def test_two_utterances_start_and_stop_where_the_words_are(clip):
    vad = ServerVad(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
    events = vad.feed(clip.bytes)
    assert kinds(events) == ["speech_started", "speech_stopped"] * 2, events
    for (start, end), (started, stopped) in zip(clip.spans, zip(events[::2], events[1::2])):
        onset = started.audio_ms + 300  # where Silero heard the first word
        quiet = stopped.audio_ms - 500  # where the silence it waited out began
        assert start <= onset + WINDOW_MS and onset <= start + ONSET_LATE_MS, (start, onset)
        assert end <= quiet + WINDOW_MS and quiet <= end + OFFSET_LATE_MS, (end, quiet)


def test_feed_sizes_do_not_change_the_events(clip):
    whole = ServerVad().feed(clip.bytes)
    assert len(whole) == 4
    for seed, largest in [(0, 7), (1, 3000), (2, 40_000)]:  # odd sizes split samples in two
        assert feed_in_pieces(ServerVad(), clip.bytes, seed, largest) == whole


def test_silence_duration_decides_whether_a_pause_ends_the_turn(clip):
    short = ServerVad(silence_duration_ms=300).feed(clip.bytes)
    longer = ServerVad(silence_duration_ms=800).feed(clip.bytes)
    pause = clip.spans[1][0] - clip.spans[0][1]  # 1500 ms of zeros plus espeak-ng's own padding
    past_the_gap = ServerVad(silence_duration_ms=pause + 200).feed(clip.bytes)
    assert kinds(short) == kinds(longer) == ["speech_started", "speech_stopped"] * 2
    for a, b in zip(short[1::2], longer[1::2]):
        assert abs((b.audio_ms - a.audio_ms) - 500) < WINDOW_MS, (a, b)
    assert short[::2] == longer[::2]  # starts do not depend on it
    assert kinds(past_the_gap) == ["speech_started", "speech_stopped"]
    quiet = past_the_gap[1].audio_ms - (pause + 200)
    assert clip.spans[1][1] <= quiet + WINDOW_MS and quiet <= clip.spans[1][1] + OFFSET_LATE_MS


def test_prefix_padding_moves_the_start_back_but_not_before_the_stream(clip):
    none = ServerVad(prefix_padding_ms=0).feed(clip.bytes)
    some = ServerVad(prefix_padding_ms=300).feed(clip.bytes)
    for a, b in zip(none, some):
        assert b.audio_ms == (a.audio_ms - 300 if a.kind == "speech_started" else a.audio_ms)
    early = turns([FIRST], lead_ms=100, tail_ms=800)
    assert ServerVad(prefix_padding_ms=300).feed(early.bytes)[0] == VadEvent("speech_started", 0)


def test_reset_forgets_speech_but_keeps_the_clock(clip):
    half = len(clip.bytes) // 4 // 48 * 48  # whole milliseconds, inside the first utterance
    vad = ServerVad()
    assert kinds(vad.feed(clip.bytes[:half])) == ["speech_started"]
    vad.reset()
    fed_ms = half // 2 // (RATE // 1000)
    after = vad.feed(clip.bytes)
    alone = ServerVad().feed(clip.bytes)
    assert [(e.kind, e.audio_ms - fed_ms) for e in after] == [(e.kind, e.audio_ms) for e in alone]


def test_sessions_keep_their_own_model_state(clip):
    a, b = ServerVad(), ServerVad()
    silence = np.zeros(RATE * 2, np.int16).tobytes()
    events_a, events_b = [], []
    for at in range(0, len(clip.bytes), 9600):  # interleaved: speech into a, silence into b
        events_a += a.feed(clip.bytes[at: at + 9600])
        events_b += b.feed(silence[: min(9600, len(clip.bytes) - at)])
    assert events_a == ServerVad().feed(clip.bytes)
    assert events_b == []


@pytest.mark.parametrize("field, value", [("threshold", 1.5), ("prefix_padding_ms", -1),
                                          ("silence_duration_ms", -5)])
def test_out_of_range_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        ServerVad(**{field: value})

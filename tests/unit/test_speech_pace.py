"""Decoder chunk sizes from the measured pace (orchestrator/pace.py), alone and through
the orchestrator's speech path with scripted stages."""
from __future__ import annotations

import asyncio

import pytest

from omni_serve.orchestrator.pace import ChunkSizes, SpeechPace
from omni_serve.orchestrator.pipeline import OmniPipeline
from omni_serve.orchestrator.request import parse_request
from tests.unit.chat import tiny_chat_prompt
from tests.unit.test_orchestrator import ScriptedStages, config, tensors
from tests.unit.test_orchestrator_speech import every_code_in_order, voiced_marks


def first_chunk(pace: SpeechPace, **overrides) -> ChunkSizes:
    args = {"least": 4, "most": 12, "next_least": 24, "next_most": 24, "right_context": 0,
            "margin": 1.5, "max_replies": 4}
    return ChunkSizes(pace, **{**args, **overrides})


def sizes(chunk: ChunkSizes, step_s: float, frames: int) -> list[int]:
    """The first chunk's size asked at each of `frames` frames, one every `step_s` seconds."""
    return [chunk.size(n, 0, now=(n - 1) * step_s) for n in range(1, frames + 1)]


def schedule(chunk: ChunkSizes, step_s: float, frames: int) -> list[int]:
    """The chunks a reply of `frames` frames, one every `step_s` seconds, is cut into (each
    chunk going as soon as its frames are there, as speech._plan sends them)."""
    ends, done = [], 0
    for n in range(1, frames + 1):
        while n - done >= (size := chunk.size(n, done, now=(n - 1) * step_s)):
            done += size
            ends.append(done)
    return [b - a for a, b in zip([0, *ends], ends)]


def test_the_pace_is_a_running_mean_of_decoder_calls_and_the_audio_a_code_makes():
    pace = SpeechPace(weight=0.25)
    pace.decoded(0.2, 12, 0.96)
    assert (pace.decode_s, pace.code_audio_s) == (0.2, pytest.approx(0.08))
    pace.decoded(0.6, 0, 0.0)  # a call that voiced nothing keeps the audio per code
    assert pace.decode_s == pytest.approx(0.3) and pace.code_audio_s == pytest.approx(0.08)


def test_before_any_decoder_call_the_first_chunk_is_the_most():
    assert set(sizes(first_chunk(SpeechPace()), 0.001, 12)) == {12}


def test_the_first_chunk_is_the_fewest_frames_that_play_while_the_second_is_made():
    pace = SpeechPace(decode_s=0.05, code_audio_s=0.08)
    # second chunk: 24 steps of 10 ms + 50 ms decode = 0.29 s, x 1.5 = 0.435 s of audio: 6 frames
    got = sizes(first_chunk(pace), 0.010, 12)
    assert got[:5] == [12] * 5 and got[5] == 6
    # a slower talker needs more: 24 x 20 ms + 50 ms = 0.53 s, x 1.5 = 0.795 s: 10 frames
    got = sizes(first_chunk(pace), 0.020, 12)
    assert got.index(10) == 9 and set(got[:9]) == {12}


def test_with_more_replies_in_flight_than_the_limit_the_first_chunk_is_the_most():
    pace = SpeechPace(decode_s=0.05, code_audio_s=0.08)
    with pace.speaking(), pace.speaking():
        assert pace.replies == 2
        assert sizes(first_chunk(pace, max_replies=2), 0.010, 12)[5] == 6
        with pace.speaking():
            assert set(sizes(first_chunk(pace, max_replies=2), 0.010, 12)) == {12}
    assert pace.replies == 0


def test_a_talker_too_slow_for_any_smaller_chunk_keeps_the_most():
    pace = SpeechPace(decode_s=0.05, code_audio_s=0.08)
    assert set(sizes(first_chunk(pace), 0.040, 20)) == {12}


def test_later_chunks_grow_from_the_least_as_the_audio_ahead_allows():
    # 10 ms a frame, 80 ms of audio a frame, 50 ms a decode, margin 1.5: the chunk ending
    # at E must be back while E_prev frames play: (E - E_1) 10 ms + 50 ms <= E_prev 80 / 1.5
    pace = SpeechPace(decode_s=0.05, code_audio_s=0.08)
    chunk = first_chunk(pace, next_least=4)
    # the first: 4 frames play 0.213 s >= 4 x 10 ms + 50 ms; the second may end at
    # 4 + floor((0.213 - 0.05) / 0.01) = 20, the third at 4 + floor((1.067 - 0.05) / 0.01)
    assert schedule(chunk, 0.010, 150) == [4, 16, 24, 24, 24, 24, 24]
    # with the later chunks fixed the first must cover 24 frames' making: 6 frames
    assert schedule(first_chunk(pace), 0.010, 54) == [6, 24, 24]


def test_a_talker_slower_than_real_time_keeps_every_size_fixed():
    # 60 ms a frame x margin 1.5 > 80 ms of audio: later chunks would shrink, so none is
    # planned smaller, and the first stays the most
    pace = SpeechPace(decode_s=0.0, code_audio_s=0.08)
    assert schedule(first_chunk(pace, next_least=1), 0.060, 60) == [12, 24, 24]


def test_later_chunks_are_fixed_after_a_first_chunk_not_sized_from_the_pace():
    pace = SpeechPace()  # no decoder call measured yet
    chunk = first_chunk(pace, next_least=4)
    assert schedule(chunk, 0.010, 30) == [12]
    pace.decoded(0.05, 12, 0.96)  # measured now, but this reply started without a pace
    assert chunk.size(36, 12, now=0.35) == 24


def test_the_right_context_is_waited_for_and_the_least_is_kept():
    pace = SpeechPace(decode_s=0.0, code_audio_s=1.0)  # anything would play long enough
    chunk = first_chunk(pace, least=3, right_context=5)
    got = sizes(chunk, 0.001, 9)
    assert got[:7] == [12] * 7  # 8 frames: 3 voiced and 5 of right context
    assert got[7:] == [3, 4]
    # a least above the most is the most
    assert first_chunk(pace, least=20, most=12).least == 12
    assert first_chunk(pace, next_least=30).next_least == 24


def run_request(pipeline: OmniPipeline, cfg, seed: int) -> list:
    events: list = []
    req = parse_request("r1", tensors(modalities=["text", "audio"], seed=seed), cfg)
    asyncio.run(pipeline.run(req, events.append))
    return events


def test_a_measured_pace_makes_the_next_replys_first_chunk_smaller_and_every_code_voiced():
    # scripted decoder: 0.1 s of audio a code; talker: a code every 5 ms. The first reply
    # knows no pace and waits for 8 codes; the second's first chunk is smaller (at least 1).
    cfg = config(first_chunk_codes=8, min_first_chunk_codes=1)
    stages = ScriptedStages(code_delay=0.005, first_decode_delay=0.01)
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    firsts = []
    for seed in (1, 2):
        start = len(stages.decoded)
        events = run_request(pipeline, cfg, seed)
        codes, context, lookahead, offset, _ = stages.decoded[start]
        firsts.append(len(codes) - context - lookahead)
        assert voiced_marks(events) == every_code_in_order()
    assert firsts[0] == 8
    assert firsts[1] < 8
    assert pipeline.pace.replies == 0  # each reply counted only while in flight


def test_with_a_least_for_later_chunks_the_second_is_smaller_and_every_code_voiced():
    # talker: ~5 ms a frame, 0.1 s of audio each; with chunk_codes above the reply's 23
    # frames a fixed schedule sends the rest as one second chunk once the talker is done.
    # The second reply's second chunk goes as soon as it is back before the first has
    # played: at most ~19 frames on, fewer however slow a loaded machine makes the talker
    cfg = config(first_chunk_codes=8, min_first_chunk_codes=1, chunk_codes=40,
                 min_chunk_codes=1)
    stages = ScriptedStages(code_delay=0.01, first_decode_delay=0.01)
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    run_request(pipeline, cfg, 1)  # measures the pace
    start = len(stages.decoded)
    events = run_request(pipeline, cfg, 2)
    voiced = [len(codes) - context - lookahead
              for codes, context, lookahead, *_ in stages.decoded[start:]]
    assert voiced[0] < 8 and len(voiced) >= 3, voiced
    assert sum(voiced) == len(every_code_in_order())
    assert voiced_marks(events) == every_code_in_order()


def test_while_more_replies_than_the_limit_speak_the_first_chunk_is_first_chunk_codes():
    cfg = config(first_chunk_codes=8, min_first_chunk_codes=1, first_chunk_pace_replies=1)
    stages = ScriptedStages(code_delay=0.005, first_decode_delay=0.01)
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    run_request(pipeline, cfg, 1)  # measures the pace

    async def two_at_once():
        events: list[list] = [[], []]
        await asyncio.gather(*(pipeline.run(parse_request(
            f"r{i}", tensors(modalities=["text", "audio"], seed=i), cfg), events[i].append)
            for i in range(2)))
        return events

    start = len(stages.decoded)
    for events in asyncio.run(two_at_once()):
        assert events[-1].metrics["first_chunk_codes"] == 8
        assert voiced_marks(events) == every_code_in_order()
    assert len(stages.decoded) > start


def test_without_a_least_the_first_chunk_is_always_first_chunk_codes():
    cfg = config(first_chunk_codes=3)
    stages = ScriptedStages(code_delay=0.001)
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    for seed in (1, 2):
        start = len(stages.decoded)
        run_request(pipeline, cfg, seed)
        codes, context, lookahead, *_ = stages.decoded[start]
        assert len(codes) - context - lookahead == 3

"""omni-bench timeline: the hops of a request's timeline, the time no stage call was in
flight, the medians, the picture and the table (hand-built timelines, no server)."""
from __future__ import annotations

import pytest

from omni_tools.bench import timeline as tl


def call(stage: str, sent: float, first: float | None, last: float | None, n: int = 1) -> dict:
    return {"stage": stage, "sent_s": sent, "first_s": first, "last_s": last, "responses": n}


def speech(shift: float = 0.0) -> dict:
    """A speech request: thinker 0.1-1.0, talker 0.3-1.2, two decoder chunks; the second
    chunk out at 1.3, then 0.1 s nobody computes."""
    return {"calls": [call("thinker", 0.1, 0.2 + shift, 1.0, 9),
                      call("talker", 0.3 + shift, 0.5 + shift, 1.2, 5),
                      call("audio_decoder", 0.6 + shift, 0.7 + shift, 0.7 + shift),
                      call("audio_decoder", 1.2, 1.25, 1.25)],
            "steps": [{"step": "task_started", "at_s": 0.02},
                      {"step": "talker_ready", "at_s": 0.25 + shift},
                      {"step": "audio_out", "at_s": 0.75 + shift},
                      {"step": "audio_out", "at_s": 1.3}],
            "end_s": 1.4}


def test_each_hop_is_the_gap_between_its_two_stamps():
    h = tl.hops(speech())
    assert h["start -> task started"] == pytest.approx(0.02)
    assert h["start -> thinker sent"] == pytest.approx(0.1)
    assert h["thinker sent -> first token"] == pytest.approx(0.1)
    assert h["thinker first token -> talker sent"] == pytest.approx(0.1)
    assert h["talker sent -> first codes"] == pytest.approx(0.2)
    assert h["first codes -> first decoder chunk sent"] == pytest.approx(0.1)
    assert h["first decoder chunk: sent -> back"] == pytest.approx(0.1)
    assert h["decoder chunk back -> first audio out"] == pytest.approx(0.05)
    assert h["start -> first audio out"] == pytest.approx(0.75)
    assert h["start -> end"] == pytest.approx(1.4)


def test_no_call_in_flight_counts_overlapping_calls_once():
    # busy: 0.1-1.25 (thinker, talker and decoders overlap); idle: 0-0.1 and 1.25-1.4
    assert tl.idle_s(speech()) == pytest.approx(0.25)
    disjoint = {"calls": [call("a", 0.0, 0.1, 0.2), call("b", 0.5, 0.6, 0.7)], "end_s": 1.0}
    assert tl.idle_s(disjoint) == pytest.approx(0.6)
    unanswered = {"calls": [call("a", 0.2, None, None)], "end_s": 1.0}
    assert tl.idle_s(unanswered) == pytest.approx(0.2)


def test_a_text_only_request_has_no_speech_hops():
    text = {"calls": [call("thinker", 0.05, 0.1, 0.5, 4)], "steps": [], "end_s": 0.6}
    h = tl.hops(text)
    assert h["start -> thinker sent"] == pytest.approx(0.05)
    assert h["start -> task started"] is None  # a timeline from before the stamp
    assert h["thinker first token -> talker sent"] is None
    assert h["start -> first audio out"] is None


def test_medians_are_per_hop_over_the_requests():
    m = tl.median_hops([speech(0.0), speech(0.1), speech(0.3)])
    assert m["thinker sent -> first token"] == pytest.approx(0.2)
    assert m["start -> end"] == pytest.approx(1.4)


def test_the_summary_keeps_the_median_requests_timeline():
    rows = [{"client_first_audio_s": a, "client_latency_s": 1.5, "timeline": {**speech(),
                                                                            "end_s": end}}
            for a, end in ((0.8, 1.4), (0.9, 2.0), (1.0, 1.6))]
    s = tl.summarize(rows)
    assert s["requests"] == 3 and s["example"]["end_s"] == 1.6
    assert s["client_first_audio_s_p50"] == pytest.approx(0.9)
    # the first audio went out at 0.75 s on the orchestrator's clock
    assert s["entry_s_p50"] == pytest.approx(0.15)


def test_the_picture_has_a_row_per_call_and_the_table_a_row_per_hop(tmp_path):
    results = {"max_tokens": 32, "models": {"tiny": {"family": "Qwen2.5-Omni", "concurrency": {
        "1": {**tl.summarize([{"client_first_audio_s": 0.8, "client_latency_s": 1.5,
                               "timeline": speech()}]), "load_average_1m": 1.5}}}}}
    (path,) = tl.plots(results, tmp_path)
    assert path.name == "timeline-tiny-c1.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    text = tl.table(results)
    assert "| Qwen2.5-Omni c=1 |" in text
    assert "| first decoder chunk: sent -> back | 100 |" in text
    assert "| thinker first token -> talker sent | 100 |" in text
    assert "| decoder chunk back -> first audio out* | 50 |" in text
    assert "| entry hop (client's first audio - the orchestrator's)* | 50 |" in text
    assert "| first audio at the client | 800 |" in text
    assert "Qwen2.5-Omni c=1 1.5" in text

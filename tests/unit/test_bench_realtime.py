"""omni-bench realtime without a server: its turn audio, the summary of a level's turns, and
the page's table and ratio."""
from __future__ import annotations

import numpy as np

from omni_tools.bench import realtime


def test_each_session_and_turn_speaks_its_own_second_of_pcm16():
    a, b, c = (realtime.turn_audio(s, t) for s, t in ((0, 0), (0, 1), (1, 0)))
    assert len(a) == len(b) == len(c) == 24000 * 2
    assert len({a, b, c}) == 3
    peak = np.abs(np.frombuffer(a, "<i2")).max()
    assert 0.29 * 32767 <= peak <= 0.3 * 32767


def test_a_level_summary_reads_first_audio_and_real_time_factor_percentiles():
    turns = [{"session": i, "turn": 0, "status": "completed", "first_audio_s": 0.5 + i,
              "audio_s": 2.0, "rtf": 0.5 * (i + 1)} for i in range(4)]
    turns.append({"session": 4, "turn": 0, "status": "cancelled", "first_audio_s": None,
                  "audio_s": 0.0, "rtf": None})
    s = realtime.summarize(turns, wall_s=10.0)
    assert s["turns"] == 5 and s["audio_s"] == 8.0
    assert s["first_audio_p50_s"] == 2.0 and s["rtf_p50"] == 1.25
    assert 3.4 < s["first_audio_p99_s"] <= 3.5 and s["statuses"] == ["cancelled", "completed"]


def test_the_page_shows_each_level_and_the_one_session_ratio():
    level = realtime.summarize([{"session": 0, "turn": 0, "status": "completed",
                                 "first_audio_s": 1.5, "audio_s": 3.0, "rtf": 0.8}], 4.0)
    results = {"levels": {"4": level, "1": level}, "sessions": 4, "turns": 2, "max_tokens": 32,
               "voice": "alloy"}
    table = realtime.table(results)
    assert table.index("| 1 |") < table.index("| 4 |") and "1.50 / 1.50" in table
    (ratio,) = realtime.ratios(results)
    assert ratio.value == 1.5 and ratio.met
    (missing,) = realtime.ratios({**results, "levels": {"4": level}})
    assert missing.value is None and "not measured" in missing.note

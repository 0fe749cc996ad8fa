"""omni-bench first-chunk: the listener's stalls and the default it picks (no server)."""
from __future__ import annotations

import pytest

from omni_tools.bench.first_chunk import choose, stalls, variants


@pytest.mark.parametrize(("chunks", "expected"), [
    ([], (0, 0.0, None)),
    ([(0.3, 1.0)], (0, 0.0, None)),
    # each chunk arrives while the one before still plays
    ([(0.3, 1.0), (1.0, 2.0), (3.2, 0.5)], (0, 0.0, None)),
    # the second arrives 0.2 s after the first has played; the third while the second plays
    ([(0.3, 0.5), (1.0, 2.0), (2.5, 1.0)], (1, 0.2, 1)),
    # a stall delays what follows: the third, at 3.4, is late against 1.0 + 2.0 = 3.0
    ([(0.3, 0.5), (1.0, 2.0), (3.4, 1.0)], (2, 0.6, 1)),
    # only the third is late
    ([(0.0, 1.0), (0.5, 1.0), (2.5, 1.0)], (1, 0.5, 2)),
    # arriving exactly as the audio before ends is no stall
    ([(0.0, 1.0), (1.0, 1.0)], (0, 0.0, None)),
])
def test_stalls_are_the_gaps_a_listener_hears(chunks, expected):
    heard = stalls(chunks)
    assert (heard.count, heard.seconds, heard.first) == (
        expected[0], pytest.approx(expected[1]), expected[2])


def test_the_default_is_the_smallest_first_chunk_the_second_never_came_late_after():
    def cells(**late):
        return {k[1:].replace("_", "-"): {"second_chunk_late": v, "stalled_requests": 9}
                for k, v in late.items()}

    assert choose({1: cells(f4=3, f8=0, f12=0, f24=1)}) == 8
    # 8 was followed late once at concurrency 4: 12 is the smallest that never was
    assert choose({1: cells(f4=3, f8=0, f12=0), 4: cells(f4=5, f8=1, f12=0)}) == 12
    # at concurrency 4 every size was: the decoder is slower than real time there, no vote
    assert choose({1: cells(f12=3, f24=2, f48=0), 4: cells(f12=5, f24=2, f48=1)}) == 48
    assert choose({1: cells(f4=1)}) is None
    # adaptive variants (LEAST-MOST) are not a fixed default
    assert choose({1: cells(f4_12=0, f8=1, f12=0)}) == 12
    assert choose({}) is None


def test_variants_are_fixed_sizes_and_least_most_ranges():
    fixed = {"first_chunk_codes": 12, "min_first_chunk_codes": 12, "min_chunk_codes": None}
    assert variants([12], ["4-12", "4-12x1.2", "4-12x1.2/6"]) == {
        "12": fixed, "4-12": {**fixed, "min_first_chunk_codes": 4},
        "4-12x1.2": {**fixed, "min_first_chunk_codes": 4, "first_chunk_margin": 1.2},
        "4-12x1.2/6": {**fixed, "min_first_chunk_codes": 4, "first_chunk_margin": 1.2,
                       "min_chunk_codes": 6}}
    for bad in ("12-4", "4", "a-12", "4-12xa", "4-12/0", "4-12/a"):
        with pytest.raises(SystemExit, match="LEAST-MOST"):
            variants([], [bad])

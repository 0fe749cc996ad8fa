"""omni-bench profile's helpers (tools/omni_tools/bench/profile.py): which stage processes
it samples, and what it reads from py-spy's raw output."""
from __future__ import annotations

import pytest

from omni_tools.bench import profile


def test_a_stage_not_served_is_named_rather_than_sampling_nothing(monkeypatch):
    monkeypatch.setattr(profile, "stub_pids", lambda pid, stages: {"omni": 11, "llm": 12})
    assert profile.stage_pids(1, ["omni", "llm"]) == {"omni": 11, "llm": 12}
    with pytest.raises(ValueError, match=r"no stage process for qwen3-tiny \(found omni, llm\)"):
        profile.stage_pids(1, ["omni", "qwen3-tiny"])


def test_self_time_counts_each_samples_leaf_frame():
    raw = ("main (a.py:1);work (b.py:2);conv (pkg/conv.py:9) 6\n"
           "main (a.py:1);wait (c.py:3) 2\n"
           "main (a.py:1);work (b.py:2);conv (pkg/conv.py:9) 2\n")
    assert profile.self_time(raw, top=1) == (10, [("conv (conv.py:9)", 0.8)])
    assert profile.self_time("", top=3) == (0, [])


def test_an_unknown_checkpoint_is_refused_with_the_known_ones(capsys):
    import argparse

    ap = argparse.ArgumentParser()
    profile.add_arguments(ap)
    assert ap.parse_args(["--checkpoint", "qwen3-tiny"]).checkpoint == "qwen3-tiny"
    with pytest.raises(SystemExit):
        ap.parse_args(["--checkpoint", "qwen3-omni"])
    assert "invalid choice: 'qwen3-omni'" in capsys.readouterr().err

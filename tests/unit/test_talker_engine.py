"""The talker engine's per-step feed (omni_serve.families.qwen2_5_omni.talker_engine), without vLLM.

What each decode step adds (the thinker's reply rows, then text eos, then
text pad), its 3D positions, and when the scheduler may run a request.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from omni_serve.families.qwen2_5_omni import talker_engine as te
from omni_serve.llm.hidden_states import write_final_rows

HALF = 4  # embedding width; a row is [embedding | hidden]
TAIL = np.stack([np.full(HALF, 100.0), np.full(HALF, 200.0)]).astype(np.float32)  # eos, pad


def _rows(n: int) -> np.ndarray:
    """Row r = [r, r, r, r | 0.5, ...]: its reply vector (embedding + hidden) is r + 0.5."""
    embed = np.repeat(np.arange(n, dtype=np.float32)[:, None], HALF, 1)
    return np.concatenate([embed, np.full((n, HALF), 0.5, np.float32)], 1)


@pytest.fixture
def feed(tmp_path):
    path = tmp_path / "tok"
    path.write_bytes(_rows(6).tobytes())  # prompt rows 0..3 + reply rows 4, 5
    positions = [[0, 1, 2, 2, 3, 4], [0, 1, 1, 2, 3, 4], [0, 1, 2, 1, 3, 4]]  # prompt_len 6
    return {"file": str(path), "width": 2 * HALF, "prompt_len": 6, "positions": positions,
            "delta": -2}


def test_prompt_positions_come_from_the_request_and_add_nothing(feed):
    extra, pos = te.reply_vectors(feed, 0, 6, TAIL)
    assert (extra == 0).all()
    assert pos.tolist() == feed["positions"]


def test_a_decode_step_adds_thinker_row_q_minus_1_at_position_q_plus_delta(feed):
    extra, pos = te.reply_vectors(feed, 6, 1, TAIL)  # talker position 6 reads thinker row 5
    assert extra[0].tolist() == [5.5] * HALF
    assert pos[:, 0].tolist() == [4, 4, 4]


def test_after_the_reply_come_text_eos_then_text_pad(feed):
    write_final_rows(feed["file"], 6)  # the thinker ended with 6 rows
    extra, _ = te.reply_vectors(feed, 6, 4, TAIL)  # rows 5, 6 (= final), 7, 8
    assert extra[0].tolist() == [5.5] * HALF
    assert extra[1].tolist() == TAIL[0].tolist()
    assert extra[2].tolist() == extra[3].tolist() == TAIL[1].tolist()


def test_the_scheduler_waits_for_the_next_row_until_the_thinker_writes_or_ends(feed):
    assert te.vector_ready(feed, 5)  # prompt
    assert te.vector_ready(feed, 6)  # row 5 is written
    assert not te.vector_ready(feed, 7)  # row 6 is not, and the thinker goes on
    with open(feed["file"], "ab") as f:
        f.write(_rows(7)[6:].tobytes())
    assert te.vector_ready(feed, 7)
    assert not te.vector_ready(feed, 8)
    write_final_rows(feed["file"], 7)
    assert te.vector_ready(feed, 8) and te.vector_ready(feed, 50)


def test_a_removed_file_lets_the_request_run_out_on_pad(feed):
    os.unlink(feed["file"])
    assert te.vector_ready(feed, 9)
    extra, _ = te.reply_vectors(feed, 9, 2, TAIL)
    assert (extra == TAIL[1]).all()


def test_a_partly_written_row_is_not_ready(feed):
    with open(feed["file"], "ab") as f:
        f.write(_rows(7)[6, : HALF].tobytes())  # half of row 6
    assert te.rows_in(feed["file"], feed["width"]) == 6
    assert not te.vector_ready(feed, 7)


@pytest.mark.parametrize("path, ok", [
    ("/dev/shm/omni_hs_ab12_x/0123abcd", True),
    ("/tmp/omni_hs_q1/tok-1", True),
    ("/dev/shm/omni_hs_ab/../etc/passwd", False),
    ("/etc/passwd", False),
    ("/dev/shm/other/tok", False),
    ("relative/omni_hs_a/tok", False),
])
def test_only_hidden_state_files_are_read(path, ok):
    assert te.valid_source(path) is ok


def test_a_file_removed_between_the_check_and_the_read_runs_out_on_pad(feed, monkeypatch):
    """The orchestrator removes the thinker's file when its request ends; a talker step
    already scheduled must not fail (it would take the engine, and every request on it,
    down): found in a fresh-clone CI run."""
    os.unlink(feed["file"])
    monkeypatch.setattr(te, "ended_rows", lambda path: None)  # it still existed at the check
    monkeypatch.setattr(te, "rows_in", lambda path, width: 6)
    extra, _ = te.reply_vectors(feed, 6, 2, TAIL)
    assert (extra == TAIL[1]).all()

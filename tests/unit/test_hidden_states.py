"""The hidden-state capture: the worker's writes by position, the stage's reads by output."""
from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_serve.contract import LLM
from omni_serve.llm import hidden_states
from omni_serve.llm.hidden_states import CaptureFile, HiddenStatesExtension, MissingRowsError
from omni_serve.llm.request import LLMOutput, merge_outputs, parse_request

H = 4  # hidden size


class FakeRunner:
    """The parts of vLLM's GPU/CPU model runner the capture touches."""

    def __init__(self, with_embeds: bool = True):
        self.with_embeds = with_embeds
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict = {}
        self.model = SimpleNamespace(embed_input_ids=lambda ids: self.embed(ids))

    @staticmethod
    def embed(ids: torch.Tensor) -> torch.Tensor:
        return ids.float()[:, None].repeat(1, H)

    def _model_forward(self, input_ids=None, positions=None, inputs_embeds=None, **_):
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        return x * 10 + 1  # "hidden states"

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        ids = torch.tensor(scheduler_output.flat_ids)
        if self.with_embeds:
            self._model_forward(input_ids=None, inputs_embeds=self.embed(ids))
        else:
            self._model_forward(input_ids=ids, inputs_embeds=None)
        return None


def _request(token: str | None) -> SimpleNamespace:
    extra = {hidden_states.EXTRA_ARG: token} if token is not None else None
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))


def _step(runner, batch: list[tuple[str, list[int], int, bool]]):
    """Run one step: (req_id, token ids this step, computed before, new?) in batch order."""
    runner.input_batch.req_ids = [b[0] for b in batch]
    new = [SimpleNamespace(req_id=r, num_computed_tokens=c) for r, _, c, is_new in batch if is_new]
    cached = [(r, c) for r, _, c, is_new in batch if not is_new]
    out = SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens={r: len(ids) for r, ids, _, _ in batch},
        flat_ids=[t for _, ids, _, _ in batch for t in ids])
    runner.execute_model(out)


class Worker(HiddenStatesExtension):
    def __init__(self, runner):
        self.model_runner = runner


@pytest.fixture
def capture_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(hidden_states.ENV_DIR, str(tmp_path))
    return tmp_path


def _rows(capture: CaptureFile, n: int) -> np.ndarray:
    return asyncio.run(capture.read_until(n, timeout_s=0.5))


@pytest.mark.parametrize("with_embeds", [True, False])
def test_each_request_gets_its_rows_at_its_positions(capture_dir, with_embeds):
    runner = FakeRunner(with_embeds)
    assert Worker(runner).omni_capture_hidden_states() == ""
    a, b = CaptureFile(str(capture_dir), H), CaptureFile(str(capture_dir), H)
    runner.requests = {"a": _request(a.token), "b": _request(b.token), "c": _request(None)}
    # prefill of a (3 tokens) and c beside it; then a decodes while b prefills; then both decode
    _step(runner, [("c", [7, 7], 0, True), ("a", [1, 2, 3], 0, True)])
    _step(runner, [("a", [4], 3, False), ("b", [5, 6], 0, True), ("c", [8], 2, False)])
    _step(runner, [("b", [9], 2, False), ("a", [10], 4, False)])

    got_a, got_b = _rows(a, 5), _rows(b, 3)
    for got, ids in ((got_a, [1, 2, 3, 4, 10]), (got_b, [5, 6, 9])):
        embeds = FakeRunner.embed(torch.tensor(ids)).numpy()
        np.testing.assert_array_equal(got[:, :H], embeds)
        np.testing.assert_array_equal(got[:, H:], embeds * 10 + 1)
    assert sorted(os.listdir(capture_dir)) == sorted([a.token, b.token])  # nothing for c


def test_a_recomputed_request_rewrites_the_same_rows(capture_dir):
    runner = FakeRunner()
    Worker(runner).omni_capture_hidden_states()
    a = CaptureFile(str(capture_dir), H)
    runner.requests = {"a": _request(a.token)}
    _step(runner, [("a", [1, 2], 0, True)])
    _step(runner, [("a", [3], 2, False)])
    _step(runner, [("a", [1, 2, 3], 0, True)])  # preempted, then recomputed from the start
    assert os.path.getsize(a.path) == 3 * 2 * H * 4
    np.testing.assert_array_equal(_rows(a, 3)[:, 0], [1, 2, 3])


@pytest.mark.parametrize("token", ["../escape", "a/b", "", "x" * 65, 7])
def test_the_worker_writes_only_plain_named_files_in_its_directory(capture_dir, token):
    runner = FakeRunner()
    Worker(runner).omni_capture_hidden_states()
    runner.requests = {"a": _request(token)}
    _step(runner, [("a", [1, 2], 0, True)])
    assert os.listdir(capture_dir) == []
    assert not (capture_dir.parent / "escape").exists()


def test_the_worker_never_creates_a_file_whose_reader_is_gone(capture_dir):
    runner = FakeRunner()
    Worker(runner).omni_capture_hidden_states()
    a = CaptureFile(str(capture_dir), H)
    a.close()  # the request ended (e.g. aborted) while the engine still ran its step
    runner.requests = {"a": _request(a.token)}
    _step(runner, [("a", [1], 0, True)])
    assert os.listdir(capture_dir) == []


def test_installing_twice_wraps_once_and_a_runner_without_the_hooks_is_refused(capture_dir):
    runner = FakeRunner()
    worker = Worker(runner)
    worker.omni_capture_hidden_states()
    forward = runner._model_forward
    assert worker.omni_capture_hidden_states() == ""
    assert runner._model_forward is forward
    assert "has no _model_forward" in Worker(SimpleNamespace()).omni_capture_hidden_states()


def test_rows_are_read_as_outputs_account_for_them(capture_dir):
    capture = CaptureFile(str(capture_dir), H)
    rows = np.arange(6 * 2 * H, dtype=np.float32).reshape(6, 2 * H)
    os.pwrite(os.open(capture.path, os.O_WRONLY), rows[:4].tobytes(), 0)
    assert CaptureFile.expected_rows(prompt_tokens=3, output_tokens=0) == 0
    assert CaptureFile.expected_rows(prompt_tokens=3, output_tokens=2) == 4
    np.testing.assert_array_equal(_rows(capture, 3), rows[:3])
    np.testing.assert_array_equal(_rows(capture, 4), rows[3:4])
    assert _rows(capture, 4).shape == (0, 2 * H)
    with pytest.raises(MissingRowsError, match="positions 4..5 never arrived"):
        _rows(capture, 6)
    capture.close()
    assert not os.path.exists(capture.path)


@pytest.mark.parametrize("completed", [False, True])
def test_a_handed_over_file_stays_for_its_caller_only_if_its_request_completed(
        capture_dir, completed):
    capture = CaptureFile(str(capture_dir), H)
    capture.handed_over = True
    capture.completed = completed  # failed or aborted: its caller may not know the name
    hidden_states.write_final_rows(capture.path, 3)
    capture.close()
    for path in (capture.path, capture.path + hidden_states.ROWS_SUFFIX):
        assert os.path.exists(path) is completed


def test_a_row_count_written_as_its_caller_removes_the_file_is_not_left_behind(
        capture_dir, monkeypatch):
    capture = CaptureFile(str(capture_dir), H)
    capture.handed_over = capture.completed = True
    replace = os.replace

    def caller_ends_first(src, dst):  # the caller's end comes between the check and the write
        hidden_states.remove_handed_over(capture.path)
        replace(src, dst)

    monkeypatch.setattr(hidden_states.os, "replace", caller_ends_first)
    hidden_states.write_final_rows(capture.path, 3)
    capture.close()
    assert os.listdir(capture_dir) == []


def test_merged_deltas_keep_every_row_in_order():
    def out(rows):
        return LLMOutput(text="x", finish_reason=None, num_input_tokens=1, num_output_tokens=1,
                         final=False, hidden=np.full((rows, 2), rows, np.float32))

    merged = merge_outputs([out(3), out(1), out(1)])
    assert merged.hidden[:, 0].tolist() == [3, 3, 3, 1, 1]


def test_return_hidden_states_is_a_request_flag():
    req = parse_request("r", {LLM.TEXT_INPUT: np.array([b"hi"], object),
                              LLM.RETURN_HIDDEN_STATES: np.array([True])})
    assert req.return_hidden_states
    assert parse_request("r", {LLM.TEXT_INPUT: np.array([b"hi"], object)},
                         {LLM.RETURN_HIDDEN_STATES: "true"}).return_hidden_states


def test_a_handed_over_file_outlives_the_request_until_its_caller_deletes_it(capture_dir):
    capture = CaptureFile(str(capture_dir), H)
    rows = np.arange(5 * 2 * H, dtype=np.float32).reshape(5, 2 * H)
    os.pwrite(os.open(capture.path, os.O_WRONLY), rows.tobytes(), 0)
    assert asyncio.run(capture.span_until(3)) == (0, 3, 2 * H)
    assert asyncio.run(capture.span_until(5)) == (3, 2, 2 * H)
    capture.handed_over = True
    capture.completed = True
    capture.close()
    embeds, hidden = hidden_states.split_rows(hidden_states.read_rows(capture.path, 3, 2, 2 * H))
    np.testing.assert_array_equal(embeds, rows[3:, :H])
    np.testing.assert_array_equal(hidden, rows[3:, H:])


def test_a_handed_over_file_its_caller_removed_is_not_waited_for(capture_dir):
    """The caller (the orchestrator) removes the file when its request ends, e.g. on a
    cancel; the engine can no longer write to it, so the stage must not wait the rows out
    (it did, 5 s, then failed the request uncounted: found in a fresh-clone CI run)."""
    capture = CaptureFile(str(capture_dir), H)
    os.pwrite(os.open(capture.path, os.O_WRONLY), np.zeros((2, 2 * H), np.float32).tobytes(), 0)
    capture.handed_over = True
    os.unlink(capture.path)
    # rows 2, 3 will never come: no MissingRowsError after the timeout, an answer now
    assert asyncio.run(capture.span_until(4, timeout_s=5.0)) == (0, 4, 2 * H)
    capture.close()


def test_handed_over_files_left_behind_are_removed_when_a_capture_starts(capture_dir):
    old, fresh = capture_dir / "left-behind", capture_dir / "being-read"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    past = os.path.getmtime(old) - hidden_states.HANDED_OVER_TTL_S - 1
    os.utime(old, (past, past))
    CaptureFile(str(capture_dir), H).close()
    assert sorted(os.listdir(capture_dir)) == ["being-read"]


def test_hidden_states_in_shm_needs_return_hidden_states():
    from omni_serve.errors import RequestError

    with pytest.raises(RequestError, match="hidden_states_in_shm: needs return_hidden_states"):
        parse_request("r", {LLM.TEXT_INPUT: np.array([b"hi"], object),
                            LLM.HIDDEN_STATES_IN_SHM: np.array([True])})

"""omni_talker requests: what a talker request must carry, named field by field (no server)."""
from __future__ import annotations

import numpy as np
import pytest

from omni_serve.contract import TALKER, TALKER_CONTRACT
from omni_serve.errors import RequestError
from omni_serve.talker.request import TalkerOutput, aborted_output, merge_outputs, parse_request

FILE = "/dev/shm/omni_hs_x/y"


def tensors(**extra):
    base = {TALKER.THINKER_HIDDEN_STATES_FILE: np.array([FILE.encode()], dtype=np.object_),
            TALKER.PROMPT_TOKEN_IDS: np.array([5, 6, 7], np.int64)}
    return {**base, **extra}


def test_a_talker_request_carries_the_thinkers_file_prompt_media_voice_and_sampling():
    req = parse_request("t-1", tensors(**{
        TALKER.IMAGE_GRID_THW: np.array([[1, 4, 6]], np.int64),
        TALKER.AUDIO_FEATURE_LENGTHS: np.array([300], np.int64),
        TALKER.VOICE: np.array([b"Ethan"], dtype=np.object_),
        TALKER.SAMPLING_PARAMETERS: np.array([b'{"temperature": 0, "max_tokens": 9}'],
                                             dtype=np.object_)}))
    assert req.request_id == "t-1"
    assert req.feed.source == FILE and req.feed.prompt_token_ids == (5, 6, 7)
    assert req.feed.voice == "Ethan"
    assert req.feed.image_grid_thw.tolist() == [[1, 4, 6]]
    assert req.feed.audio_feature_lengths.tolist() == [300]
    assert req.sampling == {"temperature": 0.0, "max_tokens": 9}


def test_a_video_comes_with_its_grid_and_seconds_a_grid_step_together():
    grid = {TALKER.VIDEO_GRID_THW: np.array([[2, 24, 24]], np.int64)}
    seconds = {TALKER.VIDEO_SECOND_PER_GRID: np.array([2.0], np.float32)}
    req = parse_request("t", tensors(**grid, **seconds))
    assert req.feed.video_grid_thw.tolist() == [[2, 24, 24]]
    assert req.feed.video_second_per_grid.dtype == np.float32
    assert req.feed.video_second_per_grid.tolist() == [2.0]
    for given, missing in ((grid, TALKER.VIDEO_SECOND_PER_GRID), (seconds, TALKER.VIDEO_GRID_THW)):
        with pytest.raises(RequestError, match="is required with") as e:
            parse_request("t", tensors(**given))
        assert e.value.field == missing
    for bad in (np.array([2.0, 2.0], np.float32), np.array([0.0], np.float32)):
        with pytest.raises(RequestError) as e:
            parse_request("t", tensors(**grid, **{TALKER.VIDEO_SECOND_PER_GRID: bad}))
        assert e.value.field == TALKER.VIDEO_SECOND_PER_GRID


@pytest.mark.parametrize("missing", [TALKER.THINKER_HIDDEN_STATES_FILE, TALKER.PROMPT_TOKEN_IDS])
def test_a_request_without_the_thinkers_file_or_prompt_names_what_is_missing(missing):
    inputs = tensors()
    del inputs[missing]
    with pytest.raises(RequestError, match="is required") as e:
        parse_request("t", inputs)
    assert e.value.field == missing


@pytest.mark.parametrize("field,value,fragment", [
    (TALKER.PROMPT_TOKEN_IDS, np.array([1, -2], np.int64), ">= 0"),
    (TALKER.IMAGE_GRID_THW, np.array([[1, 0, 4]], np.int64), ">= 1"),
    (TALKER.AUDIO_FEATURE_LENGTHS, np.array([1.5], np.float32), "integers"),
    (TALKER.SAMPLING_PARAMETERS, np.array([b"{not json"], dtype=np.object_), "invalid JSON"),
])
def test_bad_values_name_their_field(field, value, fragment):
    with pytest.raises(RequestError, match=fragment) as e:
        parse_request("t", tensors(**{field: value}))
    assert e.value.field.startswith(field)


def test_codes_are_frames_by_groups_and_merge_in_order():
    outs = [TalkerOutput(np.array([[1], [2]]), None, False), TalkerOutput(np.array([[3]]), "stop", True)]
    merged = merge_outputs(outs)
    assert merged.codes.tolist() == [[1], [2], [3]] and merged.final and merged.finish_reason == "stop"
    assert merge_outputs(outs[:1]) is outs[0]
    empty = aborted_output()
    assert empty.codes.shape == (0, 1) and empty.finish_reason == "abort" and empty.final


def test_the_contract_streams_codec_ids_as_frames_by_groups():
    assert TALKER_CONTRACT.decoupled and TALKER_CONTRACT.batching == "engine"
    assert TALKER_CONTRACT.output(TALKER.CODEC_IDS).dims == (-1, -1)
    # every input is optional to Triton, so that an abort control request (no tensors)
    # reaches the stage; the stage requires these two of a generation request
    assert all(s.optional for s in TALKER_CONTRACT.inputs)
    for missing in (TALKER.THINKER_HIDDEN_STATES_FILE, TALKER.PROMPT_TOKEN_IDS):
        tensors = {TALKER.THINKER_HIDDEN_STATES_FILE: np.array([b"/dev/shm/x"], dtype=object),
                   TALKER.PROMPT_TOKEN_IDS: np.array([1, 2], dtype=np.int64)}
        del tensors[missing]
        with pytest.raises(RequestError, match=missing):
            parse_request("r", tensors)

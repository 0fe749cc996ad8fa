"""Requests and responses of the omni_talker stage (runs inside the Triton stub and in tests).

`parse_request` turns the named input tensors (already numpy) into a
`TalkerRequest`, validating everything before the engine sees it; outputs are
`TalkerOutput`s of codec codes, [frames, groups].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_serve.contract import TALKER
from omni_serve.errors import RequestError
from omni_serve.fields import boolean, scalar, text
from omni_serve.llm import sampling
from omni_serve.llm.request import counts, token_ids


@dataclass(frozen=True)
class TalkerInput:
    """What one talker request carries for the family's talker side (its contract inputs)."""

    source: str  # the thinker's handed-over hidden-state file
    prompt_token_ids: tuple[int, ...]
    voice: str | None = None
    image_grid_thw: np.ndarray | None = None
    audio_feature_lengths: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None
    video_second_per_grid: np.ndarray | None = None
    # the thinker heard each video's soundtrack (its frames lengths end audio_feature_lengths)
    use_audio_in_video: bool = False


@dataclass
class TalkerRequest:
    request_id: str
    feed: TalkerInput
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class TalkerOutput:
    """New codes since the last output, [frames, groups] int64."""

    codes: np.ndarray
    finish_reason: str | None
    final: bool


def aborted_output(groups: int = 1) -> TalkerOutput:
    """The final output of a request stopped before the engine ran it."""
    return TalkerOutput(np.zeros((0, groups), dtype=np.int64), "abort", True)


def merge_outputs(outputs: list[TalkerOutput]) -> TalkerOutput:
    """Several consecutive outputs of one request as one (codes joined)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return TalkerOutput(np.concatenate([o.codes for o in outputs]), last.finish_reason, last.final)


def _video(tensors: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    """Each video's grid and its seconds a temporal grid step, given together."""
    grid = counts(TALKER.VIDEO_GRID_THW, tensors.get(TALKER.VIDEO_GRID_THW), "n,3")
    seconds = tensors.get(TALKER.VIDEO_SECOND_PER_GRID)
    if (grid is None) != (seconds is None):
        have, need = ((TALKER.VIDEO_GRID_THW, TALKER.VIDEO_SECOND_PER_GRID) if grid is not None
                      else (TALKER.VIDEO_SECOND_PER_GRID, TALKER.VIDEO_GRID_THW))
        raise RequestError(need, f"is required with {have}")
    if seconds is not None:
        seconds = np.asarray(seconds).reshape(-1)
        if seconds.dtype.kind not in "fiu" or len(seconds) != len(grid):
            raise RequestError(TALKER.VIDEO_SECOND_PER_GRID,
                               f"must be {len(grid)} numbers, one per video of "
                               f"{TALKER.VIDEO_GRID_THW}, got {seconds.size} of {seconds.dtype}")
        if not np.all(np.isfinite(seconds)) or seconds.min() <= 0:
            raise RequestError(TALKER.VIDEO_SECOND_PER_GRID,
                               f"must be positive seconds, got {seconds.tolist()}")
        seconds = seconds.astype(np.float32)
    heard = boolean(TALKER.USE_AUDIO_IN_VIDEO, scalar(tensors, TALKER.USE_AUDIO_IN_VIDEO))
    if heard and grid is None:
        raise RequestError(TALKER.USE_AUDIO_IN_VIDEO, f"needs {TALKER.VIDEO_GRID_THW}: it says "
                                                      "the thinker heard a video's soundtrack")
    if heard and tensors.get(TALKER.AUDIO_FEATURE_LENGTHS) is None:
        raise RequestError(TALKER.USE_AUDIO_IN_VIDEO, f"needs {TALKER.AUDIO_FEATURE_LENGTHS}: "
                                                      "each soundtrack's feature frames")
    if heard:
        lengths = np.asarray(tensors[TALKER.AUDIO_FEATURE_LENGTHS]).reshape(-1)
        if lengths.size < len(grid):
            raise RequestError(TALKER.AUDIO_FEATURE_LENGTHS,
                               f"must hold one length per video's soundtrack ({len(grid)} "
                               f"videos with {TALKER.USE_AUDIO_IN_VIDEO}), got {lengths.size}")
    return {"video_grid_thw": grid, "video_second_per_grid": seconds,
            "use_audio_in_video": bool(heard)}


def parse_request(request_id: str, tensors: dict[str, np.ndarray | None],
                  parameters: dict[str, Any] | None = None) -> TalkerRequest:
    """Validate one request; request parameters may carry sampling fields (as omni_llm's),
    the `sampling_parameters` tensor wins on conflicts."""
    source = text(TALKER.THINKER_HIDDEN_STATES_FILE,
                  scalar(tensors, TALKER.THINKER_HIDDEN_STATES_FILE))
    if not source:
        raise RequestError(TALKER.THINKER_HIDDEN_STATES_FILE,
                           "is required: the hidden_states_file a thinker stage handed over")
    ids = token_ids(TALKER.PROMPT_TOKEN_IDS, tensors.get(TALKER.PROMPT_TOKEN_IDS))
    if ids is None:
        raise RequestError(TALKER.PROMPT_TOKEN_IDS, "is required (the thinker's input_token_ids)")
    voice = text(TALKER.VOICE, scalar(tensors, TALKER.VOICE))
    feed = TalkerInput(
        source=source, prompt_token_ids=tuple(ids), voice=voice or None,
        image_grid_thw=counts(TALKER.IMAGE_GRID_THW, tensors.get(TALKER.IMAGE_GRID_THW), "n,3"),
        audio_feature_lengths=counts(TALKER.AUDIO_FEATURE_LENGTHS,
                                     tensors.get(TALKER.AUDIO_FEATURE_LENGTHS), "n"),
        **_video(tensors))
    from_params = sampling.coerce(dict(parameters or {}), source="parameters")
    from_tensor = sampling.coerce(sampling.parse_json(scalar(tensors, TALKER.SAMPLING_PARAMETERS)))
    return TalkerRequest(request_id, feed, {**from_params, **from_tensor})

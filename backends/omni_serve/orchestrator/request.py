"""Requests of the omni entry model (runs in the orchestrator's stub, and in tests).

`parse_request` validates one request's tensors against the pipeline's
config before any stage runs; every problem is a RequestError naming the
input and what is allowed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_serve.contract import OMNI
from omni_serve.errors import RequestError
from omni_serve.fields import integer, scalar, text
from omni_serve.orchestrator.config import OrchestratorConfig


@dataclass
class OmniRequest:
    request_id: str
    text: str
    modalities: tuple[str, ...] = ("text",)
    image: bytes | None = None
    audio: bytes | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    speaker: str | None = None
    seed: int | None = None
    task: str = "chat"


def _media(tensors: dict[str, np.ndarray | None], name: str, cfg: OrchestratorConfig,
           role: str | None) -> bytes | None:
    value = scalar(tensors, name)
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("latin-1")
    data = bytes(value)
    if not data:
        raise RequestError(name, "is empty; send the file's bytes")
    if len(data) > cfg.max_media_bytes:
        raise RequestError(name, f"is {len(data)} bytes; at most {cfg.max_media_bytes} are allowed")
    if role is None:
        raise RequestError(name, f"this pipeline has no {name} encoder stage")
    return data


def _modalities(tensors: dict[str, np.ndarray | None], cfg: OrchestratorConfig) -> tuple[str, ...]:
    arr = tensors.get(OMNI.MODALITIES)
    if arr is None:
        return ("text",)
    items = [text(OMNI.MODALITIES, v) for v in np.asarray(arr).reshape(-1)]
    if len(items) == 1 and items[0].lstrip().startswith("["):  # one JSON array
        try:
            items = json.loads(items[0])
        except json.JSONDecodeError as e:
            raise RequestError(OMNI.MODALITIES, f"invalid JSON ({e.msg})") from e
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise RequestError(OMNI.MODALITIES, "must be a list of strings")
    allowed = cfg.output_modalities
    wanted: list[str] = []
    for item in items:
        name = item.strip().lower()
        if name not in allowed:
            raise RequestError(OMNI.MODALITIES, f"unknown or unavailable modality {item!r}; "
                                                f"this pipeline offers {list(allowed)}")
        if name not in wanted:
            wanted.append(name)
    if not wanted:
        raise RequestError(OMNI.MODALITIES, f"must name at least one of {list(allowed)}")
    if "text" not in wanted:  # text is always produced (speech and images derive from it)
        wanted.insert(0, "text")
    return tuple(wanted)


def _task(tensors: dict[str, np.ndarray | None], cfg: OrchestratorConfig) -> str:
    value = text(OMNI.TASK, scalar(tensors, OMNI.TASK))
    task = (value or "chat").strip().lower()
    if task not in OMNI.TASKS:
        raise RequestError(OMNI.TASK, f"unknown task {value!r}; allowed: {list(OMNI.TASKS)}")
    if task == "speech" and not (cfg.stages.talker and cfg.tokenizer):
        raise RequestError(OMNI.TASK, "this pipeline has no talker (or no thinker tokenizer) "
                                      "to read text aloud")
    return task


def parse_request(request_id: str, tensors: dict[str, np.ndarray | None],
                  cfg: OrchestratorConfig) -> OmniRequest:
    prompt = text(OMNI.TEXT_INPUT, scalar(tensors, OMNI.TEXT_INPUT))
    if prompt is None or not prompt.strip():
        raise RequestError(OMNI.TEXT_INPUT, "is required and must not be empty")
    raw = text(OMNI.SAMPLING_PARAMETERS, scalar(tensors, OMNI.SAMPLING_PARAMETERS))
    sampling: dict[str, Any] = {}
    if raw:
        try:
            sampling = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RequestError(OMNI.SAMPLING_PARAMETERS, f"invalid JSON ({e.msg})") from e
        if not isinstance(sampling, dict):
            raise RequestError(OMNI.SAMPLING_PARAMETERS, "must be a JSON object")
    return OmniRequest(
        request_id=request_id,
        text=prompt,
        modalities=_modalities(tensors, cfg),
        image=_media(tensors, OMNI.IMAGE, cfg, cfg.stages.image_encoder),
        audio=_media(tensors, OMNI.AUDIO, cfg, cfg.stages.audio_encoder),
        sampling=sampling,
        speaker=text(OMNI.SPEAKER, scalar(tensors, OMNI.SPEAKER)),
        seed=integer(OMNI.SEED, scalar(tensors, OMNI.SEED)),
        task=_task(tensors, cfg),
    )

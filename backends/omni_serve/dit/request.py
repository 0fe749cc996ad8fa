"""Requests of the omni_dit stage (runs inside the Triton stub and in tests).

`parse_request` turns one request's named input tensors (already numpy) into a
`DitRequest`, validating every field against the stage config before any
compute. `group_key` says which requests can share one pipeline call.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni_serve import fields
from omni_serve.contract import DIT
from omni_serve.dit.config import DitStageConfig
from omni_serve.errors import RequestError
from omni_serve.fields import integer, number, scalar, text


@dataclass(frozen=True)
class DitRequest:
    """One text-to-image request as the stage sees it."""

    prompt: str
    negative_prompt: str | None
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    step_cache: bool = False


GroupKey = tuple[int, int, int, float, bool, bool]


def group_key(req: DitRequest) -> GroupKey:
    """Requests with equal keys can run in one batched pipeline call."""
    return (req.height, req.width, req.num_inference_steps, req.guidance_scale,
            req.negative_prompt is not None, req.step_cache)


def parse_request(tensors: dict[str, np.ndarray | None], cfg: DitStageConfig) -> DitRequest:
    """Validate one request's tensors; raises `RequestError` naming the bad field.

    Omitted optional inputs take the stage defaults. Without a `seed` a random
    one is drawn, so that image is not reproducible; send a seed to get the
    same image again (alone or batched).
    """
    prompt = text(DIT.PROMPT, scalar(tensors, DIT.PROMPT))
    if prompt is None:
        raise RequestError(DIT.PROMPT, "is required")
    if not prompt.strip():
        raise RequestError(DIT.PROMPT, "must not be empty")
    negative = text(DIT.NEGATIVE_PROMPT, scalar(tensors, DIT.NEGATIVE_PROMPT))

    height = _side(DIT.HEIGHT, tensors, cfg.default_height, cfg)
    width = _side(DIT.WIDTH, tensors, cfg.default_width, cfg)

    steps = integer(DIT.NUM_INFERENCE_STEPS, scalar(tensors, DIT.NUM_INFERENCE_STEPS))
    steps = cfg.default_steps if steps is None else steps
    if not 1 <= steps <= cfg.max_steps:
        raise RequestError(DIT.NUM_INFERENCE_STEPS, f"must be between 1 and {cfg.max_steps}, got {steps}")

    guidance = number(DIT.GUIDANCE_SCALE, scalar(tensors, DIT.GUIDANCE_SCALE))
    guidance = cfg.default_guidance_scale if guidance is None else guidance
    if not 0.0 <= guidance <= cfg.max_guidance_scale:
        raise RequestError(DIT.GUIDANCE_SCALE,
                           f"must be between 0 and {cfg.max_guidance_scale}, got {guidance}")

    seed = fields.seed(tensors, DIT.SEED)

    cache = scalar(tensors, DIT.STEP_CACHE)
    if cache is None:
        cache = cfg.cache != "off"
    elif not isinstance(cache, (bool, np.bool_)):
        raise RequestError(DIT.STEP_CACHE, f"must be a boolean, got {cache!r}")

    return DitRequest(prompt=prompt, negative_prompt=negative, height=height, width=width,
                      num_inference_steps=steps, guidance_scale=guidance, seed=seed,
                      step_cache=bool(cache))


# --- field helpers ---------------------------------------------------------------------

def _side(name: str, tensors: dict[str, np.ndarray | None], default: int, cfg: DitStageConfig) -> int:
    value = integer(name, scalar(tensors, name))
    value = default if value is None else value
    m = cfg.side_multiple
    if value % m or not m <= value <= cfg.max_side:
        raise RequestError(name, f"must be a multiple of {m} between {m} and {cfg.max_side}, got {value}")
    return value

"""Pipeline arguments of one omni_dit stage, read from its engine.json (Triton stub and tests).

Validated once at load time: a bad or unknown key fails the stage before it serves.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]


class DitStageConfig(BaseModel):
    """Typed engine.json of a diffusion stage; unknown keys are an error.

    `side_multiple` must be a multiple of the pipeline's `vae_scale_factor * 2`
    (16 for Qwen-Image); `DitRunner` checks that against the loaded pipeline.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="diffusers pipeline directory or hub id")
    dtype: Dtype = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    default_height: int = 64
    default_width: int = 64
    max_side: int = 1024
    side_multiple: int = Field(default=16, ge=1)
    default_steps: int = Field(default=4, ge=1)
    max_steps: int = Field(default=50, ge=1)
    default_guidance_scale: float = Field(default=4.0, ge=0.0)
    max_guidance_scale: float = Field(default=20.0, ge=0.0)
    torch_threads: int = Field(default=1, ge=1)
    # Step cache (diffusers FirstBlockCache): a step whose first transformer
    # block's residual changed by less than `cache_threshold` (relative L1)
    # reuses the cached residual of the remaining blocks. Off by default;
    # requests may switch it with the `step_cache` input.
    cache: Literal["off", "first_block"] = "off"
    cache_threshold: float = Field(default=0.1, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _check_limits(self) -> DitStageConfig:
        m = self.side_multiple
        if self.max_side < m:
            raise ValueError(f"max_side={self.max_side} must be at least side_multiple={m}")
        for key in ("default_height", "default_width"):
            value = getattr(self, key)
            if value % m or not m <= value <= self.max_side:
                raise ValueError(f"{key}={value} must be a multiple of {m} between {m} and "
                                 f"max_side={self.max_side}")
        if self.default_steps > self.max_steps:
            raise ValueError(f"default_steps={self.default_steps} exceeds max_steps={self.max_steps}")
        if self.default_guidance_scale > self.max_guidance_scale:
            raise ValueError(f"default_guidance_scale={self.default_guidance_scale} exceeds "
                             f"max_guidance_scale={self.max_guidance_scale}")
        return self

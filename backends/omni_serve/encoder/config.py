"""Arguments of one omni_encoder stage, read from its engine.json (Triton stub and tests),
and the media limits (the video limits also of the orchestrator and omni_llm stages).

Validated once at load time: a bad or unknown key fails the stage before it
serves. The media limits are enforced per request by `omni_serve.encoder.media` and
`omni_serve.encoder.video`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]
Modality = Literal["image", "audio"]


# The key that carries a VideoLimits in the engine.json of the stages that check a clip (the
# orchestrator's and each omni_llm's); omni-gen-repo writes it from the spec's `video_limits`.
VIDEO_LIMITS_KEY = "video_limits"


class VideoLimits(BaseModel):
    """Limits on one video clip (omni_serve.encoder.video), checked on the container's header
    before any frame is decoded: decoding reads at most max_video_frames frames of at most
    max_video_pixels each. Set once in the pipeline spec (`video_limits:`); omni-gen-repo
    writes them to every stage that checks a clip (the orchestrator's probe, the thinker's
    decode). A clip over one is INVALID_ARG naming `video`, the limit and its key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_video_bytes: int = Field(default=128 * 2**20, ge=1, description="encoded size of one clip")
    max_video_seconds: float = Field(default=120.0, gt=0.0, description="duration of one clip")
    max_video_frames: int = Field(default=7200, ge=2, description="frames in the video stream")
    max_video_pixels: int = Field(default=1920 * 1080, ge=1, description="width x height of a frame")

    @classmethod
    def from_engine_args(cls, value: Any) -> VideoLimits:
        """The `video_limits` of a stage's engine.json (defaults when absent); ValueError
        naming the key of each bad value, so the stage fails to load."""
        if value is None:
            return cls()
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            raise ValueError("; ".join(
                f"{VIDEO_LIMITS_KEY}{''.join(f'.{p}' for p in err['loc'])}: {err['msg']} "
                f"(got {err['input']!r})" for err in e.errors())) from None


class MediaLimits(VideoLimits):
    """Limits on one media item, checked before any decoding work (omni_serve.encoder.media,
    omni_serve.encoder.video):
    an encoder stage's, and those of an LLM stage that takes raw media."""

    max_media_bytes: int = Field(default=20 * 2**20, ge=1, description="encoded size of one item")
    # Decompression-bomb guard: the header's width x height, checked before pixels are decoded.
    max_image_pixels: int = Field(default=32 * 2**20, ge=1)
    max_image_side: int = Field(default=8192, ge=1)
    min_image_side: int = Field(default=1, ge=1)
    max_audio_seconds: float = Field(default=300.0, gt=0.0)
    sample_rate: int = Field(default=16000, ge=1000, description="the audio tower's input rate")

    def with_video(self, video: VideoLimits | None) -> MediaLimits:
        """These limits with `video`'s video limits (themselves for None)."""
        if video is None:
            return self
        return self.model_copy(update=video.model_dump())

    @model_validator(mode="after")
    def _check_limits(self) -> MediaLimits:
        if self.min_image_side > self.max_image_side:
            raise ValueError(f"min_image_side={self.min_image_side} exceeds "
                             f"max_image_side={self.max_image_side}")
        if self.min_image_side ** 2 > self.max_image_pixels:
            raise ValueError(f"min_image_side={self.min_image_side} allows no image under "
                             f"max_image_pixels={self.max_image_pixels}; lower min_image_side")
        return self


class EncoderStageConfig(MediaLimits):
    """Typed engine.json of a modality encoder stage; unknown keys are an error.

    `model` is a checkpoint directory of a model family with media encoders
    (omni_serve.families; the whole model as the hub ships it, or a thinker
    alone). The family's encoder of the stage's modality loads its part: for
    images the image processor and the vision tower; for audio, where the
    thinker engine runs the audio tower, only the feature extractor, so
    `dtype` and `device` do not matter there.
    """

    model: str = Field(min_length=1, description="omni thinker checkpoint directory")
    modality: Modality
    dtype: Dtype = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: int = Field(default=1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _no_video_limits(cls, data: Any) -> Any:
        """An encoder stage decodes no video (the thinker takes clips raw): its video limits
        would limit nothing."""
        if isinstance(data, dict):
            given = [k for k in (*VideoLimits.model_fields, VIDEO_LIMITS_KEY) if k in data]
            if given:
                raise ValueError(f"{', '.join(given)}: an encoder stage decodes no video (the "
                                 f"thinker does); set the video limits once, in the spec's "
                                 f"top-level {VIDEO_LIMITS_KEY}")
        return data

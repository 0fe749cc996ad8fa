"""Engine arguments of one omni_audio stage, read from its engine.json (Triton stub and tests).

Validated once at load time: a bad or unknown key fails the stage before it
serves. What depends on the checkpoint (the voice names, the codec
vocabulary, the longest utterance the decoder can place) is checked by
`AudioRunner` when it loads the family's decoder.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from omni_serve.removed_settings import RefusesRemovedSettings

Dtype = Literal["float32", "bfloat16", "float16"]


class AudioStageConfig(RefusesRemovedSettings):
    """Typed engine.json of an audio decoder (codec frames -> waveform) stage; unknown keys are an error.

    `model` is a checkpoint folder as the hub ships it, of a model family with
    an audio decoder (omni_serve.families: the family's `CodecDecoder` reads
    its part of the folder and its voices). `dtype`: the reference models
    decode in float32; lower precision is allowed but not what they were
    validated with. The sampler settings are for decoders that sample (flow
    matching); None: the model's own defaults (the family's decoder module
    names them). A decoder that does not sample refuses them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Settings that are gone or renamed (docs/glossary.md): engine.json and omni-gen-repo's
    # spec check name what to do.
    REMOVED_SETTINGS: ClassVar[dict[str, str]] = {
        "default_speaker": "renamed to default_voice (docs/glossary.md: one name per concept)",
    }

    model: str = Field(min_length=1, description="checkpoint folder with an audio decoder")
    dtype: Dtype = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: int = Field(default=1, ge=1)
    # Flow matching: `num_steps` time points of the ODE solve; None: the model's own.
    num_steps: int | None = Field(default=None, ge=2, le=100)
    # Classifier-free guidance strength (0 turns it off and halves the DiT batch)
    # and the sway sampling of the time grid; None: the model's own.
    guidance_scale: float | None = Field(default=None, ge=0.0, le=10.0)
    sway_coefficient: float | None = Field(default=None, ge=-1.0, le=1.0)
    # Frames per request, context included.
    max_codec_tokens: int = Field(default=2048, ge=1)
    # Voice used when a request names none; None: the checkpoint's default (a decoder
    # without voices takes none).
    default_voice: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> AudioStageConfig:
        if self.default_voice is not None and self.default_voice != self.default_voice.strip():
            raise ValueError(f"default_voice={self.default_voice!r} has leading or trailing spaces; "
                             "give the voice name exactly as the checkpoint spells it")
        return self

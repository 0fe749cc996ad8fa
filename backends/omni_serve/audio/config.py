"""Engine arguments of one omni_audio stage, read from its engine.json (Triton stub and tests).

Validated once at load time: a bad or unknown key fails the stage before it
serves. What depends on the checkpoint (the speaker names, the codec
vocabulary, the DiT's longest sequence) is checked by `AudioRunner` when it
loads the model.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]


class AudioStageConfig(BaseModel):
    """Typed engine.json of a Token2Wav (codec tokens -> waveform) stage; unknown keys are an error.

    `model` is a Qwen2.5-Omni checkpoint folder as the hub ships it (config.json
    with `token2wav_config`, `token2wav.*` weights, spk_dict.pt); a stand-alone
    Token2Wav folder (omni_tools.tiny_token2wav) still loads. Qwen2.5-Omni
    runs Token2Wav in float32; lower precision is allowed but not what the
    model was validated with. The sampler settings default to None: the
    model's own (`Qwen2_5OmniToken2WavModel.forward`: 10 steps, guidance 0.5,
    sway -1.0).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="Token2Wav checkpoint folder")
    dtype: Dtype = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: int = Field(default=1, ge=1)
    # Flow matching: `num_steps` time points of the RK4 ODE solve (num_steps - 1
    # intervals, 4 DiT evaluations each); None: the model's own (10).
    num_steps: int | None = Field(default=None, ge=2, le=100)
    # Classifier-free guidance strength (0 turns it off and halves the DiT batch)
    # and the sway sampling of the time grid; None: the model's own (0.5, -1.0).
    guidance_scale: float | None = Field(default=None, ge=0.0, le=10.0)
    sway_coefficient: float | None = Field(default=None, ge=-1.0, le=1.0)
    # Codes per request, left context included.
    max_codec_tokens: int = Field(default=2048, ge=1)
    # Voice used when a request names none; None: the checkpoint's default.
    default_speaker: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> AudioStageConfig:
        if self.default_speaker is not None and self.default_speaker != self.default_speaker.strip():
            raise ValueError(f"default_speaker={self.default_speaker!r} has leading or trailing spaces; "
                             "give the voice name exactly as spk_dict.pt spells it")
        return self

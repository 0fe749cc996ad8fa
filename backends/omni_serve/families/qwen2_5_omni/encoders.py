"""Qwen2.5-Omni's media encoders, the encoder stage's `MediaEncoder`s (omni_encoder stub, tests).

- images: the checkpoint's own image processor (Qwen2VLImageProcessor on
  torchvision, as its Qwen2_5OmniProcessor and vLLM resize: other resizers
  give other pixels) makes each image's patches and grid; the good ones of a
  batch go through the vision tower (`Qwen2_5OmniVisionEncoder`) in ONE
  forward, exactly as the thinker's `get_image_features` does, and the rows
  are split back per item (one image token of the prompt per row);
- audio: each clip's log-mel features, as Qwen2_5OmniProcessor computes them
  (its WhisperFeatureExtractor). The audio tower runs in the thinker engine:
  vLLM 0.32's Qwen2.5-Omni model takes audio as features only (it has no
  audio-embeddings input).

Only the stage's part of the checkpoint is loaded (the `visual` tower and the
image processor, or the feature extractor alone); the checkpoint may be a
thinker-only one or a full Qwen2.5-Omni one (`thinker.`-prefixed).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_serve.encoder.config import EncoderStageConfig
from omni_serve.encoder.runner import EncoderOutput
from omni_serve.errors import RequestError
from omni_serve.families import checkpoint_tensors
from omni_serve.families.qwen2_5_omni.media_tokens import Qwen25OmniMediaTokens

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
THINKER_MODEL_TYPE = "qwen2_5_omni_thinker"
TOKENS = Qwen25OmniMediaTokens()


def load(cfg: EncoderStageConfig) -> ImageEncoder | AudioFeatures:
    """The encoder of `cfg.modality` for the checkpoint folder `cfg.model`."""
    thinker_config = load_thinker_config(cfg.model)
    if cfg.modality == "image":
        return ImageEncoder(cfg, thinker_config)
    return AudioFeatures(cfg, thinker_config)


# --- checkpoint layout ----------------------------------------------------------------


def load_thinker_config(model_dir: str | Path) -> Any:
    """The Qwen2_5OmniThinkerConfig of a thinker checkpoint or of a full Qwen2.5-Omni one."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    thinker = getattr(config, "thinker_config", config)
    if getattr(thinker, "model_type", None) != THINKER_MODEL_TYPE:
        raise ValueError(f"{model_dir} is a {config.model_type!r} checkpoint; the omni encoder needs a "
                         f"Qwen2.5-Omni thinker ({THINKER_MODEL_TYPE!r}) or a full Qwen2.5-Omni checkpoint")
    return thinker


def thinker_tensor_files(model_dir: str | Path) -> tuple[dict[str, Path], str]:
    """({tensor name: safetensors file}, prefix of the thinker's tensors: "thinker." or "")."""
    files = checkpoint_tensors.tensor_files(Path(model_dir))
    if not files:
        raise ValueError(f"{model_dir} has no safetensors weights")
    prefix = "thinker." if any(name.startswith("thinker.") for name in files) else ""
    return files, prefix


def load_thinker_module(model_dir: str | Path, module: str) -> dict[str, torch.Tensor]:
    """The state dict of the thinker's submodule `module` (e.g. "visual"), read alone."""
    files, prefix = thinker_tensor_files(model_dir)
    head = f"{prefix}{module}."
    names = [name for name in files if name.startswith(head)]
    if not names:
        raise ValueError(f"{model_dir} has no {head}* weights")
    return checkpoint_tensors.read_tensors(files, names, strip=head)


def load_vision_tower(cfg: EncoderStageConfig, thinker_config: Any) -> torch.nn.Module:
    from transformers.initialization import no_init_weights
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    cls, sub_config = Qwen2_5OmniVisionEncoder, thinker_config.vision_config
    dtype = TORCH_DTYPES[cfg.dtype]
    with no_init_weights():  # every parameter comes from the checkpoint below
        tower = cls._from_config(sub_config, dtype=dtype)
    state = load_thinker_module(cfg.model, "visual")
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{cfg.model}: the visual weights do not fit "
                         f"{cls.__name__} (missing {missing[:5]}, unexpected {unexpected[:5]})")
    return tower.to(device=cfg.device, dtype=dtype).eval()


# --- images -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedImage:
    pixels: np.ndarray  # (patches, patch_dim) float32
    grid_thw: np.ndarray  # int64 (3,)
    tokens: int


class ImageEncoder:
    """The image processor and the vision tower."""

    def __init__(self, cfg: EncoderStageConfig, thinker_config: Any):
        from transformers import AutoImageProcessor

        self.cfg = cfg
        self.processor = AutoImageProcessor.from_pretrained(cfg.model)
        self.merge = int(thinker_config.vision_config.spatial_merge_size)
        self.tower = load_vision_tower(cfg, thinker_config)
        hidden = int(thinker_config.text_config.hidden_size)
        out_dim = thinker_config.vision_config.out_hidden_size
        if out_dim != hidden:
            raise ValueError(f"{cfg.model}: the visual tower emits {out_dim}-wide rows but the "
                             f"text model is {hidden} wide")

    def prepare(self, image: Any) -> PreparedImage:
        try:
            batch = self.processor(images=[image], return_tensors="np")
        except ValueError as e:  # e.g. smart_resize's aspect-ratio check
            raise RequestError("media", f"image cannot be preprocessed: {e}") from e
        grid = np.asarray(batch["image_grid_thw"][0], dtype=np.int64)
        tokens = TOKENS.image_tokens(grid.tolist(), self.merge)
        return PreparedImage(np.asarray(batch["pixel_values"], dtype=np.float32), grid, tokens)

    def encode(self, group: list[PreparedImage]) -> list[EncoderOutput]:
        # Qwen2_5OmniThinkerForConditionalGeneration.get_image_features
        pixels = torch.from_numpy(np.concatenate([p.pixels for p in group]))
        grid = torch.from_numpy(np.stack([p.grid_thw for p in group]))
        pixels = pixels.to(device=self.cfg.device, dtype=self.tower.dtype)
        rows = self.tower(pixels, grid_thw=grid.to(self.cfg.device)).pooler_output
        sizes = [p.tokens for p in group]
        if rows.shape[0] != sum(sizes):
            raise RuntimeError(f"the tower returned {rows.shape[0]} rows for {sum(sizes)} image tokens")
        rows = rows.float().cpu().numpy()
        out, start = [], 0
        for p, n in zip(group, sizes, strict=True):
            out.append(EncoderOutput(n, np.ascontiguousarray(rows[start:start + n]), p.grid_thw))
            start += n
        return out


# --- audio ------------------------------------------------------------------------------


class AudioFeatures:
    """The feature extractor alone: the thinker engine runs the audio tower."""

    def __init__(self, cfg: EncoderStageConfig, thinker_config: Any):
        from transformers import WhisperFeatureExtractor

        self.cfg = cfg
        self.processor = fe = WhisperFeatureExtractor.from_pretrained(cfg.model)
        if fe.sampling_rate != cfg.sample_rate:
            raise ValueError(f"sample_rate={cfg.sample_rate} but {cfg.model}'s feature extractor expects "
                             f"{fe.sampling_rate} Hz; set sample_rate to {fe.sampling_rate}")
        longest = fe.n_samples / fe.sampling_rate
        if cfg.max_audio_seconds > longest:
            raise ValueError(f"max_audio_seconds={cfg.max_audio_seconds:g} exceeds the {longest:g} s the "
                             f"feature extractor of {cfg.model} takes (chunk_length); set "
                             f"max_audio_seconds <= {longest:g}")
        bins = int(thinker_config.audio_config.num_mel_bins)
        if fe.feature_size != bins:
            raise ValueError(f"{cfg.model}: the feature extractor makes {fe.feature_size} "
                             f"mel bins but the audio tower takes {bins}")

    def prepare(self, samples: np.ndarray) -> EncoderOutput:
        fe = self.processor
        # The Qwen2.5-Omni processor pads every clip with zeros to n_samples (300 s).
        # Padding by one FFT window past the end gives the same values for every
        # frame that touches the audio (the rest is masked out) at a fraction of the cost.
        batch = fe(samples, sampling_rate=fe.sampling_rate, padding="max_length",
                   max_length=len(samples) + fe.n_fft, truncation=False, return_attention_mask=True,
                   return_tensors="np")
        frames = int(batch["attention_mask"][0].sum())
        tokens = TOKENS.audio_tokens(frames)
        if tokens < 1:
            min_ms = 1000 * (2 * fe.hop_length + 1) / fe.sampling_rate
            raise RequestError("media", f"audio is {1000 * len(samples) / fe.sampling_rate:.1f} ms long; "
                                        f"send at least {min_ms:.0f} ms")
        return EncoderOutput(tokens, features=np.ascontiguousarray(batch["input_features"][0, :, :frames]))

    def encode(self, items: list[EncoderOutput]) -> list[EncoderOutput]:
        return items  # the features are the output

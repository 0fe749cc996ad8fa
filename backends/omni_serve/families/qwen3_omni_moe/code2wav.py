"""Qwen3-Omni's codec decoder, Code2Wav, as the audio stage's `CodecDecoder` (omni_audio stub, tests).

Flow of one `decode` (a group of chunks of equal frame count, grouped by
omni_serve.audio.runner): what `Qwen3OmniMoeCode2Wav.forward` does, in one
batched call: codes [batch, 16 groups, frames] -> the mean of the groups'
code embeddings -> a transformer with a sliding window over earlier frames ->
a causal ConvNet that upsamples each frame to 1920 samples at 24 kHz ->
clamp to [-1, 1]. No voices (the talker speaks them), no sampling noise.

Stream alignment: the causal transposed convolutions hold back `delay`
samples (555 for the real rates), so a forward over n frames gives
n * 1920 - 555 samples and the waveform of frame i starts at sample
i * 1920 - 555. `decode` returns each request's forward output after `delay`
samples of silence: n * 1920 samples, as the stage expects, and the audio the
stage keeps of a chunk (its voiced frames' share) tiles the stream exactly,
555 samples early; the utterance starts with 555 samples of silence, which the
stage drops from the utterance's first chunk (`lead_samples`), so the
stream starts at sample 0 of transformers' forward and equals it
whatever the chunking. (transformers' `chunked_decode` instead drops each
chunk's last 555 samples.)

Long left context at little cost: a chunk is exact with `context.left` frames
of left context (code2wav_context.py: the transformer's whole field, 578
frames for the real model), but the ConvNet, the expensive part, reads only
the last `Field.conv` (10) of them. `decode` runs the transformer over every
frame sent and the ConvNet only from `Field.conv` frames before the first
voiced one; the audio of the context frames before that is not computed
(zeros in the returned array; the stage cuts it off).

Batching: requests of equal frame count decode in one forward with no padding
(a causal model would read padding as context); a batch differs from each
request alone only by float rounding (different GEMM order), so the
`batch_key` is one for all.

The checkpoint is the whole Qwen3-Omni folder as the hub ships it:
config.json's `code2wav_config` and the `code2wav.*` tensors of the
safetensors weights (the index file's shards that hold them, else
model.safetensors); nothing else is read.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.request import AudioRequest, ChunkContext
from omni_serve.families import checkpoint_tensors
from omni_serve.families.qwen3_omni_moe.code2wav_context import Field, receptive_field

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
CODE2WAV_PREFIX = "code2wav."
SAMPLE_RATE = 24_000  # the model's output rate (Qwen3-Omni's model card)
SAMPLER_SETTINGS = ("num_steps", "guidance_scale", "sway_coefficient")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class Code2Wav:
    """One `Qwen3OmniMoeCode2Wav` in float32 (or `cfg.dtype`); see the module docstring."""

    sample_rate = SAMPLE_RATE
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    max_frames: int | None = None  # chunks place nothing: their positions start at 0

    @classmethod
    def load(cls, cfg: AudioStageConfig) -> Code2Wav:
        """The Code2Wav of the Qwen3-Omni checkpoint folder `cfg.model`.

        Raises:
            ValueError: a sampler setting is set (Code2Wav does not sample), or the folder's
                config or weights are not a Code2Wav's.
            FileNotFoundError: config.json or the weights are missing.
        """
        given = [f"{name}={getattr(cfg, name)!r}" for name in SAMPLER_SETTINGS
                 if getattr(cfg, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: Qwen3-Omni's Code2Wav does not sample (no flow "
                             "matching, no noise); leave the sampler settings out of this stage's config")
        return cls(load_code2wav(Path(cfg.model)), cfg)

    def __init__(self, model: Any, cfg: AudioStageConfig):
        self.device = cfg.device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.model = model.to(device=cfg.device, dtype=self.dtype).eval()
        config = self.model.config
        self.codec_groups = int(config.num_quantizers)
        self.codec_vocab = int(config.codebook_size)
        self.samples_per_frame = int(self.model.total_upsample)
        self.field: Field = receptive_field(config)
        # the silence `decode` puts first: the stage drops it from the utterance's first chunk
        self.lead_samples = self.field.delay
        # What a chunk needs around it to sound as the whole utterance (chunk_plan's arguments).
        self.context = ChunkContext(self.field.left, 0, 1)

    def batch_key(self, request: AudioRequest) -> Hashable:
        """One key for all: any requests of equal frame count decode in one forward."""
        return None

    @torch.inference_mode()
    def decode(self, group: list[AudioRequest]) -> np.ndarray:
        """One batched forward: float32 [len(group), frames * samples_per_frame], `delay` samples
        of silence first; audio of context frames the voiced ones do not read is zeros."""
        codes = self._codes(group)
        frames, spf = codes.shape[2], self.samples_per_frame
        # transformer over every frame sent, ConvNet from the first frame the voiced audio reads
        skip = max(0, min(r.context for r in group) - self.field.conv)
        hidden = self.transformer(codes)[:, skip:]
        wave = self.convnet(hidden).float().reshape(len(group), -1).cpu().numpy()
        start = skip * spf + self.field.delay
        if wave.shape[1] != frames * spf - start:
            raise RuntimeError(f"Code2Wav returned {wave.shape[1]} samples for {frames - skip} frames, "
                               f"expected {(frames - skip) * spf - self.field.delay}: its convolutions "
                               "do not match code2wav_context.receptive_field")
        out = np.zeros((len(group), frames * spf), dtype=np.float32)
        out[:, start:] = wave
        return out

    # --- the halves of Qwen3OmniMoeCode2Wav.forward ----------------------------------------

    def transformer(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [batch, groups, frames] -> the transformer's output [batch, frames, hidden]."""
        model = self.model
        hidden = model.code_embedding(codes + model.code_offset).mean(1)
        return model.pre_transformer(inputs_embeds=hidden).last_hidden_state

    def convnet(self, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, frames, hidden] -> waveform [batch, 1, frames * samples_per_frame - delay]."""
        wave = hidden.permute(0, 2, 1)
        for blocks in self.model.upsample:
            for block in blocks:
                wave = block(wave)
        for block in self.model.decoder:
            wave = block(wave)
        return wave.clamp(min=-1, max=1)

    def _codes(self, group: list[AudioRequest]) -> torch.Tensor:
        """int64 [batch, groups, frames] on the model's device (ValueError naming what is off;
        the stage's parse_request refuses such requests before they get here)."""
        shapes = {r.codes.shape for r in group}
        if len(shapes) != 1:
            raise ValueError(f"a group's requests must have equal shapes, got {sorted(shapes)}")
        (frames, groups), = shapes
        if groups != self.codec_groups:
            raise ValueError(f"codes must be [frames, {self.codec_groups}], got [{frames}, {groups}]")
        codes = np.stack([r.codes for r in group])
        if codes.min() < 0 or codes.max() >= self.codec_vocab:
            raise ValueError(f"codes must be in [0, {self.codec_vocab}), got {codes.min()}..{codes.max()}")
        return torch.from_numpy(codes.astype(np.int64)).transpose(1, 2).to(self.device)


# --- loading ---------------------------------------------------------------------------


def load_code2wav(folder: Path) -> Any:
    """`Qwen3OmniMoeCode2Wav` in float32 of a whole Qwen3-Omni checkpoint folder.

    Raises:
        FileNotFoundError: config.json or the weights are missing.
        ValueError: the folder is not a Qwen3-Omni checkpoint with Code2Wav, or its
            `code2wav.*` weights do not fit its `code2wav_config`.
    """
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: give a Qwen3-Omni checkpoint folder")
    raw = json.loads(config_path.read_text())
    if not isinstance(raw.get("code2wav_config"), dict):
        raise ValueError(f"{config_path} has no code2wav_config (model_type {raw.get('model_type')!r}): "
                         "give a Qwen3-Omni checkpoint folder, e.g. Qwen/Qwen3-Omni-30B-A3B-Instruct")
    config = Qwen3OmniMoeCode2WavConfig.from_dict(raw["code2wav_config"])
    model = Qwen3OmniMoeCode2Wav._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    state = read_code2wav_tensors(folder)
    want = set(model.state_dict())
    missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
    if missing or unexpected:
        raise ValueError(f"{folder}: the {CODE2WAV_PREFIX}* weights do not fit code2wav_config: "
                         f"{len(missing)} missing ({_names(missing)}), "
                         f"{len(unexpected)} unexpected ({_names(unexpected)})")
    model.load_state_dict(state, strict=True)
    return model


def read_code2wav_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The `code2wav.*` tensors of the folder's safetensors weights, prefix stripped; only the
    shards that hold them are opened, and only those tensors read."""
    state = checkpoint_tensors.read_prefixed(folder, CODE2WAV_PREFIX)
    if not state:
        raise ValueError(f"{folder} has no {CODE2WAV_PREFIX}* weights: this checkpoint does not ship "
                         "Code2Wav (a thinker-only Qwen3-Omni cannot speak)")
    return state


def _names(names: list[str], most: int = 5) -> str:
    shown = ", ".join(CODE2WAV_PREFIX + n for n in names[:most])
    return shown + (", ..." if len(names) > most else "") if names else "none"

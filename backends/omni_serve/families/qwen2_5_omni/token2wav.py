"""Qwen2.5-Omni's codec decoder, Token2Wav, as the audio stage's `CodecDecoder` (omni_audio stub, tests).

Flow of one `decode` (a group of chunks of equal length and equal reference
mel, omni_serve.audio.runner groups them): what
`Qwen2_5OmniToken2WavModel.forward` does: draws the initial noise, solves the
flow-matching ODE with the DiT (codes -> mel, `repeats` mel frames per code),
vocodes the mel with BigVGAN (prod(upsample_rates) samples per mel frame).
Codes are one group a frame (`[frames, 1]`); the stage cuts off the audio of
the context frames.

The checkpoint is the whole Qwen2.5-Omni folder as the hub ships it:
config.json's `token2wav_config`, the `token2wav.*` tensors of
model.safetensors (only those are read) and the voices of spk_dict.pt (name
-> {"cond", "ref_mel", "bos_token"}; the default voice is Chelsie, as
`Qwen2_5OmniForConditionalGeneration.generate`'s). The older stand-alone
layout (a Token2Wav folder of its own with speakers.safetensors +
speakers.json, omni_tools.tiny_token2wav) still loads. The sampler is
transformers' own unless the stage config sets it
(`Qwen2_5OmniToken2WavModel.forward`: 10 time points of an RK4 solve, 4 DiT
evaluations per interval; guidance 0.5; sway -1.0).

Noise, as transformers draws it: `torch.manual_seed(S)` then
`model(code, cond, ref_mel)` draws `torch.randn([1, n_codes * repeats,
mel_dim])` (float32 on CPU for the float32 reference mel) inside
`Qwen2_5OmniToken2WavDiTModel.sample`, before anything else uses the RNG; a
chunk gets its rows of that draw (omni_serve.audio.noise says why that is
exact with mel_dim 80).

Why groups of equal length and not padding: the DiT has no padding mask (its
attention mask is only the block-distance mask) and BigVGAN's convolutions
would see the padding at the edge, so a padded request would not sound the
same as alone (measured on the tiny model: 12 codes padded with 4 more come
out at 15 dB SNR against the unpadded decode). In a steady stream every chunk
has the same length, so groups are full; first and last chunks run in groups
of their own length. The reference mel's length is the `batch_key`.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.noise import prefix_stable, utterance_noise
from omni_serve.audio.request import AudioRequest, ChunkContext
from omni_serve.families import checkpoint_tensors
from omni_serve.families.qwen2_5_omni.token2wav_context import dit_context_codes

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SPEAKER_DICT = "spk_dict.pt"  # the voices: name -> {"cond", "ref_mel", "bos_token"}
TOKEN2WAV_PREFIX = "token2wav."
# The older stand-alone layout (a Token2Wav folder of its own, omni_tools.tiny_token2wav).
SPEAKERS_FILE = "speakers.safetensors"
SPEAKERS_INDEX = "speakers.json"
DEFAULT_SAMPLE_RATE = 24_000  # the model's output rate
DEFAULT_VOICE = "Chelsie"  # Qwen2_5OmniForConditionalGeneration.generate's default voice

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Voice:
    """One voice's conditioning: `cond` [1, enc_emb_dim] and `ref_mel` [1, frames, mel_dim]."""

    cond: torch.Tensor
    ref_mel: torch.Tensor


def model_defaults() -> dict[str, Any]:
    """num_steps, guidance_scale, sway_coefficient of `Qwen2_5OmniToken2WavModel.forward`."""
    from transformers import Qwen2_5OmniToken2WavModel

    params = inspect.signature(Qwen2_5OmniToken2WavModel.forward).parameters
    return {name: params[name].default for name in ("num_steps", "guidance_scale", "sway_coefficient")}


class Token2Wav:
    """One Token2Wav model in float32 (or `cfg.dtype`) and its voices; see the module docstring."""

    codec_groups = 1

    @classmethod
    def load(cls, cfg: AudioStageConfig) -> Token2Wav:
        model, voices, default, sample_rate = load_token2wav(Path(cfg.model), cfg.device)
        return cls(model, voices, default, sample_rate, cfg)

    def __init__(self, model: Any, voices: dict[str, Voice], default: str, sample_rate: int,
                 cfg: AudioStageConfig):
        self.device = cfg.device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.model = model.to(device=cfg.device, dtype=self.dtype).eval()
        self.dit = self.model.code2wav_dit_model
        # The speaker encoder reads only the reference mel: one run per decode, not one per
        # DiT evaluation (36 with transformers' sampler).
        embed = self.dit.input_embed
        embed.spk_encoder = LastCallMemo(embed.spk_encoder)
        self.vocoder = self.model.code2wav_bigvgan_model
        self.voices_by_name = voices
        self.voices = tuple(voices)
        self.default_voice = default
        self.sample_rate = sample_rate
        defaults = model_defaults()
        self.num_steps = defaults["num_steps"] if cfg.num_steps is None else cfg.num_steps
        self.guidance_scale = defaults["guidance_scale"] if cfg.guidance_scale is None else cfg.guidance_scale
        self.sway_coefficient = (defaults["sway_coefficient"] if cfg.sway_coefficient is None
                                 else cfg.sway_coefficient)

        dit_cfg, voc_cfg = self.model.config.dit_config, self.model.config.bigvgan_config
        self.mel_frames_per_code = int(dit_cfg.repeats)
        self.samples_per_mel_frame = math.prod(voc_cfg.upsample_rates)
        self.samples_per_frame = self.mel_frames_per_code * self.samples_per_mel_frame
        self.mel_dim = int(dit_cfg.mel_dim)
        # What a chunk needs around it to sound as the whole utterance (chunk_plan's arguments).
        self.context: ChunkContext = dit_context_codes(dit_cfg, voc_cfg)
        if not prefix_stable(self.mel_frames_per_code, self.mel_dim):
            logger.warning("omni_audio: repeats * mel_dim = %d is not a multiple of 16: the last frames "
                           "of a chunk's noise differ from the whole utterance's draw",
                           self.mel_frames_per_code * self.mel_dim)
        # The DiT embeds ids 0..num_embeds; the last one is not an audio code (see tiny_token2wav).
        self.codec_vocab = int(dit_cfg.num_embeds) - 1
        # the longest utterance the DiT can place (its mel positions)
        self.max_frames = dit_cfg.max_position_embeddings // self.mel_frames_per_code

    def batch_key(self, request: AudioRequest) -> int:
        """The voice's reference-mel length: the DiT batches equal ones."""
        return self.voices_by_name[request.voice].ref_mel.shape[1]

    def decode(self, group: list[AudioRequest]) -> np.ndarray:
        """One batched Token2Wav call: float32 [len(group), frames * samples_per_frame]."""
        device = self.device
        # conditioning
        codes = torch.from_numpy(np.stack([r.codes[:, 0] for r in group])).to(device)
        voices = [self.voices_by_name[r.voice] for r in group]
        cond = torch.cat([v.cond for v in voices]).to(device, self.dtype)
        ref_mel = torch.cat([v.ref_mel for v in voices]).to(device, self.dtype)
        noise = torch.stack([self.initial_noise(r.seed, r.offset, len(r.codes)) for r in group])
        # codes -> mel (flow matching), mel -> waveform (vocoder)
        mel = sample_mel(self.dit, cond, ref_mel, codes, noise.to(device, self.dtype),
                         num_steps=self.num_steps, guidance_scale=self.guidance_scale,
                         sway_coefficient=self.sway_coefficient)
        wave = self.vocoder(mel).float().reshape(len(group), -1).cpu().numpy()
        expected = codes.shape[1] * self.samples_per_frame
        if wave.shape[1] != expected:
            raise RuntimeError(f"vocoder returned {wave.shape[1]} samples for {codes.shape[1]} codes, "
                               f"expected {expected}: upsample kernels and rates of this BigVGAN do not "
                               "give exactly prod(upsample_rates) samples per mel frame")
        return wave

    def initial_noise(self, seed: int, offset: int, n_codes: int) -> torch.Tensor:
        """float32 [n_codes * repeats, mel_dim]: the utterance's noise at codes offset..offset+n-1,
        the rows transformers' one draw after `torch.manual_seed(seed)` has there."""
        return utterance_noise(seed, offset, n_codes, self.mel_frames_per_code, self.mel_dim)


class LastCallMemo(torch.nn.Module):
    """Wraps a module whose output depends only on its one tensor input: a call with an input
    equal (same shape, dtype and values) to the last call's returns the last output.

    The flow-matching ODE calls the DiT 4 times per interval with the same reference mel,
    and the DiT's speaker encoder (ECAPA-TDNN) reads only that: measured on the tiny
    checkpoint, 60 of 170 ms per 64-code decode went to recomputing it. The output is the
    very tensor the first call made, so decoding is bitwise unchanged. Not thread-safe:
    the audio runner decodes one group at a time.
    """

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = self._last
        if (last is not None and last[0].shape == x.shape and last[0].dtype == x.dtype
                and last[0].device == x.device and torch.equal(last[0], x)):
            return last[1]
        out = self.inner(x)
        self._last = (x.detach().clone(), out.detach())
        return out

    def forget(self) -> None:
        """The next call runs the module (its output may differ now: other torch threads)."""
        self._last = None


def sample_mel(dit, cond: torch.Tensor, ref_mel: torch.Tensor, codes: torch.Tensor, noise: torch.Tensor, *,
               num_steps: int, guidance_scale: float, sway_coefficient: float) -> torch.Tensor:
    """`Qwen2_5OmniToken2WavDiTModel.sample` with the initial noise given: mel [B, mel_dim, frames].

    The library draws its noise from the global RNG in one call for the whole
    batch; taking it as an argument makes every request's mel its own.
    """
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    frames = noise.shape[1]
    if codes.shape[1] * dit.repeats != frames:
        raise ValueError(f"noise has {frames} frames for {codes.shape[1]} codes x {dit.repeats}")
    speaker = cond.unsqueeze(1).repeat(1, frames, 1)

    def velocity(t, x):
        if guidance_scale < 1e-5:
            return dit(hidden_states=x, speaker_embedding=speaker, condition_vector=ref_mel,
                       quantized_code=codes, time_step=t, drop_audio_conditioning=False, drop_code=False,
                       apply_cfg=False)
        out = dit(hidden_states=x, quantized_code=codes, speaker_embedding=speaker,
                  condition_vector=ref_mel, time_step=t, apply_cfg=True)
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * guidance_scale

    t = torch.linspace(0, 1, num_steps, device=codes.device, dtype=speaker.dtype)
    if sway_coefficient is not None:
        t += sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
    trajectory = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)
    return trajectory[-1].permute(0, 2, 1)


# --- loading ---------------------------------------------------------------------------


def load_token2wav(folder: Path, device: str = "cpu") -> tuple[Any, dict[str, Voice], str, int]:
    """(Qwen2_5OmniToken2WavModel in float32, name -> Voice, default voice, sample rate) of `folder`.

    `folder` is a whole Qwen2.5-Omni checkpoint (config.json with
    `token2wav_config`, `token2wav.*` tensors, spk_dict.pt) or, as before, a
    stand-alone Token2Wav folder (its own config.json, speakers.safetensors +
    speakers.json).

    Raises:
        FileNotFoundError: a file the layout needs is missing.
        ValueError: the folder is not a Token2Wav checkpoint, or its weights or voices do not fit.
    """
    from transformers import Qwen2_5OmniToken2WavConfig, Qwen2_5OmniToken2WavModel

    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: give a Qwen2.5-Omni checkpoint folder")
    raw = json.loads(config_path.read_text())
    if "token2wav_config" not in raw:
        if raw.get("model_type") != "qwen2_5_omni_token2wav":
            raise ValueError(f"{config_path} has no token2wav_config (model_type "
                             f"{raw.get('model_type')!r}): give a Qwen2.5-Omni checkpoint folder, e.g. "
                             "Qwen/Qwen2.5-Omni-7B")
        model = Qwen2_5OmniToken2WavModel.from_pretrained(folder, dtype=torch.float32)
        mel_dim = int(model.config.dit_config.mel_dim)
        return (model, *load_voices(folder, mel_dim, device))
    config = Qwen2_5OmniToken2WavConfig.from_dict(raw["token2wav_config"])
    model = Qwen2_5OmniToken2WavModel._from_config(config, attn_implementation="sdpa",
                                                   dtype=torch.float32)
    state = read_prefixed_tensors(folder, TOKEN2WAV_PREFIX)
    want = set(model.state_dict())
    missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
    if missing or unexpected:
        raise ValueError(f"{folder}: the {TOKEN2WAV_PREFIX}* weights do not fit token2wav_config: "
                         f"{len(missing)} missing ({_names(missing, TOKEN2WAV_PREFIX)}), "
                         f"{len(unexpected)} unexpected ({_names(unexpected, TOKEN2WAV_PREFIX)})")
    model.load_state_dict(state, strict=True)
    voices, default = load_speaker_dict(folder / SPEAKER_DICT, int(config.dit_config.mel_dim), device)
    return model, voices, default, DEFAULT_SAMPLE_RATE


def read_prefixed_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The `prefix*` tensors of the folder's safetensors weights, prefix stripped; reads only those."""
    state = checkpoint_tensors.read_prefixed(folder, prefix)
    if not state:
        raise ValueError(f"{folder} has no {prefix}* weights: this checkpoint does not ship Token2Wav")
    return state


def load_speaker_dict(path: Path, mel_dim: int, device: str) -> tuple[dict[str, Voice], str]:
    """(name -> Voice, default voice) from spk_dict.pt (read with weights_only=True)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: Qwen2.5-Omni ships its voices there (name -> "
                                '{"cond", "ref_mel", "bos_token"})')
    raw = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path} must hold a non-empty dict of voice name -> {{cond, ref_mel, bos_token}}")
    voices = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or not {"cond", "ref_mel"} <= set(entry):
            raise ValueError(f"{path}: voice {name!r} needs a dict with cond and ref_mel")
        voices[str(name)] = _voice(str(name), entry["cond"], entry["ref_mel"], mel_dim, device)
    return voices, DEFAULT_VOICE if DEFAULT_VOICE in voices else next(iter(voices))


def load_voices(folder: Path, mel_dim: int, device: str) -> tuple[dict[str, Voice], str, int]:
    """(name -> Voice, default voice, sample rate) from speakers.safetensors + speakers.json."""
    from safetensors.torch import load_file

    index_path, tensors_path = folder / SPEAKERS_INDEX, folder / SPEAKERS_FILE
    for path in (index_path, tensors_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: a Token2Wav folder needs {SPEAKERS_INDEX} and "
                                    f"{SPEAKERS_FILE} (see omni_tools.tiny_token2wav.write_speakers)")
    index = json.loads(index_path.read_text())
    if not isinstance(index, dict) or not isinstance(index.get("speakers"), list):
        raise ValueError(f"{index_path} must be a JSON object with a \"speakers\" list of voice names")
    tensors = load_file(str(tensors_path))
    voices = {}
    for name in index["speakers"]:
        try:
            cond, ref_mel = tensors[f"{name}.cond"], tensors[f"{name}.ref_mel"]
        except KeyError as e:
            raise ValueError(f"{tensors_path} has no tensor {e} for voice {name!r}") from e
        voices[name] = _voice(name, cond, ref_mel, mel_dim, device)
    if not voices:
        raise ValueError(f"{index_path} lists no speakers")
    default = index.get("default") or next(iter(voices))
    return voices, default, int(index.get("sample_rate", DEFAULT_SAMPLE_RATE))


def _voice(name: str, cond: Any, ref_mel: Any, mel_dim: int, device: str) -> Voice:
    if (not isinstance(cond, torch.Tensor) or not isinstance(ref_mel, torch.Tensor) or cond.ndim != 2
            or cond.shape[0] != 1 or ref_mel.ndim != 3 or ref_mel.shape[::2] != (1, mel_dim)):
        shapes = [list(getattr(t, "shape", [])) for t in (cond, ref_mel)]
        raise ValueError(f"voice {name!r}: expected cond [1, D] and ref_mel [1, frames, {mel_dim}] "
                         f"tensors, got {shapes[0]} and {shapes[1]}")
    return Voice(cond.float().to(device), ref_mel.float().to(device))


def _names(names: list[str], prefix: str, most: int = 5) -> str:
    shown = ", ".join(prefix + n for n in names[:most])
    return shown + (", ..." if len(names) > most else "") if names else "none"

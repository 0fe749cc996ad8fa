"""The omni_audio Token2Wav runner (runs inside the Triton stub and in tests).

Flow: Triton's dynamic batcher hands the adapter a list of parsed
`AudioRequest`s; `AudioRunner.run` groups them by `group_key` (same number
of codes and same reference-mel length), and for each group, as
Qwen2.5-Omni's `Qwen2_5OmniToken2WavModel.forward` does: draws the initial
noise (per request, from its seed and code positions), solves the
flow-matching ODE with the DiT (codes -> mel, `repeats` mel frames per code),
vocodes the mel with BigVGAN (prod(upsample_rates) samples per frame) and
cuts off the audio of the context codes. It returns one float32 mono
waveform in [-1, 1] or one exception per request, in request order.

Why groups of equal length and not padding: the DiT has no padding mask (its
attention mask is only the block-distance mask) and BigVGAN's convolutions
would see the padding at the edge, so a padded request would not sound the
same as alone (measured on the tiny model: 12 codes padded with 4 more come
out at 15 dB SNR against the unpadded decode). In a steady stream every chunk has the same length, so groups
are full; first and last chunks run in groups of their own length.
"""
from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.request import AudioLimits, AudioRequest
from omni_serve.batching import run_grouped

logger = logging.getLogger(__name__)

SPEAKERS_FILE = "speakers.safetensors"
SPEAKERS_INDEX = "speakers.json"
DEFAULT_SAMPLE_RATE = 24_000  # Qwen2.5-Omni's, used when speakers.json does not say
NOISE_SEGMENT_CODES = 64  # noise is drawn per segment of this many code positions

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

GroupKey = tuple[int, int]


@dataclass(frozen=True)
class Voice:
    """One speaker's conditioning: `cond` [1, enc_emb_dim] and `ref_mel` [1, frames, mel_dim]."""

    cond: torch.Tensor
    ref_mel: torch.Tensor


class AudioRunner:
    """Owns one Token2Wav model and its voices; `run` is safe to call from several threads."""

    def __init__(self, cfg: AudioStageConfig):
        from transformers import Qwen2_5OmniToken2WavModel

        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.model = Qwen2_5OmniToken2WavModel.from_pretrained(cfg.model, dtype=self.dtype)
        self.model.to(cfg.device).eval()
        self.dit = self.model.code2wav_dit_model
        self.vocoder = self.model.code2wav_bigvgan_model
        self._lock = threading.Lock()

        dit_cfg, voc_cfg = self.model.config.dit_config, self.model.config.bigvgan_config
        self.frames_per_code = int(dit_cfg.repeats)
        self.samples_per_frame = math.prod(voc_cfg.upsample_rates)
        self.samples_per_code = self.frames_per_code * self.samples_per_frame
        self.mel_dim = int(dit_cfg.mel_dim)
        # Codes per DiT attention block: chunks whose first code sent is a multiple of it
        # see the same blocks as the whole stream (`chunk_plan(..., align=block_codes)`).
        self.block_codes = max(1, dit_cfg.block_size // self.frames_per_code)
        # The DiT embeds ids 0..num_embeds; the last one is not an audio code (see tiny_token2wav).
        codec_vocab = int(dit_cfg.num_embeds) - 1
        longest = dit_cfg.max_position_embeddings // self.frames_per_code
        if cfg.max_codec_tokens > longest:
            raise ValueError(f"max_codec_tokens={cfg.max_codec_tokens} exceeds what the DiT can place "
                             f"({dit_cfg.max_position_embeddings} mel positions = {longest} codes); set "
                             f"max_codec_tokens <= {longest}")

        self.voices, default, self._sample_rate = load_voices(Path(cfg.model), self.mel_dim, cfg.device)
        default = cfg.default_speaker or default
        if default not in self.voices:
            raise ValueError(f"default_speaker={default!r} is not a voice of {cfg.model}; known voices: "
                             f"{', '.join(self.voices)}")
        self.limits = AudioLimits(codec_vocab=codec_vocab, speakers=tuple(self.voices),
                                  default_speaker=default, max_codec_tokens=cfg.max_codec_tokens)

    @property
    def sample_rate(self) -> int:
        return self._sample_rate

    def group_key(self, req: AudioRequest) -> GroupKey:
        """Requests with equal keys run in one batched DiT + BigVGAN call."""
        return len(req.codes), self.voices[req.speaker].ref_mel.shape[1]

    def run(self, requests: list[AudioRequest]) -> list[np.ndarray | Exception]:
        """Per request, float32 [new_codes * samples_per_code] audio or the exception it raised, in order."""
        results: list[np.ndarray | Exception | None] = [None] * len(requests)
        todo = []
        for i, req in enumerate(requests):
            if req.new_codes < 1:
                results[i] = ValueError(f"{len(req.codes)} codes with {req.context} of left and "
                                        f"{req.lookahead} of right context leave nothing to voice")
            else:
                todo.append(i)
        outs = run_grouped([requests[i] for i in todo], self.group_key, self._decode,
                           label="omni_audio")
        for i, out in zip(todo, outs, strict=True):
            results[i] = out
        return results  # type: ignore[return-value]  # every slot is filled above

    def _decode(self, group: list[AudioRequest]) -> list[np.ndarray]:
        """One batched Token2Wav call for requests with equal `group_key`s."""
        device = self.cfg.device
        # conditioning
        codes = torch.from_numpy(np.stack([r.codes for r in group])).to(device)
        cond = torch.cat([self.voices[r.speaker].cond for r in group]).to(self.dtype)
        ref_mel = torch.cat([self.voices[r.speaker].ref_mel for r in group]).to(self.dtype)
        noise = torch.stack([self.initial_noise(r.seed, r.offset, len(r.codes)) for r in group])
        with self._lock, torch.inference_mode():
            # codes -> mel (flow matching), mel -> waveform (vocoder)
            mel = sample_mel(self.dit, cond, ref_mel, codes, noise.to(device, self.dtype),
                             num_steps=self.cfg.num_steps, guidance_scale=self.cfg.guidance_scale,
                             sway_coefficient=self.cfg.sway_coefficient)
            wave = self.vocoder(mel).float().reshape(len(group), -1).numpy()
        expected = codes.shape[1] * self.samples_per_code
        if wave.shape[1] != expected:
            raise RuntimeError(f"vocoder returned {wave.shape[1]} samples for {codes.shape[1]} codes, "
                               f"expected {expected}: upsample kernels and rates of this BigVGAN do not "
                               "give exactly prod(upsample_rates) samples per mel frame")
        # keep the audio of the voiced codes only
        spc = self.samples_per_code
        return [np.ascontiguousarray(w[r.context * spc:(r.context + r.new_codes) * spc])
                for w, r in zip(wave, group)]

    def initial_noise(self, seed: int, offset: int, n_codes: int) -> torch.Tensor:
        """float32 [n_codes * frames_per_code, mel_dim] noise of code positions offset..offset+n_codes-1.

        A pure function of (seed, position): each segment of NOISE_SEGMENT_CODES
        positions has its own generator, so neither batch-mates nor the chunking
        of a stream change the noise a position gets.
        """
        fpc, seg = self.frames_per_code, NOISE_SEGMENT_CODES
        first, last = offset // seg, (offset + n_codes - 1) // seg
        parts = []
        for s in range(first, last + 1):
            state = np.random.SeedSequence([seed & (2**64 - 1), s]).generate_state(1, np.uint64)[0]
            gen = torch.Generator().manual_seed(int(state) & (2**63 - 1))
            parts.append(torch.randn(seg * fpc, self.mel_dim, generator=gen))
        start = (offset - first * seg) * fpc
        return torch.cat(parts)[start:start + n_codes * fpc]


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
    tensors = load_file(str(tensors_path), device=device)
    voices = {}
    for name in index["speakers"]:
        try:
            cond, ref_mel = tensors[f"{name}.cond"], tensors[f"{name}.ref_mel"]
        except KeyError as e:
            raise ValueError(f"{tensors_path} has no tensor {e} for voice {name!r}") from e
        if cond.ndim != 2 or cond.shape[0] != 1 or ref_mel.ndim != 3 or ref_mel.shape[::2] != (1, mel_dim):
            raise ValueError(f"voice {name!r}: expected cond [1, D] and ref_mel [1, frames, {mel_dim}], got "
                             f"{list(cond.shape)} and {list(ref_mel.shape)}")
        voices[name] = Voice(cond.float(), ref_mel.float())
    if not voices:
        raise ValueError(f"{index_path} lists no speakers")
    default = index.get("default") or next(iter(voices))
    return voices, default, int(index.get("sample_rate", DEFAULT_SAMPLE_RATE))


def real_time_factor(compute_seconds: float, samples: int, sample_rate: int) -> float:
    """Compute time over audio time (below 1: faster than real time)."""
    return compute_seconds / (samples / sample_rate) if samples else math.inf

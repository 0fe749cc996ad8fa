"""A tiny random-weight Qwen2.5-Omni Token2Wav (codec tokens -> 24 kHz waveform), built locally.

Where it runs: in the set-up / user process and in tests (never inside
tritonserver, which only reads the folder this writes).

What it writes into `out/`, the folder layout the omni_audio stage loads:
- `config.json` + `model.safetensors`: a `Qwen2_5OmniToken2WavModel` saved with
  `save_pretrained`, loaded back with `Qwen2_5OmniToken2WavModel.from_pretrained(out)`,
  the same call a real export goes through;
- `speakers.safetensors`: per voice `<name>.cond` (float32 [1, enc_emb_dim],
  the speaker x-vector the DiT gets as `speaker_embedding`) and `<name>.ref_mel`
  (float32 [1, frames, mel_dim], the reference mel its ECAPA encoder pools
  into `condition_vector`), the tensors the real checkpoint ships in
  `spk_dict.pt`, in a format that loads without pickle;
- `speakers.json`: `{"speakers": [...], "default": ..., "sample_rate": 24000}`.

Shape of the model (see `TINY_DIT` / `TINY_BIGVGAN`): the DiT is tiny (hidden 32,
2 layers) but keeps the real block attention (24 frames a block, one layer
looking one block back, one looking one block ahead) and 2 mel frames per
code (`repeats`); BigVGAN keeps the real upsampling (rates 5,3,2,2,2,2: 240
samples per mel frame, so 480 samples per code at 24 kHz, 50 codes a second)
with tiny channels and one residual kernel instead of three.

Codec vocabulary: the DiT embeds ids 0..num_embeds (an `nn.Embedding` of
num_embeds + 1 rows). The real config has num_embeds = 8193 for the talker's
8192 audio codes 0..8191; the one extra id (8192, = codec_vocab) is never an
audio code the talker emits, so the stage accepts [0, codec_vocab) with
codec_vocab = num_embeds - 1. Id 0 doubles as the "dropped code" of the
classifier-free-guidance branch (DiTCodecEmbedding zeroes the codes).

Weights are random with a fixed seed, re-drawn with fan-in scaling (the
library's std-0.02 init gives a silent 1e-8 waveform), so the audio has a
real amplitude and depends on codes, speaker and noise; BigVGAN's last conv is
then scaled so a random utterance has an RMS of 0.1.

Exporting a real checkpoint (not done here: nothing is downloaded): a
Qwen2.5-Omni checkpoint keeps Token2Wav inside the full model under the
`token2wav.` prefix and the speakers in `spk_dict.pt` (pickled dict name ->
{"cond", "ref_mel", "bos_token"}). Load `Qwen2_5OmniForConditionalGeneration`,
call `model.token2wav.save_pretrained(out)` (its config is
`config.token2wav_config`), and write `spk_dict.pt`'s `cond`/`ref_mel` with
`write_speakers` (the talker's `bos_token` stays with the talker).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from omni_serve.families.qwen2_5_omni.token2wav import SPEAKERS_FILE, SPEAKERS_INDEX

SAMPLE_RATE = 24_000  # Qwen2.5-Omni's output rate: 240 samples per mel frame x 100 frames/s
VOICES = ("Chelsie", "Ethan")
DEFAULT_VOICE = "Chelsie"
REF_MEL_FRAMES = 120  # frames of reference mel per voice (the real ones hold a few seconds)
SEED = 0
TARGET_RMS = 0.1  # loudness of the random voice's waveform (clamped to [-1, 1] by BigVGAN)

TINY_DIT = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
    block_size=24, look_backward_layers=[0], look_ahead_layers=[1], repeats=2, mel_dim=80,
    enc_emb_dim=16, enc_dim=16, enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1],
    enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16, enc_res2net_scale=2, enc_se_channels=16,
    dropout=0.0,
)
TINY_BIGVGAN = dict(
    mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
    upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],
)


def build_token2wav(out: Path, *, codec_vocab: int = 512) -> None:
    """Write a tiny random Token2Wav checkpoint and two voices into `out` (created if missing).

    `codec_vocab` is the number of audio codes the talker emits (ids
    0..codec_vocab-1); the DiT gets num_embeds = codec_vocab + 1 as the real
    config does (8193 for 8192 codes).
    """
    from transformers import Qwen2_5OmniToken2WavConfig, Qwen2_5OmniToken2WavModel

    if codec_vocab < 2:
        raise ValueError(f"codec_vocab={codec_vocab} must be at least 2")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen2_5OmniToken2WavConfig(dit_config=dict(TINY_DIT, num_embeds=codec_vocab + 1),
                                        bigvgan_config=dict(TINY_BIGVGAN))
    gen = torch.Generator().manual_seed(SEED)
    model = Qwen2_5OmniToken2WavModel(config).eval()
    _redraw_weights(model, gen)
    dit = config.dit_config
    voices = {name: {"cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
                     "ref_mel": _reference_mel(REF_MEL_FRAMES, dit.mel_dim, gen)}
              for name in VOICES}
    _calibrate_loudness(model, voices[DEFAULT_VOICE], codec_vocab, gen)
    model.save_pretrained(out)
    write_speakers(out, voices, default=DEFAULT_VOICE, sample_rate=SAMPLE_RATE)


def write_speakers(out: Path, voices: dict[str, dict[str, torch.Tensor]], *, default: str,
                   sample_rate: int = SAMPLE_RATE) -> None:
    """Write `speakers.safetensors` + `speakers.json` from name -> {"cond", "ref_mel"} tensors.

    Takes the shape of a real `spk_dict.pt` (extra keys such as `bos_token` are ignored).
    """
    from safetensors.torch import save_file

    if default not in voices:
        raise ValueError(f"default voice {default!r} is not one of {sorted(voices)}")
    tensors = {f"{name}.{key}": voices[name][key].detach().float().contiguous().cpu()
               for name in voices for key in ("cond", "ref_mel")}
    save_file(tensors, str(Path(out) / SPEAKERS_FILE))
    index = {"speakers": list(voices), "default": default, "sample_rate": sample_rate}
    (Path(out) / SPEAKERS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _reference_mel(frames: int, mel_dim: int, gen: torch.Generator) -> torch.Tensor:
    """A smooth log-mel-like [1, frames, mel_dim] tensor (values around log-amplitude -5..0)."""
    t = torch.arange(frames, dtype=torch.float32)[:, None]
    f = torch.arange(mel_dim, dtype=torch.float32)[None, :]
    phase = torch.rand(2, generator=gen) * 2 * math.pi
    base = -2.5 - 2.0 * f / mel_dim + torch.sin(t / 7 + phase[0]) * torch.cos(f / 9 + phase[1])
    return (base + 0.1 * torch.randn(frames, mel_dim, generator=gen))[None]


@torch.no_grad()
def _redraw_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Fan-in scaled normal weights for every linear, conv and embedding (buffers untouched)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        if isinstance(module, torch.nn.Embedding):
            weight.copy_(torch.randn(weight.shape, generator=gen))
        elif isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)):
            fan_in = weight[0].numel()
            weight.copy_(torch.randn(weight.shape, generator=gen) / math.sqrt(fan_in))
        elif isinstance(module, torch.nn.ConvTranspose1d):
            fan_in = weight.shape[0] * weight.shape[2] / module.stride[0]
            weight.copy_(torch.randn(weight.shape, generator=gen) / math.sqrt(fan_in))
        else:
            continue
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.nn.Parameter):
            bias.copy_(0.01 * torch.randn(bias.shape, generator=gen))


@torch.no_grad()
def _calibrate_loudness(model, voice: dict[str, torch.Tensor], codec_vocab: int,
                        gen: torch.Generator) -> None:
    """Scale BigVGAN's last conv so a decoded random utterance has RMS `TARGET_RMS` (no clipping)."""
    codes = torch.randint(0, codec_vocab, (1, 48), generator=gen)
    with torch.random.fork_rng():  # `sample` draws its noise from the global RNG
        torch.manual_seed(SEED)
        mel = model.code2wav_dit_model.sample(voice["cond"], voice["ref_mel"], codes, num_steps=4)
    captured: list[torch.Tensor] = []
    conv_post = model.code2wav_bigvgan_model.conv_post
    handle = conv_post.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        model.code2wav_bigvgan_model(mel)
    finally:
        handle.remove()
    rms = captured[0].pow(2).mean().sqrt()
    conv_post.weight.mul_(TARGET_RMS / rms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a tiny random Qwen2.5-Omni Token2Wav checkpoint.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--codec-vocab", type=int, default=512)
    args = parser.parse_args(argv)
    build_token2wav(args.out, codec_vocab=args.codec_vocab)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Token2Wav's chunk context: what a chunk must carry to sound as the whole utterance (any process).

Qwen2.5-Omni's codec decoder is a DiT with block attention (flow matching,
`repeats` mel frames per code) and a BigVGAN vocoder. Both look around each
frame, so a chunk the orchestrator cuts from the talker's stream needs left
and right context and must start on a DiT block boundary.
`dit_context_codes` says how much, from the checkpoint's `token2wav_config`
(config.json only, no weights, no torch): omni-gen-repo writes it into the
orchestrator's engine.json (`Family.decoder_context`), and the audio stage's
`Token2Wav.context` is the same numbers.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from omni_serve.audio.request import ChunkContext


def chunk_context(config: Mapping[str, Any]) -> ChunkContext | None:
    """The context of the Token2Wav in a checkpoint's config.json (the whole model's
    `token2wav_config`, or a stand-alone Token2Wav's own config); None when it has none."""
    t2w = config.get("token2wav_config", config)
    if not isinstance(t2w, Mapping) or "dit_config" not in t2w:
        return None
    return dit_context_codes(t2w["dit_config"], t2w.get("bigvgan_config"))


# Qwen2.5-Omni's anti-aliased activations (Qwen2_5OmniAntiAliasedActivation1d defaults):
# upsample x2 with a 12-tap filter, activation, downsample x2 with a 12-tap filter.
_ACT_RATIO, _ACT_KERNEL = 2, 12


def dit_context_codes(dit_config: Any, bigvgan_config: Any = None, *, passes: int = 1) -> ChunkContext:
    """Left and right context (codes) and alignment that make a chunk's voiced audio exact.

    `dit_config` / `bigvgan_config` are the checkpoint's `token2wav_config`
    parts (transformers config objects or their config.json dicts). The DiT
    attends within blocks of `block_size` mel frames counted from the first
    frame sent, each layer of `look_backward_layers` one block back and each of
    `look_ahead_layers` one block ahead, so over the layers a frame's mel
    depends on `len(look_backward_layers)` whole blocks before its own and
    `len(look_ahead_layers)` after; `repeats` frames per code. BigVGAN's
    convolutions then make each frame's samples depend on the mel of
    `vocoder_context_frames` frames around it, which must be exact too
    (`bigvgan_config=None` leaves that out: the DiT's context alone).

    The flow-matching ODE runs the DiT `ode_dit_passes(num_steps)` times in a
    row (36 for 10 steps), each pass widening the field again, so a strictly
    exact chunk needs `passes=ode_dit_passes(num_steps)`: most of the
    utterance. `passes` says how many passes to cover; the coupling fades fast
    (tiny default, 480 codes in chunks of 24, 10 steps: passes=1 93 dB SNR
    against the whole decode, passes=2 116 dB = float32 rounding; the DiT's
    field alone, no vocoder, 54 dB; 12/12/12 52 dB).

    The result holds for every chunk boundary `chunk_plan` can produce (any
    begin and end); at the stream's start and end less is needed and
    `chunk_plan` sends what there is. Qwen2.5-Omni-7B: (41, 40, 12) for one
    pass, (65, 52, 12) for two; the tiny default: (21, 32, 12) and (33, 44, 12).
    """
    frames = int(_get(dit_config, "repeats"))
    block = int(_get(dit_config, "block_size"))
    layers = int(_get(dit_config, "num_hidden_layers"))
    back = passes * len({int(i) for i in _get(dit_config, "look_backward_layers") if 0 <= int(i) < layers})
    ahead = passes * len({int(i) for i in _get(dit_config, "look_ahead_layers") if 0 <= int(i) < layers})
    if frames < 1 or block < 1 or passes < 1:
        raise ValueError(f"need repeats >= 1, block_size >= 1 and passes >= 1, got {frames}, {block} "
                         f"and {passes}")
    before, after = (0, 0) if bigvgan_config is None else vocoder_context_frames(bigvgan_config)
    align = math.lcm(block, frames) // frames  # codes whose frames fill whole blocks
    period = align * block  # begin/end residues repeat with this period (in codes)

    def exact_from(begin: int) -> int:
        """Last frame allowed as the first one sent so that code `begin` comes out exact."""
        return ((begin * frames - before) // block - back) * block

    left = 0
    while any(max(0, b - left) // align * align * frames > max(exact_from(b), 0)
              for b in range(left, left + period + 1)):
        left += 1

    def codes_up_to(end: int) -> int:
        """Codes to send so that the codes before `end` come out exact."""
        last_block = (end * frames - 1 + after) // block + ahead
        return -(-(last_block + 1) * block // frames)

    right = max(codes_up_to(e) - e for e in range(1, period + 1))
    return ChunkContext(left, right, align)


def ode_dit_passes(num_steps: int) -> int:
    """DiT evaluations in a row in one Token2Wav decode: RK4 (4 per interval) over num_steps - 1 intervals."""
    return 4 * (num_steps - 1)


def vocoder_context_frames(bigvgan_config: Any) -> tuple[int, int]:
    """(before, after): the mel frames around a frame that its BigVGAN samples depend on.

    Follows Qwen2_5OmniToken2WavBigVGANModel's layers back from one frame's
    samples to the mel: conv_post and conv_pre (kernel 7), per upsampling
    stage a transposed conv and the anti-aliased AMP residual blocks (the
    widest kernel counts). Exact index arithmetic of every tap (Qwen2.5-Omni:
    34 frames each side, the tiny default: 18); the outermost taps of the
    chained anti-aliasing filters weigh less than float64 can resolve, so a
    perturbation test sees fewer (27 and 13). The input's own edges (replicate
    / zero padding) are not modelled: far from them, as context is.
    """
    rates = [int(r) for r in _get(bigvgan_config, "upsample_rates")]
    kernels = [int(k) for k in _get(bigvgan_config, "upsample_kernel_sizes")]
    blocks = list(zip((int(k) for k in _get(bigvgan_config, "resblock_kernel_sizes")),
                      ([int(d) for d in ds] for ds in _get(bigvgan_config, "resblock_dilation_sizes")),
                      strict=True))
    per_frame = math.prod(rates)
    frame = 8 * sum(kernels) + 1000  # far from the input's edges
    lo, hi = frame * per_frame, (frame + 1) * per_frame - 1  # that frame's samples
    lo, hi = _conv_back(lo, hi, 7, 1, 3)  # conv_post
    lo, hi = _activation_back(lo, hi)  # activation_post
    for rate, kernel in reversed(list(zip(rates, kernels, strict=True))):
        spans = [_amp_block_back(lo, hi, k, ds) for k, ds in blocks]
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        pad = (kernel - rate) // 2  # ConvTranspose1d(kernel, rate, padding=pad)
        lo, hi = -(-(lo + pad - kernel + 1) // rate), (hi + pad) // rate
    lo, hi = _conv_back(lo, hi, 7, 1, 3)  # conv_pre
    return frame - lo, hi - frame


def _get(config: Any, name: str) -> Any:
    return config[name] if isinstance(config, Mapping) else getattr(config, name)


def _conv_back(lo: int, hi: int, kernel: int, dilation: int, pad: int) -> tuple[int, int]:
    """Input indices a stride-1 Conv1d's outputs lo..hi read."""
    return lo - pad, hi - pad + (kernel - 1) * dilation


def _activation_back(lo: int, hi: int) -> tuple[int, int]:
    """Input indices the anti-aliased activation's outputs lo..hi read (downsample, then upsample)."""
    r, k = _ACT_RATIO, _ACT_KERNEL
    down_pad = k // 2 - (k % 2 == 0)  # Qwen2_5OmniDownSample1d: strided low-pass conv
    lo, hi = lo * r - down_pad, hi * r + k - 1 - down_pad
    pad = k // r - 1  # Qwen2_5OmniUpSample1d: replicate pad, transposed conv, crop
    crop = pad * r + (k - r) // 2
    return -(-(lo + crop - k + 1) // r) - pad, (hi + crop) // r - pad


def _amp_block_back(lo: int, hi: int, kernel: int, dilations: list[int]) -> tuple[int, int]:
    """Input indices an AMP residual block's outputs lo..hi read."""
    for dilation in reversed(dilations):  # x + conv2(act(conv1(act(x)))) per dilation
        lo, hi = _conv_back(lo, hi, kernel, 1, (kernel - 1) // 2)
        lo, hi = _activation_back(lo, hi)
        lo, hi = _conv_back(lo, hi, kernel, dilation, (kernel * dilation - dilation) // 2)
        lo, hi = _activation_back(lo, hi)
    return lo, hi

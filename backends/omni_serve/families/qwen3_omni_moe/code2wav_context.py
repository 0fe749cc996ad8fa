"""Code2Wav's chunk context: what a chunk must carry to sound as the whole utterance (any process).

Qwen3-Omni's codec decoder (`Qwen3OmniMoeCode2Wav`) is causal: codes ->
a transformer whose layers all attend within a sliding window of earlier
frames -> a causal ConvNet that upsamples each frame to `total_upsample`
samples (1920 at 24 kHz). A chunk the orchestrator cuts from the talker's
stream therefore needs left context only, and `receptive_field` says how
much, from the checkpoint's `code2wav_config` (config.json only, no weights,
no torch): omni-gen-repo writes `chunk_context` into the orchestrator's
engine.json (`Family.decoder_context`), and the audio stage's
`Code2Wav.context` is the same numbers.

What flows through: a config mapping in, a `ChunkContext` / `Field` of plain
ints out.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from omni_serve.audio.request import ChunkContext

# Kernels the modules fix (Qwen3OmniMoeConvNeXtBlock's depthwise conv, the decoder's first and
# last convs, the residual units' first conv) and the residual units' dilations.
_KERNEL = 7
_DILATIONS = (1, 3, 9)


class Field(NamedTuple):
    """How far back a sample of Code2Wav's waveform reads, and how late it comes out.

    `attention`: frames back over the transformer's layers (each sliding window
    reaches `sliding_window - 1` frames back); `conv`: frames back the ConvNet
    reads from the first sample a chunk voices; `delay`: samples the causal
    transposed convolutions hold back, so a forward over n frames gives
    `n * total_upsample - delay` samples, the waveform of frame i spanning
    samples `i * total_upsample - delay` onwards.
    """

    attention: int
    conv: int
    delay: int

    @property
    def left(self) -> int:
        """Frames of left context that make a chunk exact."""
        return self.attention + self.conv


def chunk_context(config: Mapping[str, Any]) -> ChunkContext | None:
    """The context of the Code2Wav in a checkpoint's config.json (the whole model's
    `code2wav_config`, or a Code2Wav config of its own); None when it has none.

    Left context = the whole receptive field (`Field.left`), no right context
    (causal), no alignment. Qwen3-Omni-30B-A3B: 8 layers x 71 + 10 = 578
    frames, where transformers' `chunked_decode` keeps 25 (its own figure, a
    trade of fidelity for compute; the audio stage runs only the transformer
    over the long part, see code2wav.py).
    """
    c2w = config.get("code2wav_config", config)
    if not isinstance(c2w, Mapping) or "upsample_rates" not in c2w:
        return None
    return ChunkContext(receptive_field(c2w).left, 0, 1)


def receptive_field(config: Any) -> Field:
    """`Field` of a Code2Wav config (a transformers config object or its config.json dict).

    Follows `Qwen3OmniMoeCode2Wav.forward`'s layers back from the first sample a
    chunk voices to the frames the transformer's output there depends on:
    the decoder's last conv, per decoder block (last to first) its residual
    units (kernel 7, dilations 9, 3, 1) and its causal transposed conv
    (kernel 2r, stride r), the first conv, per upsampling stage its ConvNeXt
    block's depthwise conv and its transposed conv (kernel = stride); then
    the transformer's windows. Index arithmetic, exact for every tap.
    """
    ratios = [int(r) for r in _get(config, "upsampling_ratios")]
    rates = [int(r) for r in _get(config, "upsample_rates")]
    window, layers = int(_get(config, "sliding_window")), int(_get(config, "num_hidden_layers"))
    if window < 1 or layers < 0 or min(ratios + rates, default=1) < 1:
        raise ValueError(f"need sliding_window >= 1 and upsampling factors >= 1, got {window}, "
                         f"upsampling_ratios={ratios}, upsample_rates={rates}")
    per_frame = math.prod(ratios + rates)
    delay = _delay(rates)
    frame = 4 * (layers * window + sum(rates) + 100)  # far from the input's start
    lo = frame * per_frame - delay  # the first sample frame `frame` voices
    lo = _conv_back(lo, _KERNEL, 1)  # decoder[-1]
    for rate in reversed(rates):
        for dilation in reversed(_DILATIONS):  # x + conv2(act(conv1(act(x)))), conv2 of kernel 1
            lo = _conv_back(lo, _KERNEL, dilation)
        lo = -(-(lo - rate + 1) // rate)  # transposed conv, kernel 2r, stride r, r trimmed each side
    lo = _conv_back(lo, _KERNEL, 1)  # decoder[0]
    for ratio in reversed(ratios):
        lo = _conv_back(lo, _KERNEL, 1)  # ConvNeXt block's depthwise conv
        lo = lo // ratio  # transposed conv, kernel = stride
    return Field(attention=layers * (window - 1), conv=frame - lo, delay=delay)


def _delay(rates: list[int]) -> int:
    """Samples a forward's waveform falls short of frames x total_upsample: each decoder block's
    transposed conv keeps (n - 1) * r of its n * r samples."""
    short = 0
    for rate in rates:
        short = short * rate + rate
    return short


def _conv_back(lo: int, kernel: int, dilation: int) -> int:
    """First input index a causal Conv1d (left padded by (kernel - 1) * dilation) reads for output lo."""
    return lo - (kernel - 1) * dilation


def _get(config: Any, name: str) -> Any:
    return config[name] if isinstance(config, Mapping) else getattr(config, name)

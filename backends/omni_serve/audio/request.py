"""Requests of the omni_audio stage (runs inside the Triton stub, in the orchestrator and in tests).

`parse_request` turns one request's named input tensors (already numpy) into
an `AudioRequest`, checked against the loaded checkpoint's `AudioLimits`
before any compute. `chunk_plan` is the orchestrator's side of the contract:
how a growing stream of codec tokens is cut into stateless chunk requests
(each carries `context` codes of left context that were already voiced), and
`dit_context_codes` says how much context makes a chunk sound exactly as the
whole utterance would (from the checkpoint's `token2wav_config`).
No torch here, so the orchestrator can import it cheaply.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from omni_serve import fields
from omni_serve.contract import AUDIO
from omni_serve.errors import RequestError
from omni_serve.fields import integer, scalar, text


@dataclass(frozen=True)
class AudioLimits:
    """What a request is checked against; `AudioRunner.limits` fills it from the checkpoint."""

    codec_vocab: int  # codes are ids in [0, codec_vocab)
    speakers: tuple[str, ...]
    default_speaker: str
    max_codec_tokens: int
    # Longest utterance (stream positions 0..n-1) the DiT can place; None: no limit.
    max_utterance_codes: int | None = None


@dataclass(frozen=True, eq=False)
class AudioRequest:
    """One chunk to voice: `codes[:context]` is left context, the last `lookahead` codes are right
    context, the codes between are the ones this request returns audio for.

    `offset` is the stream position of `codes[0]`: the flow-matching noise is
    one draw per (seed, utterance), as transformers draws it, and a chunk gets
    the rows of its positions, so with one seed per stream and true offsets a
    chunk starts from the very noise the whole utterance would.
    Right context lets the DiT's look-ahead layer and BigVGAN see past the
    chunk's end (see `chunk_plan` for what both buy).
    """

    codes: np.ndarray  # int64 [n]
    context: int
    speaker: str
    seed: int
    offset: int = 0
    lookahead: int = 0

    @property
    def new_codes(self) -> int:
        """Codes this request returns audio for."""
        return len(self.codes) - self.context - self.lookahead


def parse_request(tensors: dict[str, np.ndarray | None], limits: AudioLimits) -> AudioRequest:
    """Validate one request's tensors; raises `RequestError` naming the bad field.

    Omitted optional inputs: no left context, the stage's default voice, and a
    random seed (that audio is then not reproducible; streams should send one
    seed for all their chunks).
    """
    codes = _codes(tensors.get(AUDIO.CODEC_TOKENS), limits)

    context = integer(AUDIO.CONTEXT_TOKENS, scalar(tensors, AUDIO.CONTEXT_TOKENS))
    context = 0 if context is None else context
    if not 0 <= context < len(codes):
        raise RequestError(AUDIO.CONTEXT_TOKENS,
                           f"must be between 0 and {len(codes) - 1} (one less than the {len(codes)} "
                           f"{AUDIO.CODEC_TOKENS} sent), got {context}")

    lookahead = integer(AUDIO.LOOKAHEAD_TOKENS, scalar(tensors, AUDIO.LOOKAHEAD_TOKENS)) or 0
    if not 0 <= lookahead < len(codes) - context:
        raise RequestError(AUDIO.LOOKAHEAD_TOKENS,
                           f"must be between 0 and {len(codes) - context - 1} (at least one of the "
                           f"{len(codes)} codes after the {context} context codes must be voiced), "
                           f"got {lookahead}")
    offset = integer(AUDIO.CODE_OFFSET, scalar(tensors, AUDIO.CODE_OFFSET)) or 0
    longest = 2**40 if limits.max_utterance_codes is None else limits.max_utterance_codes
    if not 0 <= offset <= longest - len(codes):
        raise RequestError(AUDIO.CODE_OFFSET,
                           f"must be between 0 and {max(longest - len(codes), 0)} (an utterance has at "
                           f"most {longest} codes and this request sends {len(codes)}), got {offset}")

    speaker = text(AUDIO.SPEAKER, scalar(tensors, AUDIO.SPEAKER))
    speaker = limits.default_speaker if speaker is None else speaker
    if speaker not in limits.speakers:
        raise RequestError(AUDIO.SPEAKER, f"unknown voice {speaker!r}; known voices: "
                                          f"{', '.join(limits.speakers)}")

    seed = fields.seed(tensors, AUDIO.SEED)

    return AudioRequest(codes=codes, context=context, speaker=speaker, seed=seed, offset=offset,
                        lookahead=lookahead)


def _codes(value: np.ndarray | None, limits: AudioLimits) -> np.ndarray:
    name = AUDIO.CODEC_TOKENS
    if value is None:
        raise RequestError(name, "is required")
    arr = np.asarray(value)
    if arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        raise RequestError(name, f"expected shape [n] or [1, n], got {list(arr.shape)}")
    if arr.size == 0:
        raise RequestError(name, "must not be empty")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise RequestError(name, f"must be integers, got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    if arr.size > limits.max_codec_tokens:
        raise RequestError(name, f"at most {limits.max_codec_tokens} codes per request (left context "
                                 f"included), got {arr.size}; send shorter chunks")
    bad = (arr < 0) | (arr >= limits.codec_vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise RequestError(name, f"codes must be in [0, {limits.codec_vocab}), got {int(arr[i])} at "
                                 f"index {i}")
    return arr.astype(np.int64)


# --- streaming: cutting a code stream into chunk requests ---------------------------------

class ChunkSpan(NamedTuple):
    """One chunk request: send `codes[first:last]` with `context_tokens = context`.

    It voices codes `begin..end-1`; `context` codes before them and `lookahead`
    codes after them are sent as context only.
    """

    begin: int  # first code voiced by this chunk
    context: int  # left-context codes sent before `begin`
    end: int  # one past the last code voiced
    lookahead: int = 0  # right-context codes sent after `end`

    @property
    def first(self) -> int:
        """Index of the first code sent (the request's offset in the stream)."""
        return self.begin - self.context

    @property
    def last(self) -> int:
        """One past the last code sent."""
        return self.end + self.lookahead


def chunk_plan(total: int, emitted: int, chunk: int, left_context: int, final: bool, *,
               right_context: int = 0, align: int = 1) -> list[ChunkSpan]:
    """The chunk requests to send now for a stream of `total` codes so far, `emitted` already voiced.

    Full chunks of `chunk` codes while `chunk + right_context` codes are
    waiting; with `final` (the talker finished) the remainder too, the last
    chunk shorter and with what right context is left. Each chunk takes at
    least `left_context` earlier codes as context (fewer at the stream's
    start), extended so that its first code sent is a multiple of `align`.
    Calling it again with `emitted = spans[-1].end` continues the stream;
    over a stream every code is voiced exactly once, in order.

    With the request's true `offset` (same noise) and the three numbers of
    `dit_context_codes` (`left_context`, `right_context`, `align`), every
    chunk sounds as the whole stream decoded at once, within float rounding;
    less context trades fidelity for latency (docs/omni-chat.md has figures).
    """
    if chunk < 1 or left_context < 0 or right_context < 0 or align < 1:
        raise ValueError(f"need chunk >= 1, left_context >= 0, right_context >= 0 and align >= 1; got "
                         f"chunk={chunk}, left_context={left_context}, right_context={right_context}, "
                         f"align={align}")
    if not 0 <= emitted <= total:
        raise ValueError(f"emitted={emitted} must be between 0 and total={total}")
    spans = []
    begin = emitted
    while total - begin >= chunk + right_context or (final and begin < total):
        end = min(begin + chunk, total)
        first = max(0, begin - left_context) // align * align
        spans.append(ChunkSpan(begin, begin - first, end, min(right_context, total - end)))
        begin = end
    return spans


# --- context: what a chunk must carry to sound as the whole utterance ----------------------

class ChunkContext(NamedTuple):
    """`chunk_plan(..., left_context=left, right_context=right, align=align)` arguments."""

    left: int  # codes of left context
    right: int  # codes of right context
    align: int  # the first code sent is a multiple of this (DiT blocks line up with the stream's)


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

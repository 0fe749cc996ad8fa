"""Requests of the omni_audio stage (runs inside the Triton stub, in the orchestrator and in tests).

`parse_request` turns one request's named input tensors (already numpy) into
an `AudioRequest`, checked against the loaded checkpoint's `AudioLimits`
before any compute. Codes are frames: `[frames, groups]`, one code per
codebook a frame (the family's `CodecDecoder.codec_groups`). `chunk_plan` is
the orchestrator's side of the contract: how a growing stream of frames is
cut into stateless chunk requests (each carries `context` frames of left
context that were already voiced); the family's decoder says how much
context makes a chunk sound exactly as the whole utterance would
(`ChunkContext`, from the checkpoint's config.json).
No torch here, so the orchestrator can import it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from omni_serve import fields
from omni_serve.contract import AUDIO
from omni_serve.errors import RequestError
from omni_serve.fields import integer, scalar, text


@dataclass(frozen=True)
class AudioLimits:
    """What a request is checked against; `AudioRunner.limits` fills it from the checkpoint."""

    codec_vocab: int  # codes are ids in [0, codec_vocab)
    voices: tuple[str, ...]  # () for a decoder without voices
    default_voice: str | None
    max_codec_tokens: int  # frames per request
    # Longest utterance (stream positions 0..n-1) the decoder can place; None: no limit.
    max_utterance_codes: int | None = None
    codec_groups: int = 1  # codes per frame


@dataclass(frozen=True, eq=False)
class AudioRequest:
    """One chunk to voice: `codes[:context]` is left context, the last `lookahead` frames are right
    context, the frames between are the ones this request returns audio for.

    `offset` is the stream position of `codes[0]`: a decoder that samples
    (flow matching) draws one noise per (seed, utterance) and gives a chunk
    the rows of its positions (omni_serve.audio.noise), so with one seed per
    stream and true offsets a chunk starts from the very noise the whole
    utterance would. Right context lets a decoder that looks ahead see past
    the chunk's end (see `chunk_plan`).
    """

    codes: np.ndarray  # int64 [frames, groups]
    context: int
    voice: str | None  # None: the decoder has no voices
    seed: int
    offset: int = 0
    lookahead: int = 0

    @property
    def new_codes(self) -> int:
        """Frames this request returns audio for."""
        return len(self.codes) - self.context - self.lookahead


def parse_request(tensors: dict[str, np.ndarray | None], limits: AudioLimits) -> AudioRequest:
    """Validate one request's tensors; raises `RequestError` naming the bad field.

    Omitted optional inputs: no left context, the stage's default voice, and a
    random seed (that audio is then not reproducible; streams should send one
    seed for all their chunks). A decoder without voices refuses a `voice`.
    """
    codes = _codes(tensors.get(AUDIO.CODEC_IDS), limits)

    context = integer(AUDIO.CONTEXT_TOKENS, scalar(tensors, AUDIO.CONTEXT_TOKENS))
    context = 0 if context is None else context
    if not 0 <= context < len(codes):
        raise RequestError(AUDIO.CONTEXT_TOKENS,
                           f"must be between 0 and {len(codes) - 1} (one less than the {len(codes)} "
                           f"{AUDIO.CODEC_IDS} frames sent), got {context}")

    lookahead = integer(AUDIO.LOOKAHEAD_TOKENS, scalar(tensors, AUDIO.LOOKAHEAD_TOKENS)) or 0
    if not 0 <= lookahead < len(codes) - context:
        raise RequestError(AUDIO.LOOKAHEAD_TOKENS,
                           f"must be between 0 and {len(codes) - context - 1} (at least one of the "
                           f"{len(codes)} frames after the {context} context frames must be voiced), "
                           f"got {lookahead}")
    offset = integer(AUDIO.CODE_OFFSET, scalar(tensors, AUDIO.CODE_OFFSET)) or 0
    longest = 2**40 if limits.max_utterance_codes is None else limits.max_utterance_codes
    if not 0 <= offset <= longest - len(codes):
        raise RequestError(AUDIO.CODE_OFFSET,
                           f"must be between 0 and {max(longest - len(codes), 0)} (an utterance has at "
                           f"most {longest} frames and this request sends {len(codes)}), got {offset}")

    voice = text(AUDIO.VOICE, scalar(tensors, AUDIO.VOICE))
    if not limits.voices:
        if voice is not None:
            raise RequestError(AUDIO.VOICE, "this decoder has no voices (its talker speaks "
                                            "them): send none")
    else:
        voice = limits.default_voice if voice is None else voice
        if voice not in limits.voices:
            raise RequestError(AUDIO.VOICE, f"unknown voice {voice!r}; known voices: "
                                            f"{', '.join(limits.voices)}")

    seed = fields.seed(tensors, AUDIO.SEED)

    return AudioRequest(codes=codes, context=context, voice=voice, seed=seed, offset=offset,
                        lookahead=lookahead)


def _codes(value: np.ndarray | None, limits: AudioLimits) -> np.ndarray:
    """int64 [frames, groups] of `codec_ids` sent as [frames, groups] or, with the batch
    dimension, [1, frames, groups]."""
    name, groups = AUDIO.CODEC_IDS, limits.codec_groups
    if value is None:
        raise RequestError(name, "is required")
    arr = np.asarray(value)
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[1] != groups:
        raise RequestError(name, f"expected shape [frames, {groups}] ({groups} code"
                                 f"{'s' if groups > 1 else ''} a frame), got {list(np.shape(value))}")
    if arr.size == 0:
        raise RequestError(name, "must not be empty")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise RequestError(name, f"must be integers, got dtype {arr.dtype}")
    if len(arr) > limits.max_codec_tokens:
        raise RequestError(name, f"at most {limits.max_codec_tokens} frames per request (left "
                                 f"context included), got {len(arr)}; send shorter chunks")
    bad = (arr < 0) | (arr >= limits.codec_vocab)
    if bad.any():
        frame, group = (int(i) for i in np.argwhere(bad)[0])
        where = f"frame {frame}" + (f", group {group}" if groups > 1 else "")
        raise RequestError(name, f"codes must be in [0, {limits.codec_vocab}), got "
                                 f"{int(arr[frame, group])} at {where}")
    return arr.astype(np.int64)


# --- streaming: cutting a code stream into chunk requests ---------------------------------

class ChunkSpan(NamedTuple):
    """One chunk request: send frames `first:last` with `context_tokens = context`.

    It voices frames `begin..end-1`; `context` frames before them and
    `lookahead` frames after them are sent as context only.
    """

    begin: int  # first frame voiced by this chunk
    context: int  # left-context frames sent before `begin`
    end: int  # one past the last frame voiced
    lookahead: int = 0  # right-context frames sent after `end`

    @property
    def first(self) -> int:
        """Index of the first frame sent (the request's offset in the stream)."""
        return self.begin - self.context

    @property
    def last(self) -> int:
        """One past the last frame sent."""
        return self.end + self.lookahead


def chunk_plan(total: int, emitted: int, chunk: int, left_context: int, final: bool, *,
               right_context: int = 0, align: int = 1) -> list[ChunkSpan]:
    """The chunk requests to send now for a stream of `total` frames so far, `emitted` already voiced.

    Full chunks of `chunk` frames while `chunk + right_context` frames are
    waiting; with `final` (the talker finished) the remainder too, the last
    chunk shorter and with what right context is left. Each chunk takes at
    least `left_context` earlier frames as context (fewer at the stream's
    start), extended so that its first frame sent is a multiple of `align`.
    Calling it again with `emitted = spans[-1].end` continues the stream;
    over a stream every frame is voiced exactly once, in order.

    With the request's true `offset` (same noise) and the three numbers of
    the decoder's `ChunkContext` (`left_context`, `right_context`, `align`),
    every chunk sounds as the whole stream decoded at once, within float
    rounding; less context trades fidelity for latency (docs/omni-chat.md has
    figures).
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
    """`chunk_plan(..., left_context=left, right_context=right, align=align)` arguments: what the
    family's codec decoder needs around a chunk (`CodecDecoder.context`,
    `Family.decoder_context`); a causal decoder needs left context only."""

    left: int  # frames of left context
    right: int  # frames of right context
    align: int = 1  # the first frame sent is a multiple of this (e.g. a decoder's attention blocks)

"""Requests of the omni_audio stage (runs inside the Triton stub, in the orchestrator and in tests).

`parse_request` turns one request's named input tensors (already numpy) into
an `AudioRequest`, checked against the loaded checkpoint's `AudioLimits`
before any compute. `chunk_plan` is the orchestrator's side of the contract:
how a growing stream of codec tokens is cut into stateless chunk requests
(each carries `context` codes of left context that were already voiced).
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
    speakers: tuple[str, ...]
    default_speaker: str
    max_codec_tokens: int


@dataclass(frozen=True, eq=False)
class AudioRequest:
    """One chunk to voice: `codes[:context]` is left context, the last `lookahead` codes are right
    context, the codes between are the ones this request returns audio for.

    `offset` is the stream position of `codes[0]`: the flow-matching noise of a
    code is drawn from (seed, position), so with one seed per stream and true
    offsets a chunk starts from the very noise the whole utterance would.
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
    if not 0 <= offset <= 2**40:
        raise RequestError(AUDIO.CODE_OFFSET, f"must be between 0 and {2**40}, got {offset}")

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

    How close the concatenated chunks come to decoding the whole stream at
    once (Qwen2.5-Omni's DiT attends within blocks of `block_size` mel frames,
    one layer one block back and one layer one block ahead): it needs the
    request's true `offset` (same noise), `right_context` of at least one
    block's worth of codes (block_size / repeats = 12 for the real model) and
    block-aligned left context (`align` = 12); see the omni_audio report.
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

"""The first audio chunk's size, from how fast speech is being made (orchestrator process).

A streamed reply's first chunk must play for as long as the second one takes to
make (its `chunk_codes` talker steps, then its decoder call), or the listener
hears a gap. `first_chunk_codes` is sized for a loaded server; on a lighter one a
smaller first chunk covers that already, and its audio comes sooner.

`SpeechPace` (one per orchestrator instance, shared by its requests) keeps what
the decoder calls measured: their time, queueing included, and the audio seconds
a code makes. `FirstChunk` (one per streamed reply) follows the reply's talker
frames and says the first chunk's size: the smallest of at least
`min_first_chunk_codes` that plays for `first_chunk_margin` times the second
chunk's making at the pace measured so far, else `first_chunk_codes`. Until a
decoder call has been measured, and while more than `first_chunk_pace_replies`
replies are being spoken on this instance, it is `first_chunk_codes`: when many
replies start together, a reply's first frames are made before the others'
talkers join, so their pace promises more than the talker then keeps.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class SpeechPace:
    """Decoder calls as this orchestrator instance saw them (event loop only, no locks)."""

    weight: float = 0.5  # of the newest call in the running mean
    decode_s: float | None = None  # a decoder call's seconds, queue included (running mean)
    code_audio_s: float | None = None  # seconds of audio one talker step voices
    replies: int = 0  # speech replies in flight (their thinker or talker running)

    @contextlib.contextmanager
    def speaking(self) -> Iterator[None]:
        """Count one speech reply in flight while the block runs."""
        self.replies += 1
        try:
            yield
        finally:
            self.replies -= 1

    def decoded(self, seconds: float, codes: int, audio_s: float) -> None:
        """A decoder call took `seconds` and voiced `codes` talker steps as `audio_s` of audio."""
        self.decode_s = seconds if self.decode_s is None else (
            self.weight * seconds + (1 - self.weight) * self.decode_s)
        if codes > 0 and audio_s > 0:
            self.code_audio_s = audio_s / codes


class FirstChunk:
    """One reply's first chunk size, asked once per talker frame until the chunk goes."""

    def __init__(self, pace: SpeechPace, *, least: int, most: int, next_codes: int,
                 right_context: int, margin: float, max_replies: int):
        self.pace, self.least, self.most = pace, min(least, most), most
        self.next_codes, self.right_context, self.margin = next_codes, right_context, margin
        self.max_replies = max_replies
        self.first_frame: float | None = None
        self.step_s: float | None = None  # the talker's seconds per frame so far

    def size(self, frames: int, now: float | None = None) -> int:
        """The first chunk's size with `frames` talker frames made (the newest just now):
        what is there minus the right context, when that is at least `least` and plays long
        enough; `most` otherwise (the decoder chunking waits for it)."""
        now = time.perf_counter() if now is None else now
        if self.first_frame is None:
            self.first_frame = now
        if frames > 1:
            self.step_s = (now - self.first_frame) / (frames - 1)
        ready = frames - self.right_context
        pace = self.pace
        if (ready < self.least or ready >= self.most or self.step_s is None
                or pace.decode_s is None or pace.code_audio_s is None
                or pace.replies > self.max_replies):
            return self.most
        making_s = self.next_codes * self.step_s + pace.decode_s
        return ready if ready * pace.code_audio_s >= self.margin * making_s else self.most

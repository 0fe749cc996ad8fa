"""Decoder chunk sizes, from how fast speech is being made (orchestrator process).

A streamed reply's next chunk must be back before the audio already sent has
played, or the listener hears a gap. `first_chunk_codes` and `chunk_codes` are
sized for a loaded server; on a lighter one smaller chunks cover that already,
and the first audio comes sooner.

`SpeechPace` (one per orchestrator instance, shared by its requests) keeps what
the decoder calls measured: their time, queueing included, and the audio seconds
a code makes. `ChunkSizes` (one per streamed reply) follows the reply's talker
frames (s seconds each so far), and with a audio seconds per frame, d seconds
per decoder call and the margin m, a chunk ending at frame E must be back while
the first E_1 frames' audio plays: (E - E_1) s + d <= E_prev a / m.

- The first chunk: the fewest frames E_1 of at least `min_first_chunk_codes`
  after which a second chunk of `min_chunk_codes` (unset: `chunk_codes`) meets
  that, else `first_chunk_codes`.
- The later ones, after a first chunk sized so: the most that meet it, between
  `min_chunk_codes` and `chunk_codes`; they grow as the audio ahead does, which
  needs a talker faster than real time by the margin (a > m s), so a smaller
  second chunk is only planned on one. Otherwise they are `chunk_codes`.

Until a decoder call has been measured, and while more than
`first_chunk_pace_replies` replies are being spoken on this instance, the sizes
are `first_chunk_codes` and `chunk_codes`: when many replies start together, a
reply's first frames are made before the others' talkers join, so their pace
promises more than the talker then keeps.
"""
from __future__ import annotations

import contextlib
import math
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


class ChunkSizes:
    """One reply's decoder chunk sizes, asked once per talker frame until its chunks go."""

    def __init__(self, pace: SpeechPace, *, least: int, most: int, next_least: int,
                 next_most: int, right_context: int, margin: float, max_replies: int):
        self.pace, self.least, self.most = pace, min(least, most), most
        self.next_least, self.next_most = min(next_least, next_most), next_most
        self.right_context, self.margin, self.max_replies = right_context, margin, max_replies
        self.first_frame: float | None = None
        self.step_s: float | None = None  # the talker's seconds per frame so far
        self.first_end: int | None = None  # the frames the first chunk voiced, once it went
        self.first_paced = False  # the last first-chunk size asked was sized from the pace

    def size(self, frames: int, done: int, now: float | None = None) -> int:
        """The next chunk's size with `frames` talker frames made (the newest just now) and
        the first `done` voiced: for the first, what is there minus the right context when
        that is sized from the pace, `most` otherwise (the decoder chunking waits for it)."""
        now = time.perf_counter() if now is None else now
        if self.first_frame is None:
            self.first_frame = now
        if frames > 1:
            self.step_s = (now - self.first_frame) / (frames - 1)
        if done == 0:
            ready = frames - self.right_context
            self.first_paced = self.least <= ready < self.most and self._paced() and \
                self._ahead(ready, ready) - ready >= self.next_least
            return ready if self.first_paced else self.most
        if self.first_end is None:
            self.first_end = done  # asked first just after the first chunk went
        if not self.first_paced or not self._paced():
            return self.next_most
        return max(self.next_least, min(self.next_most, self._ahead(done, self.first_end) - done))

    def _paced(self) -> bool:
        pace = self.pace
        if self.step_s is None or not self.step_s > 0 or pace.decode_s is None \
                or pace.code_audio_s is None or pace.replies > self.max_replies:
            return False
        # later chunks smaller than next_most grow only on a talker faster than real time
        return self.next_least >= self.next_most or \
            pace.code_audio_s > self.margin * self.step_s

    def _ahead(self, played: int, first_end: int) -> int:
        """The last frame a chunk may end at to be back before `played` frames' audio has
        played, the first chunk having voiced `first_end`."""
        pace = self.pace
        made_s = played * pace.code_audio_s / self.margin - pace.decode_s
        return first_end + math.floor(made_s / self.step_s)

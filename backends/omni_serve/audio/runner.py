"""The omni_audio runner: codec frames -> waveform (runs inside the Triton stub and in tests).

Flow: Triton's dynamic batcher hands the adapter a list of parsed
`AudioRequest`s (codes [frames, groups], their left and right context, voice,
seed, stream offset); `AudioRunner.run` groups them by `group_key` (same
number of frames and the same decoder `batch_key`), runs each group through
the checkpoint family's codec decoder in one call (omni_serve.families:
`CodecDecoder`, e.g. families/<family>/token2wav.py) and cuts off the audio of
the context frames. It returns one float32 mono waveform in [-1, 1] or one
exception per request, in request order; a group whose call fails is retried
one request at a time, so a bad request fails alone.

The model family comes from the checkpoint folder's config.json
(`families.for_checkpoint`); the decoder loads its part of the folder and says
what requests may hold (`AudioLimits`: codec vocabulary, codes per frame,
voices, the longest utterance) and what a chunk needs around it (`context`).
Groups hold equal lengths rather than padded ones: a decoder need not mask
padding, and a padded request would not sound the same as alone.
"""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Hashable
from pathlib import Path

import numpy as np
import torch

from omni_serve import families
from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.request import AudioLimits, AudioRequest, ChunkContext
from omni_serve.batching import run_grouped
from omni_serve.families import CodecDecoder
from omni_serve.torch_setup import configure_torch

logger = logging.getLogger(__name__)


def load_decoder(cfg: AudioStageConfig) -> CodecDecoder:
    """The codec decoder of the checkpoint family of `cfg.model`.

    Raises:
        ValueError: the folder is not a family's, or its family has no audio decoder.
    """
    family = families.for_checkpoint(str(Path(cfg.model)))
    if family.decoder is None:
        raise ValueError(f"{cfg.model}: model family {family.name!r} ({family.title}) has no audio "
                         "decoder")
    return families.load(family.decoder).load(cfg)


class AudioRunner:
    """Owns one codec decoder; `run` is safe to call from several threads."""

    def __init__(self, cfg: AudioStageConfig):
        self.cfg = cfg
        configure_torch(cfg.torch_threads, cfg.device, cfg.dtype)
        self.decoder = load_decoder(cfg)
        self._lock = threading.Lock()
        decoder = self.decoder
        longest = decoder.max_frames
        if longest is not None and cfg.max_codec_tokens > longest:
            raise ValueError(f"max_codec_tokens={cfg.max_codec_tokens} exceeds the {longest} frames "
                             f"the decoder of {cfg.model} can place in one utterance; set "
                             f"max_codec_tokens <= {longest}")
        default = cfg.default_voice or decoder.default_voice
        if not decoder.voices:
            if cfg.default_voice is not None:
                raise ValueError(f"default_voice={cfg.default_voice!r}, but the decoder of "
                                 f"{cfg.model} has no voices: leave it out")
        elif default not in decoder.voices:
            raise ValueError(f"default_voice={default!r} is not a voice of {cfg.model}; known voices: "
                             f"{', '.join(decoder.voices)}")
        self.limits = AudioLimits(codec_vocab=decoder.codec_vocab, voices=tuple(decoder.voices),
                                  default_voice=default if decoder.voices else None,
                                  max_codec_tokens=cfg.max_codec_tokens, max_utterance_codes=longest,
                                  codec_groups=decoder.codec_groups)

    @property
    def sample_rate(self) -> int:
        return self.decoder.sample_rate

    @property
    def samples_per_code(self) -> int:
        """Waveform samples per codec frame."""
        return self.decoder.samples_per_frame

    @property
    def context(self) -> ChunkContext:
        """What a chunk needs around it to sound as the whole utterance (chunk_plan's arguments)."""
        return self.decoder.context

    def group_key(self, req: AudioRequest) -> tuple[int, Hashable]:
        """Requests with equal keys run in one decoder call."""
        return len(req.codes), self.decoder.batch_key(req)

    def run(self, requests: list[AudioRequest]) -> list[np.ndarray | Exception]:
        """Per request, float32 [new_codes * samples_per_code] audio or the exception it raised, in
        order; the utterance's first chunk (voiced from stream frame 0) without the decoder's
        `lead_samples`, where it has any (a causal decoder's delay: its stream then starts
        where its reference's waveform does)."""
        results: list[np.ndarray | Exception | None] = [None] * len(requests)
        todo = []
        for i, req in enumerate(requests):
            if req.new_codes < 1:
                results[i] = ValueError(f"{len(req.codes)} frames with {req.context} of left and "
                                        f"{req.lookahead} of right context leave nothing to voice")
            else:
                todo.append(i)
        outs = run_grouped([requests[i] for i in todo], self.group_key, self._decode,
                           label="omni_audio")
        for i, out in zip(todo, outs, strict=True):
            results[i] = out
        return results  # type: ignore[return-value]  # every slot is filled above

    def _decode(self, group: list[AudioRequest]) -> list[np.ndarray]:
        """One decoder call for requests with equal `group_key`s; the voiced frames' audio of each."""
        with self._lock, torch.inference_mode():
            wave = self.decoder.decode(group)
        frames, spc = len(group[0].codes), self.samples_per_code
        if wave.shape != (len(group), frames * spc):
            raise RuntimeError(f"the decoder returned {list(wave.shape)} samples for {len(group)} "
                               f"requests of {frames} frames, expected {[len(group), frames * spc]}")
        lead = getattr(self.decoder, "lead_samples", 0)
        return [np.ascontiguousarray(w[r.context * spc + (lead if r.offset + r.context == 0 else 0):
                                       (r.context + r.new_codes) * spc])
                for w, r in zip(wave, group, strict=True)]


def real_time_factor(compute_seconds: float, samples: int, sample_rate: int) -> float:
    """Compute time over audio time (below 1: faster than real time)."""
    return compute_seconds / (samples / sample_rate) if samples else math.inf

"""The omni_encoder runner: media bytes -> what the thinker engine takes (Triton stub, tests).

Flow: Triton's dynamic batcher hands the adapter a list of requests, one
media item each. `EncoderRunner.run` decodes every item on its own
(omni_serve.encoder.media: a PIL RGB image, or float32 mono samples at the
stage's rate; a bad one gets its own RequestError), has the checkpoint
family's encoder prepare it (its processor), then encodes the good ones in
one call (images: one tower forward, rows split back per item; audio: the
features themselves for families whose thinker engine runs the audio tower)
and retries one by one if that call fails.

The model family comes from the checkpoint folder's config.json
(`families.for_checkpoint`); its `MediaEncoder` for the stage's modality
loads only its part of the folder and counts each item's prompt tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_serve import families
from omni_serve.batching import isolate
from omni_serve.encoder.config import EncoderStageConfig
from omni_serve.encoder.media import decode_audio, decode_image
from omni_serve.families import MediaEncoder
from omni_serve.torch_setup import configure_torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderOutput:
    """One media item, as the thinker engine takes it; `tokens` of the prompt stand for it."""

    tokens: int
    embeddings: np.ndarray | None = None  # images: (tokens, hidden) float32
    grid_thw: np.ndarray | None = None  # images: int64 (3,) patch grid (t, h, w) before merging
    features: np.ndarray | None = None  # audio: (mel bins, frames) float32


def load_encoder(cfg: EncoderStageConfig) -> MediaEncoder:
    """The `cfg.modality` encoder of the checkpoint family of `cfg.model`.

    Raises:
        ValueError: the folder is not a family's, or its family has no encoders for it.
    """
    family = families.for_checkpoint(cfg.model)
    if family.encoders is None:
        raise ValueError(f"{cfg.model}: model family {family.name!r} ({family.title}) has no media "
                         "encoders")
    return families.load(family.encoders)(cfg)


class EncoderRunner:
    """Owns the family's encoder of one modality (e.g. a vision tower and its image processor)."""

    def __init__(self, cfg: EncoderStageConfig):
        self.cfg = cfg
        self.modality = cfg.modality
        configure_torch(cfg.torch_threads, cfg.device, cfg.dtype)
        self.encoder = load_encoder(cfg)

    def run(self, items: list[bytes]) -> list[EncoderOutput | Exception]:
        """One EncoderOutput or the exception that item raised, per item, in order."""
        prepared: list[Any] = []
        for data in items:
            try:
                prepared.append(self._prepare(data))
            except Exception as e:  # a bad item answers alone
                prepared.append(e)
        good = [p for p in prepared if not isinstance(p, Exception)]
        outputs = iter(isolate(self._encode, good, label="omni_encoder")) if good else iter(())
        return [p if isinstance(p, Exception) else next(outputs) for p in prepared]

    def _prepare(self, data: bytes) -> Any:
        media = decode_image(data, self.cfg) if self.modality == "image" else decode_audio(data, self.cfg)
        return self.encoder.prepare(media)

    def _encode(self, group: list[Any]) -> list[EncoderOutput]:
        with torch.inference_mode():
            return self.encoder.encode(group)

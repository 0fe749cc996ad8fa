"""Qwen2.5-Omni's media-token accounting: prompt tokens per image and per audio clip (any process).

Plain arithmetic on shapes, no model: the encoder stage reports each item's
tokens with it, and the thinker stage refuses media that would give the
engine nothing to place (omni_serve.llm.media).
"""
from __future__ import annotations

from collections.abc import Sequence


class Qwen25OmniMediaTokens:
    def image_tokens(self, grid_thw: Sequence[int], merge: int) -> int:
        """The vision tower's rows after merging `merge` x `merge` patches (Python ints: no overflow)."""
        t, h, w = (int(n) for n in grid_thw)
        return t * h * w // merge**2

    def audio_tokens(self, frames: int) -> int:
        """The audio tower's two stride-2 steps (its conv, then its pooling), as transformers'
        `_get_feat_extract_output_lengths` and vLLM's `_compute_audio_token_count`: 25 a second."""
        after_conv = (frames - 1) // 2 + 1
        return (after_conv - 2) // 2 + 1

"""Qwen3-Omni's video sampling: what its processor takes of a clip (plain values, any process).

transformers' Qwen3OmniMoeProcessor runs Qwen2VLVideoProcessor (patch 16 from the checkpoint's
preprocessor_config.json, merge 2, temporal patch 2, 4 to 768 frames) with its own size
default, 128 to 768 merged patches of 32x32 pixels a frame; its video positions assume 1 frame
a second when the caller passes no `fps` (second_per_grid = 2 / 1.0).
"""
from __future__ import annotations

from omni_serve.encoder.video import VideoSampling

VIDEO_SAMPLING = VideoSampling(fps=1.0, patch=16, min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32)

"""Qwen2.5-Omni's video sampling: what its processor takes of a clip (plain values, any process).

transformers' Qwen2_5OmniProcessor runs Qwen2VLVideoProcessor (patch 14, merge 2, temporal
patch 2, 4 to 768 frames) with its own size default, 128 to 768 merged patches of 28x28 pixels
a frame, whatever the checkpoint's preprocessor_config.json says; its video positions assume
2 frames a second when the caller passes no `fps` (second_per_grid = 2 / 2.0).
"""
from __future__ import annotations

from omni_serve.encoder.video import VideoSampling

VIDEO_SAMPLING = VideoSampling(fps=2.0, patch=14, min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)

"""The shapes of the media a thinker takes raw, for its talker's positions.

Runs in the orchestrator's stub. A thinker's own vLLM processor turns a raw image or sound
file into its tokens (Qwen3-Omni's always, Qwen2.5-Omni's beside a video); the talker's
M-RoPE positions need the same shapes (an image's patch grid `image_grid_thw`, a clip's
mel frames `audio_feature_lengths`), which the thinker does not return. They come from the
checkpoint's own processor (Qwen3OmniMoeProcessor, Qwen2_5OmniProcessor: the one vLLM runs)
on the same decoded media, each clip alone, so they are the thinker's by construction. The
media are decoded within the encoder stage's limits (omni_serve.encoder.media), as the thinker
decodes them.

A clip of `n` samples at 16 kHz gets `n // 160` mel frames from Qwen3OmniMoeProcessor (it
pads clips to the longest only) and `ceil(n / 160)` from Qwen2_5OmniProcessor (it pads every
clip to 300 s). The thinkers count the same: Qwen2.5-Omni's vLLM processor runs its processor
as it is; vLLM 0.32's own Qwen3-Omni processor would make `ceil(n / 160)`, so the family's
thinker has its own (qwen3_omni_moe/thinker_processor.py: transformers' frames, each clip
processed alone as here).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from omni_serve.contract import LLM
from omni_serve.encoder import media as media_files
from omni_serve.encoder.config import MediaLimits, VideoLimits


class ProcessorMediaShapes:
    def __init__(self, folder: str, video_limits: VideoLimits | None = None):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(folder)
        rate = int(getattr(self.processor.feature_extractor, "sampling_rate", 16000))
        # a clip's soundtrack within the pipeline's video limits, as the thinker reads it
        self.limits = MediaLimits(sample_rate=rate).with_video(video_limits)

    def _processed(self, token: str, **media: Any) -> Any:
        return self.processor(text=token, return_tensors="np", **media)

    def shapes(self, kind: str, data: bytes) -> dict[str, np.ndarray]:
        """{image_grid_thw: [1, 3]} of an image file, {audio_feature_lengths: [1]} of a sound
        file (RequestError("media", ...) for one the thinker would refuse as well)."""
        if kind == "image":
            image = media_files.decode_image(data, self.limits)
            grid = self._processed(self.processor.image_token, images=[image])["image_grid_thw"]
            return {LLM.IMAGE_GRID_THW: np.asarray(grid, dtype=np.int64).reshape(1, 3)}
        return self._audio_lengths(media_files.decode_audio(data, self.limits))

    def _audio_lengths(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        mask = self._processed(self.processor.audio_token, audio=[samples])["feature_attention_mask"]
        return {LLM.AUDIO_FEATURE_LENGTHS: np.asarray(mask, dtype=np.int64).sum(-1).reshape(1)}

    def use_audio_in_video(self) -> bool:
        """The processor's `use_audio_in_video` default (its kwargs defaults, merged with the
        checkpoint's processor and tokenizer settings as a call without it merges them)."""
        merged = self.processor._merge_kwargs(self.processor.valid_processor_kwargs,
                                              tokenizer_init_kwargs=self.processor.tokenizer.init_kwargs)
        return bool(merged["videos_kwargs"].get("use_audio_in_video", False))

    def soundtrack_lengths(self, data: bytes) -> dict[str, np.ndarray]:
        """{audio_feature_lengths: [1]} of the video file's soundtrack, decoded as the
        thinker decodes it (RequestError("video", ...) for a file without sound)."""
        from omni_serve.encoder.video import decode_soundtrack

        return self._audio_lengths(decode_soundtrack(data, self.limits))


def load(folder: str, video_limits: VideoLimits | None = None) -> ProcessorMediaShapes:
    return ProcessorMediaShapes(folder, video_limits)

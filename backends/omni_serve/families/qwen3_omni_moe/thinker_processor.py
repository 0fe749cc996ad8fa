"""vLLM's Qwen3-Omni multimodal processor, with the audio feature frames transformers makes.

Runs where vLLM processes a prompt (the omni_llm stub's engine client); `thinker.py` registers
it for `Qwen3OmniThinker`. Everything is vLLM's processor but how a sound becomes feature
frames, which is transformers' (Qwen3OmniMoeProcessor, the one the orchestrator reads the
talker's `audio_feature_lengths` with: processor_media_shapes.py):

- transformers' WhisperFeatureExtractor (padding to the longest clip, no truncation) makes
  `n // hop_length` frames of a clip of `n` samples (hop 160 at 16 kHz: one a 10 ms);
- vLLM 0.32's processor pads each clip with zeros to a whole number of hops first, and sets
  the lengths from the padded clip: `ceil(n / hop_length)` frames, one more wherever `n` is
  not a multiple of 160 (1.2345 s: 124 frames where transformers makes 123). The audio tower
  then sees a frame transformers' does not, and the clip's token count can differ as well
  (1.0045 s: 101 frames, 14 audio tokens; transformers 100 frames, 13 tokens).

What this processor does instead: no padding, and each clip's frames are those of
transformers' processor on that clip alone. With one clip in a prompt that is the HF
processor's own output. With several, the HF processor pads them to the longest, and its
attention mask then gives a shorter clip of an odd length `ceil` frames (its last frame read
over the zeros after it) where the same clip alone gets `floor`; vLLM's processor cache keeps
each clip's frames across prompts, so a clip's frames must not depend on the clips beside
it (vLLM's hop padding is there for the same reason): every clip of a multi-clip prompt is
processed alone, as a one-clip prompt is.

One more thing vLLM's processor cache gets wrong, with `use_audio_in_video`: a video's
prompt update (its frames' and its sound's tokens, interleaved) is cached under its frames'
hash alone, so a clip with the same frames and another soundtrack got the first one's sound
token count. Here a heard video's hash is its frames' and its sound's (`_get_mm_hashes`).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import BatchFeature
from vllm.inputs import MultiModalHashes
from vllm.model_executor.models.qwen2_5_omni_thinker import (
    Qwen2_5OmniThinkerMultiModalProcessor,
)
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerDummyInputsBuilder,
    Qwen3OmniMoeThinkerMultiModalProcessor,
    Qwen3OmniMoeThinkerProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.processing.inputs import ProcessorInputs

# the HF processor's kwargs that name a video, not a clip (a clip alone has no video)
_VIDEO_ONLY_KWARGS = ("use_audio_in_video",)


class Qwen3OmniThinkerProcessor(Qwen3OmniMoeThinkerMultiModalProcessor):
    # Qwen3's override pads every clip to a whole number of hops; Qwen2.5-Omni's (its base)
    # passes the clips as they are
    _get_hf_mm_inputs = Qwen2_5OmniThinkerMultiModalProcessor._get_hf_mm_inputs

    def _call_hf_processor(self, hf_data: Mapping[str, object],
                           hf_kwargs: Mapping[str, object]) -> BatchFeature:
        out = super()._call_hf_processor(hf_data, hf_kwargs)
        clips = hf_data.get("audio") or []
        if len(clips) < 2:
            return out
        alone_kwargs = {k: v for k, v in hf_kwargs.items() if k not in _VIDEO_ONLY_KWARGS}
        token = self.info.get_hf_processor().audio_token
        alone = [super(Qwen3OmniThinkerProcessor, self)._call_hf_processor(
            {"text": token, "audio": [clip]}, alone_kwargs) for clip in clips]
        frames = [int(a["feature_attention_mask"].sum()) for a in alone]
        bins = alone[0]["input_features"].shape[1]
        features = torch.zeros(len(clips), bins, max(frames), dtype=out["input_features"].dtype)
        mask = torch.zeros(len(clips), max(frames), dtype=out["feature_attention_mask"].dtype)
        for i, (a, n) in enumerate(zip(alone, frames)):
            features[i, :, :n] = torch.as_tensor(a["input_features"][0, :, :n])
            mask[i, :n] = 1
        out["input_features"], out["feature_attention_mask"] = features, mask
        return out

    def _get_mm_hashes(self, inputs: ProcessorInputs) -> MultiModalHashes:
        """vLLM's item hashes, but with `use_audio_in_video` a video's is its frames' and its
        sound's: its prompt update holds its sound's token count (the two interleaved), and
        vLLM's processor cache would give a clip with the same frames and another sound the
        other sound's count (an AAC and a PCM track of the same 3 s clip: 40 and 39 tokens,
        and another reply)."""
        hashes = super()._get_mm_hashes(inputs)
        videos, sounds = hashes.get("video", []), hashes.get("audio", [])
        if not inputs.hf_processor_mm_kwargs.get("use_audio_in_video") or not videos \
                or len(sounds) != len(videos):  # vLLM refuses the latter itself
            return hashes
        algorithm = self.info.ctx.get_mm_config().mm_hasher_algorithm
        return {**hashes, "video": [MultiModalHasher.hash_kwargs(algorithm, video=v, sound=a)
                                    for v, a in zip(videos, sounds)]}

    def _postprocess_hf_mm_data(self, mm_data: Mapping[str, object],
                                hf_processor_mm_kwargs: Mapping[str, object],
                                processed_data: BatchFeature) -> BatchFeature:
        # Qwen3's override sets each clip's frames from its (padded) sample count; Qwen2.5's
        # takes the HF processor's attention mask, which counts transformers' frames
        return Qwen2_5OmniThinkerMultiModalProcessor._postprocess_hf_mm_data(
            self, mm_data, hf_processor_mm_kwargs, processed_data)


def register(model_cls: type) -> type:
    """Class decorator: `model_cls` processes its prompts with Qwen3OmniThinkerProcessor
    (vLLM's processing info and dummy inputs)."""
    return MULTIMODAL_REGISTRY.register_processor(
        Qwen3OmniThinkerProcessor, info=Qwen3OmniMoeThinkerProcessingInfo,
        dummy_inputs=Qwen3OmniMoeThinkerDummyInputsBuilder)(model_cls)

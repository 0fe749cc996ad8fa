"""vLLM's own Qwen2.5-Omni thinker, fed image embeddings the encoder stage computed.

Runs in vLLM's worker process: `vllm_models.register` (a vllm.general_plugins
entry point) maps the checkpoint architectures `Qwen2_5OmniModel` and
`Qwen2_5OmniForConditionalGeneration` to `OmniThinker` instead of vLLM's
class. Everything is vLLM's model (M-RoPE positions, the audio tower, the
placeholder expansion of its multimodal processor) except one fix: vLLM
0.32 hands precomputed `image_embeds` of a batch back as one tensor, which
its model runner then reads as one item per row ("Expected number of
multimodal embeddings to match number of input items: 1, but got 24"). Here
they are split per image by `image_grid_thw`, as vLLM's pixel path does.
"""
from __future__ import annotations

from vllm.model_executor.models.qwen2_5_omni_thinker import (
    Qwen2_5OmniThinkerForConditionalGeneration,
)


class OmniThinker(Qwen2_5OmniThinkerForConditionalGeneration):
    def _process_image_input(self, image_input):
        if image_input["type"] != "image_embeds":
            return super()._process_image_input(image_input)
        embeds = image_input["image_embeds"]
        if not isinstance(embeds, (list, tuple)):
            merge = self.visual.spatial_merge_size
            sizes = image_input["image_grid_thw"].prod(-1) // merge // merge
            embeds = embeds.split(sizes.tolist())
        return tuple(e.type(self.visual.dtype) for e in embeds)


    # --- positions of a prompt that hears a video's soundtrack ---------------------------
    def get_mrope_input_positions(self, input_tokens, mm_features):
        """vLLM's M-RoPE positions, except for a video heard with its sound
        (use_audio_in_video): there vLLM 0.32 places the chunks one token early (its
        `<|audio_bos|>` takes the first frame's position), so those positions come from
        transformers' own `get_rope_index`, the model's definition."""
        heard = [f for f in mm_features if f.modality == "video" and f.data is not None
                 and f.data.get("use_audio_in_video") is not None
                 and bool(f.data["use_audio_in_video"].data.item())]
        if not heard:
            return super().get_mrope_input_positions(input_tokens, mm_features)
        return audio_in_video_positions(self.config, input_tokens, mm_features)


def audio_in_video_positions(config, input_tokens, mm_features):
    """(positions [3, n], delta) of transformers' Qwen2.5-Omni `get_rope_index` with
    use_audio_in_video, from vLLM's features in prompt order."""
    import torch
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m

    features = sorted(mm_features, key=lambda f: f.mm_position.offset)

    def stacked(modality: str, key: str):
        rows = [f.data[key].data.reshape(-1) for f in features if f.modality == modality]
        return torch.stack(rows) if rows else None

    index = _RopeIndex(config, m.Qwen2_5OmniPreTrainedModelForConditionalGeneration)
    seconds = stacked("video", "second_per_grid_ts")
    lengths = stacked("audio", "audio_feature_lengths")
    ids = torch.tensor([list(input_tokens)])
    pos, delta = index.get_rope_index(
        ids, stacked("image", "image_grid_thw"), stacked("video", "video_grid_thw"),
        torch.ones_like(ids), True, None if lengths is None else lengths.reshape(-1),
        None if seconds is None else seconds.reshape(-1))
    return pos[:, 0], int(delta.reshape(-1)[0])


class _RopeIndex:
    """transformers' get_rope_index bound to the thinker config (the attributes it reads)."""

    def __init__(self, config, base):
        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.get_rope_index = base.get_rope_index.__get__(self)
        self.get_llm_pos_ids_for_vision = base.get_llm_pos_ids_for_vision.__get__(self)
        self.get_chunked_index = base.get_chunked_index.__get__(self)

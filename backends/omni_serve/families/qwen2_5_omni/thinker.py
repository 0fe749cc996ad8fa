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


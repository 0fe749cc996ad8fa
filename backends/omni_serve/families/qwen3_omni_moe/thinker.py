"""vLLM's own Qwen3-Omni thinker, keeping the hidden state the talker reads (vLLM worker process).

`vllm_models.register` (a vllm.general_plugins entry point) maps the checkpoint
architecture `Qwen3OmniMoeForConditionalGeneration` to `Qwen3OmniThinker`
instead of vLLM's class. Everything is vLLM's model; one thing is added: the
talker's media rows read the thinker's hidden state after decoder layer
`talker_config.accept_hidden_layer` (transformers' `hidden_states[layer]`),
not the last one. Each forward keeps that layer's output, one row per
scheduled token, in `omni_capture_hidden`; the hidden-state capture
(omni_serve/llm/hidden_states.py) writes it as the hidden half of a row.

How it is taken: vLLM's own auxiliary hidden-state outputs (EAGLE-3's), set
at construction so a compiled model has them too. vLLM records a layer's
output after that layer's deepstack addition (image rows plus the vision
tower's multi-scale features, in the first `deepstack_num_level` layers);
transformers records it before. Where the layer has one, its deepstack rows,
read from the buffer before the forward clears it, are taken back off.

Its prompts are processed by thinker_processor.Qwen3OmniThinkerProcessor: vLLM's, but a
sound's feature frames (and so its audio tokens) are transformers', which vLLM's own
processor makes one more of wherever a clip is not a whole number of 10 ms hops.
"""
from __future__ import annotations

import torch
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from omni_serve.families.qwen3_omni_moe import thinker_processor


def capture_layer(hf_config) -> int | None:
    """The thinker layer whose output the talker reads (`accept_hidden_layer`), None for a
    checkpoint without a talker."""
    talker = getattr(hf_config, "talker_config", None)
    if talker is None or not getattr(hf_config, "enable_audio_output", True):
        return None
    layer = getattr(talker, "accept_hidden_layer", None)
    return None if layer is None else int(layer)


@thinker_processor.register  # audio feature frames as transformers makes them
class Qwen3OmniThinker(Qwen3OmniMoeThinkerForConditionalGeneration):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        layer = capture_layer(vllm_config.model_config.hf_config)
        if layer is not None and not 0 <= layer <= self.config.text_config.num_hidden_layers:
            raise ValueError(f"talker_config.accept_hidden_layer={layer} is not a layer of the "
                             f"{self.config.text_config.num_hidden_layers}-layer thinker")
        self.omni_capture_layer = layer
        self.omni_capture_hidden: torch.Tensor | None = None
        if layer is not None:
            self.language_model.model.aux_hidden_state_layers = (layer,)

    def _deepstack_rows(self, layer: int, tokens: int) -> torch.Tensor | None:
        """The deepstack rows vLLM adds to the output of decoder layer `layer` - 1 in this
        forward (a copy: the forward clears the buffer), None where it adds none."""
        level = layer - 1
        if (not getattr(self, "deepstack_input_embeds", None) or not 0 <= level < self.deepstack_num_level
                or getattr(self, "deepstack_input_embeds_num_tokens", 0) == 0):
            return None
        return self.deepstack_input_embeds[level][:tokens].clone()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        layer = self.omni_capture_layer
        deepstack = None
        if layer is not None and inputs_embeds is not None:
            deepstack = self._deepstack_rows(layer, inputs_embeds.size(0))
        out = super().forward(input_ids, positions, intermediate_tensors,
                              inputs_embeds=inputs_embeds, **kwargs)
        if not isinstance(out, tuple):
            return out
        hidden, aux = out
        kept = aux[0]
        if deepstack is not None:
            kept = kept - deepstack.to(kept.dtype)
        self.omni_capture_hidden = kept
        return hidden

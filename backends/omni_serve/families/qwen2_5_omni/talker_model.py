"""Qwen2.5-Omni's talker as a vLLM model (runs in vLLM's worker process).

`Qwen2_5OmniTalkerForConditionalGeneration` of a real checkpoint, loaded from
the whole checkpoint folder (`talker.*` weights; the talker stage points vLLM
at the folder with this class as its architecture, see families/qwen2_5_omni/talker_prompt.py):

    x = thinker_to_talker_proj(inputs_embeds + extra)      # embedding_size -> hidden
    h = Qwen2 decoder (M-RoPE, the talker's own sections) on x
    logits = codec_head(h)                                 # the codec vocabulary

`inputs_embeds` are the prompt embeddings the stage built (the thinker's rows,
the voice's token, codec pad/bos) at prompt positions and the codec
embedding of the last sampled code at decode positions. `extra` is what vLLM
has no input for: at decode position q the thinker's reply vector for that
step (its hidden state + input embedding of reply token q - prompt_len + 1,
then the text-eos embedding, then the text-pad embedding for ever). The
worker extension in families/qwen2_5_omni/talker_engine.py puts it in `self.omni_extra` (and
the right 3D positions in the `positions` argument) before each forward.

Attention takes `head_dim` from the talker config, as transformers does: the
real Qwen2.5-Omni-7B talker has 12 heads of 128 in a hidden of 896, which
vLLM's `Qwen2Attention` (head_dim = hidden / heads) cannot build. The decoder
layers are Qwen2's with Llama's attention module, which reads `head_dim`.

The text-eos and text-pad embeddings are rows of the thinker's input
embedding; they are kept from the checkpoint's `thinker.model.embed_tokens`
when the weights load (`tail_embeds`), the rest of the thinker is skipped.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.llama import LlamaAttention
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer, Qwen2MLP, Qwen2Model
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix
from vllm.transformers_utils.config import set_default_rope_theta

TALKER_PREFIX = "talker."
THINKER_EMBED = "thinker.model.embed_tokens.weight"


class TalkerDecoderLayer(Qwen2DecoderLayer):
    """Qwen2's decoder layer (its forward) whose attention honours `config.head_dim`.

    Qwen2 attention: q/k/v with bias, o without, M-RoPE from `rope_parameters`.
    """

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        nn.Module.__init__(self)  # Qwen2DecoderLayer.__init__ would build head_dim = hidden / heads
        self.hidden_size = config.hidden_size
        set_default_rope_theta(config, default_theta=1000000)
        self.self_attn = LlamaAttention(
            config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings, quant_config=quant_config,
            bias=True, bias_o_proj=False, cache_config=cache_config, prefix=f"{prefix}.self_attn")
        self.mlp = Qwen2MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            hidden_act=config.hidden_act, quant_config=quant_config,
                            prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class OmniTalker(nn.Module, SupportsMRoPE):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config.talker_config
        self.config = config
        self.model = Qwen2Model(vllm_config=vllm_config.with_hf_config(config),
                                prefix=maybe_prefix(prefix, "model"),
                                decoder_layer_type=TalkerDecoderLayer)
        # the talker's codec embedding is embedding_size wide (the thinker's width), not hidden
        self.model.embed_tokens = PPMissingLayer()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embedding_size)
        self.thinker_to_talker_proj = nn.Linear(config.embedding_size, config.hidden_size)
        self.codec_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                         prefix=maybe_prefix(prefix, "codec_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.register_buffer("tail_embeds", torch.zeros(2, config.embedding_size), persistent=False)
        self.tail_ids = (config.tts_text_end_token_id, config.tts_text_pad_token_id)
        self.omni_extra: torch.Tensor | None = None  # [tokens, embedding_size], per forward

    def get_mrope_input_positions(self, input_tokens, mm_features):
        # The real positions come from the talker request (the worker extension
        # overwrites them per step); vLLM only needs a placeholder of the right shape.
        n = len(input_tokens)
        return torch.arange(n).expand(3, n).clone(), 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        extra, self.omni_extra = self.omni_extra, None
        if extra is not None:
            x = x + extra[: x.shape[0]].to(x.dtype)
        return self.model(None, positions, intermediate_tensors, self.thinker_to_talker_proj(x))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.codec_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        params = dict(self.named_parameters())

        def talker_weights():
            for name, tensor in weights:
                if name == THINKER_EMBED:
                    rows = tensor[list(self.tail_ids)].to(self.tail_embeds.dtype)
                    self.tail_embeds.copy_(rows)
                elif name.startswith(TALKER_PREFIX + "model."):
                    inner = name[len(TALKER_PREFIX + "model."):]
                    if inner == "embed_tokens.weight":
                        self.embed_tokens.weight.data.copy_(tensor)
                        loaded.add("embed_tokens.weight")
                    else:
                        yield inner, tensor
                elif name.startswith(TALKER_PREFIX):
                    inner = name[len(TALKER_PREFIX):]
                    param = params.get(inner)
                    if param is None:
                        raise ValueError(f"unexpected talker weight {name!r}")
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                    loaded.add(inner)

        loaded |= {f"model.{n}" for n in self.model.load_weights(talker_weights())}
        return loaded

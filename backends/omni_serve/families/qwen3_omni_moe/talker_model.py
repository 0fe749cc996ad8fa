"""Qwen3-Omni's talker and code predictor as one vLLM model (runs in vLLM's worker process).

`Qwen3OmniMoeTalkerForConditionalGeneration` of a real checkpoint, loaded from
the whole checkpoint folder (`talker.*` and the thinker's
`thinker.model.embed_tokens.weight`). vLLM samples one token per step: code 0
(codebook 0) of a frame. The 15 residual codes of that frame are drawn inside
the NEXT step's forward, batched over every decoding request:

    decode row of frame f (its input id: code 0 of frame f, embedded by vLLM)
      codes 1..15 of f = code predictor(talker's last hidden state of the
                         previous step, embedding of code 0)      # 15 batched AR steps
      x = sum of the 16 code embeddings + text_projection(thinker embedding of its text)
    h = the talker's MoE decoder (qk-norm, interleaved M-RoPE, experts + a
        shared expert behind a sigmoid gate) on x
    logits = codec_head(h)

Prompt rows arrive as prompt embeddings (the talker stage builds them, as
transformers' `Qwen3OmniMoeForConditionalGeneration.generate` does). What vLLM
has no input for, the worker extension (families/qwen3_omni_moe/talker_engine.py)
puts in `omni_step` (a `TalkerStep`) before each forward: which rows are
decode rows, each one's previous hidden state and text id, and the codes of
frames already drawn (a recomputed request re-embeds them instead of drawing
again). After the forward, `residual_codes` holds the codes drawn for
`TalkerStep.rows`, for the extension to hand out.

The code predictor is plain torch (it restarts every frame from 2 positions
and never reads more than 16, so it keeps its own small KV cache instead of
vLLM's paged one); greedy, or sampled per row as transformers samples it when
the talker samples (`ResidualSampling`).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
from vllm.model_executor.models.utils import maybe_prefix

TALKER_PREFIX = "talker."
THINKER_EMBED = "thinker.model.embed_tokens.weight"
# talker weights the engine has no use for: the stage projects the prompt's media rows
UNUSED = ("hidden_projection.",)


@dataclass
class TalkerStep:
    """The step's decode rows, as the worker extension found them (flattened batch rows).

    rows / past_hidden: decode rows whose frame's residual codes are drawn now, and the
    talker's last hidden state of each one's previous step. known_rows / known_codes:
    decode rows whose frame's codes were drawn before (a recomputed request). text_embeds:
    the thinker input embedding of every decode row's text, `rows` first, then
    `known_rows` (of a reply token, then of tts_eos, then of tts_pad).
    """

    rows: torch.Tensor  # [D] long
    past_hidden: torch.Tensor  # [D, hidden]
    text_embeds: torch.Tensor  # [D + K, thinker hidden]
    known_rows: torch.Tensor | None = None  # [K] long
    known_codes: torch.Tensor | None = None  # [K, groups - 1] long
    sampling: ResidualSampling | None = None  # None: every row greedy


@dataclass
class ResidualSampling:
    """How each of the step's `rows` draws its residual codes (transformers' code predictor
    samples, temperature then top-k then top-p, when the talker samples).

    noise: Exp(1) draws, one per (row, group, code), made by the worker extension from each
    request's own generator, so a request draws the same codes alone or in any batch.
    """

    sampled: torch.Tensor  # [D] bool; False: greedy
    temperature: torch.Tensor  # [D] float
    top_k: torch.Tensor  # [D] long; 0: no top-k
    top_p: torch.Tensor  # [D] float
    noise: torch.Tensor  # [D, groups - 1, vocab] float


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """transformers' temperature, top-k and top-p warpers, with per-row settings ([B, V])."""
    scores = logits / temperature[:, None]
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = scores.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    scores = scores.masked_fill(scores < kth, float("-inf"))
    ascending, order = scores.sort(dim=-1)
    remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
    remove[:, -1] = False
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def _pick(logits: torch.Tensor, group: int, sampling: ResidualSampling | None) -> torch.Tensor:
    greedy = logits.argmax(-1)
    if sampling is None or not bool(sampling.sampled.any()):
        return greedy
    probs = filter_logits(logits.float(), sampling.temperature, sampling.top_k,
                          sampling.top_p).softmax(dim=-1)
    drawn = (probs / sampling.noise[:, group]).argmax(-1)  # exponential race: a draw from probs
    return torch.where(sampling.sampled, drawn, greedy)


# --- the code predictor (plain torch) ---------------------------------------------------

class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3 RMSNorm (normalized in float32, cast back, then the weight) in
    one fused op for the normalizing; `weight` may broadcast ([heads, head_dim])."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class _Mlp(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)


class _Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = _RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = _RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm_weight(self) -> torch.Tensor:
        """q_norm's weight for each query head, then k_norm's for each key head."""
        return torch.cat([self.q_norm.weight.expand(self.heads, -1),
                          self.k_norm.weight.expand(self.kv_heads, -1)])


class _Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = _Attention(config)
        self.mlp = _Mlp(config.hidden_size, config.intermediate_size)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)

    def step(self, x, cos, sin, cache: list, qk_norm: torch.Tensor) -> torch.Tensor:
        """One Qwen3 decoder layer (qk-norm, GQA, 1D RoPE) over the frame's cache.

        Written for few ops (a frame is 15 steps of a small model, so on CPU the ops'
        dispatch, not their arithmetic, is the time): the weights are used as tensors, q
        and k are normed and rotated as one tensor of heads, and every value is the one
        transformers computes.
        """
        attn, mlp = self.self_attn, self.mlp
        heads, kv_heads, head_dim = attn.heads, attn.kv_heads, attn.head_dim
        b, t, _ = x.shape
        h = _rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias)
        k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias)
        qk = _rms_norm(torch.cat([q, k], dim=-1).view(b, t, heads + kv_heads, head_dim),
                       qk_norm, attn.q_norm.eps)  # k_norm's is the same config value
        half = head_dim // 2  # rotate_half: (-second half, first half)
        qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
        q, k = qk.transpose(1, 2).split([heads, kv_heads], dim=1)
        v = v.view(b, t, kv_heads, head_dim).transpose(1, 2)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1,
                                             enable_gqa=heads != kv_heads)
        x = x + F.linear(out.transpose(1, 2).reshape(b, t, -1), attn.o_proj.weight,
                         attn.o_proj.bias)
        h = _rms_norm(x, self.post_attention_layernorm.weight,
                      self.post_attention_layernorm.eps)
        gate, up = F.linear(h, mlp.gate_proj.weight), F.linear(h, mlp.up_proj.weight)
        return x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)


class _PredictorModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        groups = config.num_code_groups
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(config.vocab_size, config.hidden_size) for _ in range(groups - 1))


class CodePredictor(nn.Module):
    """`talker.code_predictor`: codes 1..groups-1 of a frame from (talker hidden, code 0 embedding).

    Parameter names are the checkpoint's under `talker.code_predictor.`.
    """

    def __init__(self, config):
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"code predictor rope_type {rope['rope_type']!r} is not supported "
                             "(the Qwen3-Omni checkpoints use 'default')")
        self.groups = config.num_code_groups
        self.model = _PredictorModel(config)
        self.lm_head = nn.ModuleList(nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                                     for _ in range(self.groups - 1))
        head_dim = self.model.layers[0].self_attn.head_dim
        theta = float(rope.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        # cos and sin of every position a frame reaches (0 .. groups - 1), float32 as
        # transformers computes them: [positions, 1 (heads), head_dim]
        freqs = torch.arange(self.groups, dtype=torch.float)[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def _step(self, x: torch.Tensor, start: int, caches: list, qk_norms: list) -> torch.Tensor:
        n = x.shape[1]
        cos = self.rope_cos[start:start + n].to(x.dtype)
        sin = self.rope_sin[start:start + n].to(x.dtype)
        for layer, cache, qk_norm in zip(self.model.layers, caches, qk_norms, strict=True):
            x = layer.step(x, cos, sin, cache, qk_norm)
        return _rms_norm(x, self.model.norm.weight, self.model.norm.eps)

    @torch.no_grad()
    def draw(self, past_hidden: torch.Tensor, code0_embeds: torch.Tensor,
             sampling: ResidualSampling | None = None,
             logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Codes 1..groups-1, [B, groups - 1], of B frames at once (greedy unless `sampling`);
        each step's logits [B, vocab] are appended to `logits` when given."""
        caches = [[] for _ in self.model.layers]
        qk_norms = [layer.self_attn.qk_norm_weight() for layer in self.model.layers]
        x = torch.stack([past_hidden, code0_embeds], dim=1)
        codes = []
        for k in range(self.groups - 1):
            h = self._step(x, 0 if k == 0 else k + 1, caches, qk_norms)
            # the head over every position of the step, as transformers runs it: a matmul's
            # rounding may depend on its row count (it does on AMD EPYC), so the first
            # step's two rows a frame give transformers' bits where the last row alone
            # would not
            step_logits = F.linear(h, self.lm_head[k].weight)[:, -1]
            if logits is not None:
                logits.append(step_logits)
            codes.append(_pick(step_logits, k, sampling))
            if k + 1 < self.groups - 1:
                x = F.embedding(codes[-1], self.model.codec_embedding[k].weight)[:, None]
        return torch.stack(codes, dim=1)

    def frame_embedding(self, code0_embeds: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """A frame's talker input before its text: code 0's embedding plus the embeddings of
        codes 1..groups-1 ([B, hidden], [B, groups - 1] -> [B, hidden]), summed as one
        reduction in that order, as transformers sums them (`codec_hiddens.sum(1)`): the
        same bits, also in bfloat16, where adding one by one would round 15 times."""
        parts = [code0_embeds] + [F.embedding(codes[:, k], emb.weight)
                                  for k, emb in enumerate(self.model.codec_embedding)]
        return torch.stack(parts, dim=1).sum(1)


class ResizeMLP(nn.Module):
    """`text_projection`: thinker width -> talker width (checkpoint names)."""

    def __init__(self, config):
        super().__init__()
        inner = config.text_config.intermediate_size
        self.linear_fc1 = nn.Linear(config.thinker_hidden_size, inner, bias=True)
        self.linear_fc2 = nn.Linear(inner, config.text_config.hidden_size, bias=True)
        if config.text_config.hidden_act != "silu":
            raise ValueError(f"talker hidden_act {config.text_config.hidden_act!r} is not supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


# --- the talker (vLLM) ------------------------------------------------------------------

def talker_text_config(talker_config):
    """The talker decoder's config as vLLM's Qwen3-MoE layers read it (M-RoPE interleaved,
    as transformers always interleaves)."""
    text = copy.deepcopy(talker_config.text_config)
    rope = dict(text.rope_parameters or {})
    if "mrope_section" in rope:
        rope["mrope_interleaved"] = True
    text.rope_parameters = rope
    return text


@support_torch_compile(dynamic_arg_dims={
    "input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0})
class _Decoder(Qwen3MoeModel):
    """vLLM's Qwen3MoeModel, compiled with M-RoPE positions: [3, tokens], the token
    dimension last. Qwen3MoeModel's own compile marks positions' first dimension (the 3)
    dynamic and specialises the token count, which fails at load (ConstraintViolationError
    in MRotaryEmbedding.forward_native); vLLM's Qwen3-VL MoE text model is declared the
    same way."""


class Qwen3OmniTalker(nn.Module, SupportsMRoPE):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        talker = config.talker_config
        self.config = talker
        text = talker_text_config(talker)
        sub = vllm_config.with_hf_config(text, architectures=["Qwen3MoeForCausalLM"])
        sub.model_config.hf_text_config = text  # with_hf_config keeps the thinker's text config
        # model.embed_tokens is the checkpoint's model.codec_embedding (code 0's embedding)
        self.model = _Decoder(vllm_config=sub, prefix=maybe_prefix(prefix, "model"))
        self.codec_head = ParallelLMHead(text.vocab_size, text.hidden_size,
                                         prefix=maybe_prefix(prefix, "codec_head"))
        self.logits_processor = LogitsProcessor(text.vocab_size)
        self.text_projection = ResizeMLP(talker)
        # the thinker's input embedding (its rows are the decode steps' text); resized when
        # the checkpoint's tensor loads
        self.thinker_embed = nn.Embedding(1, talker.thinker_hidden_size)
        self.code_predictor = CodePredictor(talker.code_predictor_config)
        self.omni_step: TalkerStep | None = None  # set by the worker extension, per forward
        self.residual_codes: torch.Tensor | None = None  # [D, groups - 1] after a forward

    def get_mrope_input_positions(self, input_tokens, mm_features):
        # A text prompt's positions; the worker extension overwrites them for a prompt
        # with media (the talker request's own 3D positions).
        n = len(input_tokens)
        return torch.arange(n).expand(3, n).clone(), 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def frame_inputs(self, x: torch.Tensor, step: TalkerStep) -> torch.Tensor:
        """`x` with each decode row's code 0 embedding completed into its frame's input."""
        rows = step.rows.to(x.device)
        drawn = self.code_predictor.draw(step.past_hidden.to(x), x[rows], step.sampling)
        self.residual_codes = drawn
        all_rows, codes = rows, drawn
        if step.known_rows is not None and step.known_rows.numel():
            all_rows = torch.cat([rows, step.known_rows.to(x.device)])
            codes = torch.cat([drawn, step.known_codes.to(drawn)])
        text = self.text_projection(step.text_embeds.to(x))
        x = x.clone()
        x[all_rows] = self.code_predictor.frame_embedding(x[all_rows], codes) + text.to(x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        step, self.omni_step = self.omni_step, None
        self.residual_codes = None
        if step is not None and step.text_embeds.numel():
            x = self.frame_inputs(x, step)
        return self.model(None, positions, intermediate_tensors, x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.codec_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def load(name: str, tensor: torch.Tensor) -> None:
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected talker weight {TALKER_PREFIX}{name!r}")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)

        def decoder_weights():
            for name, tensor in weights:
                if name == THINKER_EMBED:
                    # sized here: the engine's text config carries the talker's vocabulary
                    w = self.thinker_embed.weight
                    self.thinker_embed.weight = nn.Parameter(tensor.to(w.device, w.dtype),
                                                             requires_grad=False)
                    loaded.add("thinker_embed.weight")
                if not name.startswith(TALKER_PREFIX):
                    continue  # the thinker and Code2Wav
                inner = name[len(TALKER_PREFIX):]
                if inner == "model.codec_embedding.weight":
                    yield "embed_tokens.weight", tensor
                elif inner.startswith("model."):
                    yield inner[len("model."):], tensor
                elif not inner.startswith(UNUSED):
                    load(inner, tensor)

        loaded |= {f"model.{n}" for n in self.model.load_weights(decoder_weights())}
        return loaded

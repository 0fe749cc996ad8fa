"""Tiny random-weight Qwen3-Omni checkpoints in the hub's layout (Instruct, and Thinking/Captioner).

Where it runs: in the set-up / user process (`omni-build-tiny qwen3-omni-tiny`, through the
tiny_models registry) and in tests. Never inside tritonserver: the stages only read the folders
written here.

What flows through it: a seed in; a folder out that looks like a downloaded
`Qwen/Qwen3-Omni-30B-A3B-*` snapshot, shrunk:
- `config.json`: a `Qwen3OmniMoeConfig` keeping the real model's structure and quirks at tiny
  widths: an MoE thinker (top-k > 1 of a few experts, qk-norm, interleaved M-RoPE with
  `mrope_interleaved` set so vLLM interleaves as transformers does, head_dim != hidden / heads,
  untied head), a vision tower with deepstack mergers, the AuT audio encoder; an MoE talker with
  the sigmoid-gated shared expert and the 16-group code predictor, the real voices (chelsie,
  ethan, aiden) and codec special ids, moved by the same offset as the codebook (the real ones
  sit 100.. and 253.. above a 2048-code book; here above TINY_CODEBOOK); Code2Wav with the real
  upsampling (8*5*4*3 * 2*2 = 1920 samples a frame at 24 kHz).
- `model.safetensors` with `thinker.*`, `talker.*`, `code2wav.*` (`talker=False`: a
  Thinking/Captioner-style folder, `enable_audio_output: false`, thinker tensors only);
- the tokenizer (tiny_tokenizer's BPE with Qwen3-Omni's special and placeholder tokens),
  `chat_template.json`, `preprocessor_config.json` (Whisper features + the image/video
  processor settings, patch 16) and `generation_config.json` holding the talker's sampling
  defaults, as the hub's does.
The thinker is drawn alone from `seed`, so both variants of one seed share its weights; its
head never writes the vocabulary's padding or a special token but the stops (quiet_non_text_rows).
`thinker_shape="moe-small"` widens only the thinker's text model (THINKER_SHAPES: a real MoE shape
scaled down, for benchmarks); towers, talker, Code2Wav and tokenizer stay the tiny ones.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_tools.tiny_models import DEFAULT_SEED
from omni_tools.tiny_tokenizer import IM_END, IM_START, build_tokenizer, padded_vocab_size, special_ids

if TYPE_CHECKING:  # heavy imports stay lazy
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# --- tokens --------------------------------------------------------------------------------
# Tokenizer attribute -> token, as Qwen3-Omni's tokenizer_config.json names them.
QWEN3_OMNI_TOKEN_ATTRS: dict[str, str] = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# The talker's text markers and the thinking tags: special tokens without an attribute.
TTS_PAD, TTS_BOS, TTS_EOS = "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"
TTS_BOS_SINGLE = "<tts_text_bos_single>"
OTHER_SPECIAL_TOKENS = ("<think>", "</think>", TTS_PAD, TTS_BOS, TTS_EOS, TTS_BOS_SINGLE)

# The role names are single tokens, as in Qwen's vocabulary: transformers finds the user turns
# and the assistant turn by the token after <|im_start|>. Trained in with this extra text.
ROLE_TEXT = ("system user assistant\n",) * 200

# Qwen3-Omni's chat template (chat_template.json on the hub): Qwen3's ChatML with tools and
# <think> handling, media parts detected as the hub's template does (`content.type == 'audio'
# or 'audio' in content or 'audio_url' in content`, likewise image/video), each rendered as
# start + one placeholder + end for the processor to expand.
QWEN3_OMNI_CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'audio' or 'audio' in part or 'audio_url' in part -%}
                {{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}
            {%- elif part.type == 'video' or 'video' in part -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = render_content(message.content) %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
                {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# --- tiny shapes ---------------------------------------------------------------------------
TINY_MAX_LEN = 4096
# Thinker text model: hidden 96 (a multiple of 32, as vLLM's CPU kernels need) with 2 heads of
# 64: head_dim * heads (128) != hidden, as the real 2048-wide model's 32 heads of 128.
TINY_TEXT = {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 128,
             "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
# The real interleaved M-RoPE sections for head_dim 128; a narrower head takes them scaled
# (head_dim 64: [12, 10, 10]), so they sum to head_dim / 2.
REAL_MROPE_SECTION = (24, 20, 20)
# The talker reads the thinker's hidden states after this layer (real: 24 of 48).
TINY_ACCEPT_HIDDEN_LAYER = 2
# A larger thinker text model for benchmarks (`thinker_shape="moe-small"`): the real one at half
# its width (hidden 1024 vs 2048, 16 heads of 128 vs 32, 2 KV heads vs 4, moe_intermediate_size
# 384 vs 768) with 10 of its 48 layers and 32 of its 128 experts, top-8 as the real one: ~430M
# parameters (~1.7 GB fp32), ~140M of them active a token. The tokenizer and its 2048-id
# vocabulary stay the tiny ones (the real one has 152064 ids); the narrow init keeps 10 random
# layers finite. Hidden and moe_intermediate_size are multiples of 32 and head_dim 128 is one
# vLLM's CPU attention supports, as its CPU MoE and attention kernels need.
MOE_SMALL_TEXT: dict[str, Any] = {
    "hidden_size": 1024, "num_hidden_layers": 10, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 384,
    "moe_intermediate_size": 384, "num_experts": 32, "num_experts_per_tok": 8,
    "initializer_range": 0.02,
}


@dataclass(frozen=True)
class ThinkerShape:
    """The thinker's text model of one checkpoint variant (towers, talker, Code2Wav stay tiny)."""

    text: dict[str, Any]  # text_config keys over TINY_TEXT's
    accept_hidden_layer: int  # the talker's: the thinker layer its media rows come from


THINKER_SHAPES: dict[str, ThinkerShape] = {
    "tiny": ThinkerShape({}, TINY_ACCEPT_HIDDEN_LAYER),
    # half the layers, as the real 24 of 48
    "moe-small": ThinkerShape(MOE_SMALL_TEXT, MOE_SMALL_TEXT["num_hidden_layers"] // 2),
}
# Vision tower: patch 16, merge 2, temporal patch 2 as the real one; deepstack mergers after
# blocks 0..2 of 4 (real: 8, 16, 24 of 27) feed text layers 0..2. Its position grid is
# sqrt(num_position_embeddings) a side, which vLLM reads as image_size // patch_size.
TINY_VISION = {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
               "deepstack_visual_indexes": [0, 1, 2], "num_position_embeddings": 256,
               "image_size": 256, "patch_size": 16, "spatial_merge_size": 2,
               "temporal_patch_size": 2,
               # keys the hub's vision_config carries beyond transformers' fields; vLLM reads
               # apply_vit_abs_pos_embed and image_size
               "apply_vit_abs_pos_embed": True, "spatial_patch_size": 16, "tokens_per_second": 2}
TINY_AUDIO = {"encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
              "d_model": 64, "downsample_hidden_size": 32, "num_mel_bins": 128,
              "max_source_positions": 1500, "n_window": 50, "n_window_infer": 800,
              "conv_chunksize": 500}
# Codec: TINY_CODEBOOK codes a group. The talker's vocabulary is the codebook and 1024 ids
# above it (transformers suppresses the top 1024 but codec eos), as the real 2048 + 1024.
TINY_CODEBOOK = 128
REAL_CODEBOOK = 2048
NUM_CODE_GROUPS = 16
# The hub's codec special ids and voices (Qwen3-Omni-30B-A3B-Instruct config.json).
REAL_CODEC_IDS = {"codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150,
                  "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157}
REAL_SPEAKER_IDS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
# Talker: hidden 64 with 2 heads of 64 (real: 1024 wide, 16 heads of 128), MoE with a shared
# expert behind a sigmoid gate, the 16-group code predictor at the talker's width.
TINY_TALKER_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 128,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                    "num_experts": 4, "num_experts_per_tok": 2}
TINY_CODE_PREDICTOR = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 128}
# Code2Wav: tiny widths, the real upsampling (8, 5, 4, 3) x (2, 2) = 1920 samples a frame.
TINY_CODE2WAV = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "intermediate_size": 128, "decoder_dim": 64,
                 "sliding_window": 72, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2]}
SAMPLES_PER_FRAME = 1920
OUTPUT_SAMPLE_RATE = 24000
# The image processor: sides are multiples of patch 16 x merge 2 = 32; 4 to 64 merged tokens.
TINY_MIN_PIXELS = 32 * 32 * 4
TINY_MAX_PIXELS = 32 * 32 * 64
# generation_config.json of the Instruct model: the talker's sampling defaults, nothing else.
TALKER_GENERATION_DEFAULTS = {"talker_max_new_tokens": 4096, "talker_repetition_penalty": 1.05,
                              "talker_temperature": 0.9, "talker_top_k": 50, "talker_top_p": 1.0}


def tiny_codec_id(real_id: int) -> int:
    """A hub codec special id moved to the tiny codebook (same offset above the codebook)."""
    return real_id - REAL_CODEBOOK + TINY_CODEBOOK


# --------------------------------------------------------------------------
# tokenizer and configs
# --------------------------------------------------------------------------


def build_qwen3_omni_tokenizer(model_max_length: int = TINY_MAX_LEN) -> PreTrainedTokenizerBase:
    """The tiny BPE with Qwen3-Omni's special tokens and chat template.

    Ids: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2, the BPE vocabulary, the placeholder
    tokens (QWEN3_OMNI_TOKEN_ATTRS), then OTHER_SPECIAL_TOKENS.
    """
    tokenizer = build_tokenizer(
        model_max_length,
        extra_text=ROLE_TEXT,
        extra_special_tokens={"im_start_token": IM_START, "im_end_token": IM_END,
                              **QWEN3_OMNI_TOKEN_ATTRS},
        chat_template=QWEN3_OMNI_CHAT_TEMPLATE,
    )
    tokenizer.add_tokens(list(OTHER_SPECIAL_TOKENS), special_tokens=True)
    return tokenizer


def _single_token(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{text!r} must be one token of the tiny tokenizer, got {ids}")
    return ids[0]


def mrope_section(head_dim: int) -> list[int]:
    """REAL_MROPE_SECTION scaled to `head_dim` (it must sum to head_dim / 2)."""
    section = [n * head_dim // 128 for n in REAL_MROPE_SECTION]
    if 2 * sum(section) != head_dim:
        raise ValueError(f"head_dim {head_dim}: the M-RoPE sections {section} must sum to head_dim / 2")
    return section


def _rope(head_dim: int) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section(head_dim),
            "interleaved": True, "mrope_interleaved": True}


def tiny_thinker_config(tokenizer: PreTrainedTokenizerBase, shape: str = "tiny") -> Any:
    """The tiny Qwen3OmniMoeThinkerConfig, its token ids taken from `tokenizer`.

    `shape` (THINKER_SHAPES) "moe-small": the text model takes MOE_SMALL_TEXT's shapes.
    """
    from transformers import Qwen3OmniMoeThinkerConfig

    tok = tokenizer.convert_tokens_to_ids
    # Wide init (as qwen2-tiny): greedy replies vary from token to token.
    text = {**TINY_TEXT, "initializer_range": 0.5, **THINKER_SHAPES[shape].text}
    hidden = text["hidden_size"]
    config = Qwen3OmniMoeThinkerConfig(
        text_config={
            **text,
            "vocab_size": padded_vocab_size(tokenizer),
            "max_position_embeddings": TINY_MAX_LEN,
            "rms_norm_eps": 1e-6,
            "rope_parameters": _rope(text["head_dim"]),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "tie_word_embeddings": False,
            "dtype": "float32",
            **special_ids(tokenizer),
        },
        vision_config={**TINY_VISION, "out_hidden_size": hidden, "initializer_range": 0.1},
        audio_config={**TINY_AUDIO, "output_dim": hidden, "initializer_range": 0.1},
        audio_token_id=tok(QWEN3_OMNI_TOKEN_ATTRS["audio_token"]),
        image_token_id=tok(QWEN3_OMNI_TOKEN_ATTRS["image_token"]),
        video_token_id=tok(QWEN3_OMNI_TOKEN_ATTRS["video_token"]),
        audio_start_token_id=tok(QWEN3_OMNI_TOKEN_ATTRS["audio_bos_token"]),
        user_token_id=_single_token(tokenizer, "user"),
        position_id_per_seconds=13,
        tie_word_embeddings=False,
        initializer_range=text["initializer_range"],
    )
    # Keys the hub's thinker_config carries beyond the class's fields.
    config.audio_end_token_id = tok(QWEN3_OMNI_TOKEN_ATTRS["audio_eos_token"])
    config.vision_start_token_id = tok(QWEN3_OMNI_TOKEN_ATTRS["vision_bos_token"])
    config.vision_end_token_id = tok(QWEN3_OMNI_TOKEN_ATTRS["vision_eos_token"])
    config.seconds_per_chunk = 2
    config.dtype = "float32"
    return config


def tiny_talker_config(thinker_config: Any, accept_hidden_layer: int = TINY_ACCEPT_HIDDEN_LAYER
                       ) -> dict[str, Any]:
    """The tiny talker_config: MoE with a shared expert, 16 code groups, the hub's ids moved;
    its media rows come from the thinker's layer `accept_hidden_layer`."""
    codec = {name: tiny_codec_id(v) for name, v in REAL_CODEC_IDS.items()}
    media = {name: getattr(thinker_config, name) for name in (
        "audio_token_id", "image_token_id", "video_token_id", "vision_start_token_id",
        "audio_start_token_id", "audio_end_token_id")}
    return {
        **codec, **media,
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": thinker_config.text_config.hidden_size,
        "accept_hidden_layer": accept_hidden_layer,
        "speaker_id": {name: tiny_codec_id(v) for name, v in REAL_SPEAKER_IDS.items()},
        "position_id_per_seconds": 13, "seconds_per_chunk": 2, "spatial_merge_size": 2,
        "text_config": {
            **TINY_TALKER_TEXT,
            "vocab_size": TINY_CODEBOOK + 1024,
            "max_position_embeddings": TINY_MAX_LEN,
            "rope_parameters": _rope(TINY_TALKER_TEXT["head_dim"]),
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
            "initializer_range": 0.5,
            "dtype": "float32",
        },
        "code_predictor_config": {
            **TINY_CODE_PREDICTOR,
            "vocab_size": TINY_CODEBOOK,
            "num_code_groups": NUM_CODE_GROUPS,
            "max_position_embeddings": TINY_MAX_LEN,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "initializer_range": 0.5,
            "dtype": "float32",
        },
        "dtype": "float32",
    }


def tiny_omni_config(tokenizer: PreTrainedTokenizerBase, *, talker: bool = True,
                     thinker_shape: str = "tiny") -> Any:
    """The whole tiny Qwen3OmniMoeConfig; `talker=False` sets `enable_audio_output: false`;
    `thinker_shape` names the thinker's text model (THINKER_SHAPES)."""
    from transformers import Qwen3OmniMoeConfig

    thinker = tiny_thinker_config(tokenizer, thinker_shape)
    tok = tokenizer.convert_tokens_to_ids
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker.to_dict(),
        talker_config=tiny_talker_config(thinker, THINKER_SHAPES[thinker_shape].accept_hidden_layer),
        code2wav_config={**TINY_CODE2WAV, "codebook_size": TINY_CODEBOOK,
                         "num_quantizers": NUM_CODE_GROUPS, "initializer_range": 0.1,
                         "dtype": "float32"},
        enable_audio_output=talker,
        im_start_token_id=tok(IM_START),
        im_end_token_id=tok(IM_END),
        tts_pad_token_id=tok(TTS_PAD),
        tts_bos_token_id=tok(TTS_BOS),
        tts_eos_token_id=tok(TTS_EOS),
        system_token_id=_single_token(tokenizer, "system"),
        user_token_id=_single_token(tokenizer, "user"),
        assistant_token_id=_single_token(tokenizer, "assistant"),
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.dtype = "float32"  # vLLM on CPU then loads fp32, as a real checkpoint says bfloat16
    return config


# --------------------------------------------------------------------------
# processor files
# --------------------------------------------------------------------------


def save_processor_files(out: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Tokenizer, chat_template.json and preprocessor_config.json, as the hub ships them.

    `Qwen3OmniMoeProcessor.from_pretrained(out)` reads them: a Whisper feature extractor (128
    mel bins, 16 kHz, clips up to 300 s), the Qwen2-VL image and video processors with patch
    16 (their settings in the same preprocessor_config.json), the tokenizer and the template.
    """
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(out)
    # Qwen's hub folders keep the template in tokenizer_config.json (AutoTokenizer reads it) and
    # in chat_template.json (the processor's), not in chat_template.jinja.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = QWEN3_OMNI_CHAT_TEMPLATE
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.json").write_text(
        json.dumps({"chat_template": QWEN3_OMNI_CHAT_TEMPLATE}, indent=2) + "\n")

    image = Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS,
                                     patch_size=16, merge_size=2, temporal_patch_size=2,
                                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                    chunk_length=300, return_attention_mask=True)
    merged = {**audio.to_dict(), **image.to_dict(), "min_pixels": TINY_MIN_PIXELS,
              "max_pixels": TINY_MAX_PIXELS, "image_processor_type": "Qwen2VLImageProcessor",
              "processor_class": "Qwen3OmniMoeProcessor"}
    merged.pop("mel_filters", None)
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------
# the checkpoint
# --------------------------------------------------------------------------


def quiet_non_text_rows(thinker: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    """Zero the thinker head's rows of ids a trained model never writes in a reply.

    Those are the vocabulary's padding past the tokenizer and the special tokens (placeholders,
    markers, tts and thinking tags) but <|im_end|> and <|endoftext|>. A random head would write
    them (the padding decodes to nothing; a written <|image_pad|> counts as media to
    transformers' talker). With zero rows their logit is 0 while the text tokens' spread around
    it, so greedy and sampled replies keep to text and the stop tokens, as a trained one.
    """
    import torch

    keep = {tokenizer.convert_tokens_to_ids(IM_END), special_ids(tokenizer)["pad_token_id"]}
    mute = [i for i in range(thinker.config.text_config.vocab_size)
            if i >= len(tokenizer) or (i in tokenizer.all_special_ids and i not in keep)]
    mute += [tokenizer.convert_tokens_to_ids(t) for t in OTHER_SPECIAL_TOKENS]
    with torch.no_grad():
        thinker.lm_head.weight[sorted(set(mute))] = 0.0


def draw_talker_experts(talker: Any, seed: int) -> None:
    """Draw the talker's routed experts and router at its text init (normal, from `seed`).

    transformers 5.19 initialises neither: the experts keep `torch.empty`'s memory (denormals
    there, which also slow CPU matmuls many times over, and bytes that depend on what the
    process did before) and the router stays zero (every token to the same experts).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    std = talker.config.text_config.initializer_range
    with torch.no_grad():
        for layer in talker.model.layers:
            for p in (layer.mlp.gate.weight, layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)


def build_qwen3_omni_checkpoint(out: Path, *, seed: int = DEFAULT_SEED, talker: bool = True,
                                thinker_shape: str = "tiny", talker_experts: bool = False) -> None:
    """Write a tiny `Qwen3OmniMoeForConditionalGeneration` checkpoint into `out`, in the hub layout.

    `talker=False` writes a Thinking/Captioner-style folder: `enable_audio_output: false` and
    only `thinker.*` tensors. The thinker is drawn alone from `seed` (both variants share it),
    the talker and Code2Wav from `seed + 11`. `thinker_shape` "moe-small": the thinker's text
    model has MOE_SMALL_TEXT's shapes (tiny_thinker_config). `talker_experts`: the talker's
    routed experts and router drawn too, from `seed + 13` (draw_talker_experts; False, as
    qwen3-omni-tiny was built and its goldens recorded: as transformers leaves them).
    """
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeThinkerForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen3_omni_tokenizer(TINY_MAX_LEN)
    config = tiny_omni_config(tokenizer, talker=talker, thinker_shape=thinker_shape)
    torch.manual_seed(seed)
    thinker = Qwen3OmniMoeThinkerForConditionalGeneration(config.thinker_config).eval()
    quiet_non_text_rows(thinker, tokenizer)
    torch.manual_seed(seed + 11)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    model.thinker.load_state_dict(thinker.state_dict())
    del thinker
    if talker and talker_experts:
        draw_talker_experts(model.talker, seed + 13)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps(TALKER_GENERATION_DEFAULTS if talker else {}, indent=2) + "\n")
    save_processor_files(out, tokenizer)

"""A tiny random-weight Qwen2.5-Omni thinker, and the export of a thinker's language model.

Where it runs: in the set-up / user process (`omni-build-tiny`, through the
tiny_models registry) and in tests. Never inside tritonserver: the encoder
stage and the vLLM LLM stage only read the directories written here.

What flows through it:
- `build_omni_thinker(out)` writes a `Qwen2_5OmniThinkerForConditionalGeneration`
  checkpoint of the real architecture (text model, vision tower, audio tower)
  with random weights (fixed seed), a locally trained tokenizer carrying
  Qwen2.5-Omni's placeholder tokens, and one `preprocessor_config.json` that
  holds both the Qwen2-VL image processor and the Whisper feature extractor
  settings, as the real Qwen2.5-Omni checkpoints do.
- `export_thinker_lm(thinker_dir, out)` writes the thinker's text model and
  lm_head as a plain `Qwen2ForCausalLM` checkpoint that vLLM serves; the
  omni pipeline feeds it `prompt_embeds` (text-token embeddings with the
  encoder rows scattered into the placeholder positions). The thinker's text
  rope is M-RoPE; when the three position components are equal (text tokens,
  audio tokens) it is the 1D RoPE of Qwen2 with the same rope_theta.
  Works for a thinker-only checkpoint and for a full Qwen2.5-Omni checkpoint
  (`thinker.`-prefixed weights, `thinker_config` in config.json).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_tools import tiny_models as tm

if TYPE_CHECKING:  # heavy imports stay lazy
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Qwen2.5-Omni's placeholder and boundary tokens. A prompt carries one
# IMAGE_TOKEN (AUDIO_TOKEN) per encoder output row, between the bos/eos pair.
IMAGE_TOKEN = "<|IMAGE|>"
AUDIO_TOKEN = "<|AUDIO|>"
VIDEO_TOKEN = "<|VIDEO|>"
VISION_BOS_TOKEN = "<|vision_bos|>"
VISION_EOS_TOKEN = "<|vision_eos|>"
AUDIO_BOS_TOKEN = "<|audio_bos|>"
AUDIO_EOS_TOKEN = "<|audio_eos|>"

# Tokenizer attribute -> token, as in Qwen2.5-Omni's tokenizer_config.json
# (the Qwen2.5-Omni processor reads e.g. `tokenizer.image_token`).
OMNI_SPECIAL_TOKENS: dict[str, str] = {
    "image_token": IMAGE_TOKEN,
    "audio_token": AUDIO_TOKEN,
    "video_token": VIDEO_TOKEN,
    "vision_bos_token": VISION_BOS_TOKEN,
    "vision_eos_token": VISION_EOS_TOKEN,
    "audio_bos_token": AUDIO_BOS_TOKEN,
    "audio_eos_token": AUDIO_EOS_TOKEN,
}

# ChatML with Qwen2.5-Omni's media parts: each image/audio/video part renders
# as bos + one placeholder + eos; the caller expands the placeholder to as
# many tokens as the encoder returns rows.
OMNI_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url') %}"
    "{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') %}"
    "{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# --- tiny shapes ---------------------------------------------------------------
TINY_MAX_LEN = 4096
TINY_TEXT_HIDDEN = 128  # 2 heads of 64: vLLM's CPU attention rejects head_dim 16
TINY_MROPE_SECTION = (8, 12, 12)  # sums to head_dim / 2, in Qwen2.5-Omni's proportions
# Qwen2-VL image processor: sides are multiples of patch 14 x merge 2 = 28;
# 4 to 32 merged tokens (each 28x28 pixels) per image.
TINY_MIN_PIXELS = 28 * 28 * 4
TINY_MAX_PIXELS = 28 * 28 * 32
# Whisper features: 128 mel bins at 16 kHz, 100 frames/s; 1 s of audio -> 25 tokens.
# As the real Qwen2.5-Omni: the processor takes clips up to 300 s.
TINY_AUDIO_CHUNK_SECONDS = 300

_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_SAFETENSORS_DTYPE = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


# --------------------------------------------------------------------------
# tiny thinker
# --------------------------------------------------------------------------


def build_omni_tokenizer(model_max_length: int = TINY_MAX_LEN) -> PreTrainedTokenizerBase:
    """The tiny byte-level BPE (tiny_models.train_tokenizer) with Qwen2.5-Omni's special tokens.

    Ids: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2, the BPE vocabulary,
    then the OMNI_SPECIAL_TOKENS in their order.
    """
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    model = json.loads(tm.train_tokenizer().to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=tm.IM_END,
        pad_token=tm.ENDOFTEXT,
        extra_special_tokens={"im_start_token": tm.IM_START, "im_end_token": tm.IM_END,
                              **OMNI_SPECIAL_TOKENS},
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = OMNI_CHAT_TEMPLATE
    return tokenizer


def tiny_thinker_config(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The tiny Qwen2_5OmniThinkerConfig, its token ids taken from `tokenizer`."""
    from transformers import Qwen2_5OmniThinkerConfig

    ids = tm._special_ids(tokenizer)
    tok = tokenizer.convert_tokens_to_ids
    heads = 2
    config = Qwen2_5OmniThinkerConfig(
        text_config={
            "vocab_size": tm._round_up(len(tokenizer), 64),
            "hidden_size": TINY_TEXT_HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": 1,
            "max_position_embeddings": TINY_MAX_LEN,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": list(TINY_MROPE_SECTION),
            },
            # Untied head and a wide init (as qwen2-tiny): greedy output varies.
            "tie_word_embeddings": False,
            "initializer_range": 0.5,
            **ids,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": TINY_TEXT_HIDDEN,
            "fullatt_block_indexes": [1],  # block 0 windowed, block 1 full, as the real tower mixes
            # Narrower than the text init: merged rows come out at about the
            # scale of the text embeddings, so both matter to the LM.
            "initializer_range": 0.1,
        },
        audio_config={
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "num_mel_bins": 128,
            "output_dim": TINY_TEXT_HIDDEN,
            "initializer_range": 0.1,
        },
        image_token_index=tok(IMAGE_TOKEN),
        audio_token_index=tok(AUDIO_TOKEN),
        video_token_index=tok(VIDEO_TOKEN),
        audio_start_token_id=tok(AUDIO_BOS_TOKEN),
        audio_end_token_id=tok(AUDIO_EOS_TOKEN),
        vision_start_token_id=tok(VISION_BOS_TOKEN),
        vision_end_token_id=tok(VISION_EOS_TOKEN),
        user_token_id=tok("user"),
        tie_word_embeddings=False,
        initializer_range=0.5,
        **ids,
    )
    if config.text_config.hidden_size // heads != 2 * sum(TINY_MROPE_SECTION):
        raise ValueError("mrope_section must sum to head_dim / 2")
    config.architectures = ["Qwen2_5OmniThinkerForConditionalGeneration"]
    config.dtype = "float32"
    return config


def save_preprocessor_config(out: Path, *, min_pixels: int = TINY_MIN_PIXELS,
                             max_pixels: int = TINY_MAX_PIXELS,
                             chunk_seconds: int = TINY_AUDIO_CHUNK_SECONDS) -> None:
    """One preprocessor_config.json for images and audio, laid out as Qwen2.5-Omni's.

    `Qwen2VLImageProcessorPil.from_pretrained(out)` and
    `WhisperFeatureExtractor.from_pretrained(out)` both read it.
    """
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                    chunk_length=chunk_seconds, return_attention_mask=True)
    merged = {**audio.to_dict(), **image.to_dict(), "min_pixels": min_pixels, "max_pixels": max_pixels,
              "processor_class": "Qwen2_5OmniProcessor"}
    merged.pop("mel_filters", None)
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")


def build_omni_thinker(out: Path, *, seed: int = tm.DEFAULT_SEED) -> None:
    """Write a tiny Qwen2_5OmniThinkerForConditionalGeneration checkpoint into `out`.

    Text model: hidden 128, 2 layers, 2 heads of 64, 1 KV head, M-RoPE
    sections (8, 12, 12). Vision tower: depth 2, hidden 32, patch 14, merge 2.
    Audio tower: 2 layers, d_model 32, 128 mel bins. Random weights (fixed
    seed), tokenizer, generation config and preprocessor config.
    """
    import torch
    from transformers import GenerationConfig, Qwen2_5OmniThinkerForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_omni_tokenizer(TINY_MAX_LEN)
    config = tiny_thinker_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    del model
    ids = tm._special_ids(tokenizer)
    GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]],
        pad_token_id=ids["pad_token_id"],
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_preprocessor_config(out)


# --------------------------------------------------------------------------
# thinker LM export
# --------------------------------------------------------------------------


def qwen2_config_from_thinker(thinker_config: Any, *, tie_word_embeddings: bool, dtype: str) -> Any:
    """A Qwen2Config with the thinker text model's shapes; M-RoPE becomes 1D RoPE (same theta)."""
    from transformers import Qwen2Config

    tc = thinker_config.text_config
    rope = dict(tc.rope_parameters or {})
    for key in ("mrope_section", "mrope_interleaved", "type"):
        rope.pop(key, None)
    rope.setdefault("rope_type", "default")

    def token_id(name: str) -> Any:
        value = getattr(tc, name, None)
        return value if value is not None else getattr(thinker_config, name, None)

    extra = {}
    if getattr(tc, "head_dim", None) is not None:
        extra["head_dim"] = tc.head_dim
    config = Qwen2Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        hidden_act=tc.hidden_act,
        max_position_embeddings=tc.max_position_embeddings,
        initializer_range=tc.initializer_range,
        rms_norm_eps=tc.rms_norm_eps,
        use_cache=True,
        rope_parameters=rope,
        use_sliding_window=tc.use_sliding_window,
        sliding_window=tc.sliding_window,
        max_window_layers=tc.max_window_layers,
        layer_types=list(tc.layer_types) if tc.layer_types is not None else None,
        attention_dropout=tc.attention_dropout,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("pad_token_id"),
        dtype=dtype,  # vLLM loads the dtype the config names
        **extra,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def export_thinker_lm(thinker_dir: Path, out: Path, *, max_shard_bytes: int = 4 * 2**30) -> None:
    """Write the thinker's text model + lm_head in `thinker_dir` as a Qwen2ForCausalLM checkpoint.

    `out` gets config.json, the safetensors weights (sharded above
    `max_shard_bytes`, with an index), generation_config.json and the
    tokenizer files. Tensors are copied one shard at a time in their stored
    dtype, so a real 7B thinker exports without loading the whole model.
    Raises ValueError when `thinker_dir` holds no Qwen2.5-Omni thinker.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    from omni_serve.encoder.runner import load_thinker_config, thinker_tensor_files

    thinker_dir, out = Path(thinker_dir), Path(out)
    thinker_config = load_thinker_config(thinker_dir)
    files, prefix = thinker_tensor_files(thinker_dir)

    # thinker name -> exported name ("model.*" and "lm_head.weight" only)
    rename: dict[str, str] = {}
    for name in files:
        local = name[len(prefix):]
        if local.startswith("model.") or local == "lm_head.weight":
            rename[name] = local
    if f"{prefix}model.embed_tokens.weight" not in rename:
        raise ValueError(f"{thinker_dir}: no thinker text model weights ({prefix}model.embed_tokens.weight)")
    tied = f"{prefix}lm_head.weight" not in rename

    sizes: dict[str, int] = {}
    dtype = "float32"
    for name in rename:
        with safe_open(files[name], "pt") as f:
            sl = f.get_slice(name)
            n = 1
            for d in sl.get_shape():
                n *= d
            sizes[name] = n * _DTYPE_BYTES.get(sl.get_dtype(), 4)
            if name.endswith("embed_tokens.weight"):
                dtype = _SAFETENSORS_DTYPE.get(sl.get_dtype(), "float32")

    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards, start=1):
        shard_name = ("model.safetensors" if len(shards) == 1
                      else f"model-{i:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        for name in names:
            with safe_open(files[name], "pt") as f:
                tensors[rename[name]] = f.get_tensor(name).contiguous()
            weight_map[rename[name]] = shard_name
        save_file(tensors, str(out / shard_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    config = qwen2_config_from_thinker(thinker_config, tie_word_embeddings=tied, dtype=dtype)
    config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(thinker_dir)
    tokenizer.save_pretrained(out)
    try:
        generation = GenerationConfig.from_pretrained(thinker_dir)
    except OSError:  # no generation_config.json: stop on the tokenizer's eos
        generation = GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                                      eos_token_id=config.eos_token_id or tokenizer.eos_token_id)
    generation.save_pretrained(out)
    logger.info("exported %d thinker LM tensors from %s to %s", len(rename), thinker_dir, out)

"""Tiny random-weight Qwen2.5-Omni checkpoints: a thinker alone, and the whole model.

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
- `build_omni_checkpoint(out, token2wav_dir=...)` writes the whole
  `Qwen2_5OmniForConditionalGeneration` (that thinker, a talker, Token2Wav)
  in the hub's layout, `spk_dict.pt` included: the folder a user downloads,
  which every omni stage reads its part of.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_tools.tiny_models import DEFAULT_SEED
from omni_tools.tiny_tokenizer import (
    IM_END,
    IM_START,
    build_tokenizer,
    padded_vocab_size,
    special_ids,
)

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
TINY_VISION_HIDDEN = 96  # 2 heads of 48; the real towers have 16 heads of 80
# Qwen2-VL image processor: sides are multiples of patch 14 x merge 2 = 28;
# 4 to 32 merged tokens (each 28x28 pixels) per image.
TINY_MIN_PIXELS = 28 * 28 * 4
TINY_MAX_PIXELS = 28 * 28 * 32
# Whisper features: 128 mel bins at 16 kHz, 100 frames/s; 1 s of audio -> 25 tokens.
# As the real Qwen2.5-Omni: the processor takes clips up to 300 s.
TINY_AUDIO_CHUNK_SECONDS = 300
# The thinker's text model with Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads of
# 64, 2 KV heads, its 151936-token vocabulary): per-token compute as a small real LM, for
# benchmarks (omni-bench transformers). Head dim 64, so TINY_MROPE_SECTION still fits; the
# narrow init keeps 24 random layers finite; the head stays untied, as the tiny one.
QWEN25_05B_TEXT: dict[str, Any] = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "initializer_range": 0.02,
}
THINKER_SHAPES: dict[str, dict[str, Any]] = {"tiny": {}, "0.5b": QWEN25_05B_TEXT}



# --------------------------------------------------------------------------
# tiny thinker
# --------------------------------------------------------------------------


def build_omni_tokenizer(model_max_length: int = TINY_MAX_LEN) -> PreTrainedTokenizerBase:
    """The tiny byte-level BPE (tiny_tokenizer.build_tokenizer) with Qwen2.5-Omni's special tokens.

    Ids: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2, the BPE vocabulary,
    then the OMNI_SPECIAL_TOKENS in their order.
    """
    return build_tokenizer(
        model_max_length,
        extra_special_tokens={"im_start_token": IM_START, "im_end_token": IM_END,
                              **OMNI_SPECIAL_TOKENS},
        chat_template=OMNI_CHAT_TEMPLATE,
    )


def tiny_thinker_config(tokenizer: PreTrainedTokenizerBase, shape: str = "tiny") -> Any:
    """The tiny Qwen2_5OmniThinkerConfig, its token ids taken from `tokenizer`.

    `shape` "0.5b": the text model takes QWEN25_05B_TEXT's shapes (towers stay tiny).
    """
    from transformers import Qwen2_5OmniThinkerConfig

    ids = special_ids(tokenizer)
    tok = tokenizer.convert_tokens_to_ids
    text = {
        "vocab_size": padded_vocab_size(tokenizer),
        "hidden_size": TINY_TEXT_HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        # Untied head and a wide init (as qwen2-tiny): greedy output varies.
        "initializer_range": 0.5,
        **THINKER_SHAPES[shape],
    }
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    config = Qwen2_5OmniThinkerConfig(
        text_config={
            **text,
            "max_position_embeddings": TINY_MAX_LEN,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": list(TINY_MROPE_SECTION),
            },
            "tie_word_embeddings": False,
            **ids,
        },
        vision_config={
            "depth": 2,
            "hidden_size": TINY_VISION_HIDDEN,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": hidden,
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
            "output_dim": hidden,
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
        initializer_range=text["initializer_range"],
        **ids,
    )
    if hidden // heads != 2 * sum(TINY_MROPE_SECTION):
        raise ValueError("mrope_section must sum to head_dim / 2")
    config.architectures = ["Qwen2_5OmniThinkerForConditionalGeneration"]
    config.dtype = "float32"
    return config


def save_preprocessor_config(out: Path, *, min_pixels: int = TINY_MIN_PIXELS,
                             max_pixels: int = TINY_MAX_PIXELS,
                             chunk_seconds: int = TINY_AUDIO_CHUNK_SECONDS) -> None:
    """One preprocessor_config.json for images and audio, laid out as Qwen2.5-Omni's.

    `Qwen2_5OmniProcessor.from_pretrained(out)` reads it: its image processor
    (`image_processor_type` Qwen2VLImageProcessor, the torchvision one; the
    PIL class here only writes the shared settings) and its
    `WhisperFeatureExtractor`.
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


def _save_thinker_files(out: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """What a thinker folder holds besides its weights: generation config, tokenizer, processor."""
    from transformers import GenerationConfig

    ids = special_ids(tokenizer)
    GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]],
        pad_token_id=ids["pad_token_id"],
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_preprocessor_config(out)


def build_omni_thinker(out: Path, *, seed: int = DEFAULT_SEED) -> None:
    """Write a tiny Qwen2_5OmniThinkerForConditionalGeneration checkpoint into `out`.

    Text model: hidden 128, 2 layers, 2 heads of 64, 1 KV head, M-RoPE
    sections (8, 12, 12). Vision tower: depth 2, hidden 32, patch 14, merge 2.
    Audio tower: 2 layers, d_model 32, 128 mel bins. Random weights (fixed
    seed), tokenizer, generation config and preprocessor config.
    """
    import torch
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_omni_tokenizer(TINY_MAX_LEN)
    config = tiny_thinker_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    del model
    _save_thinker_files(out, tokenizer)


# --------------------------------------------------------------------------
# the full Qwen2.5-Omni checkpoint
# --------------------------------------------------------------------------

# Talker ids (the real model: codes 0..8191, pad 8292, bos 8293, eos 8294, mask 8296 in a
# vocabulary of 8448); the tiny one keeps the layout with TINY_CODEC_CODES codes.
TINY_CODEC_CODES = 512
TINY_TALKER_IDS = {"vocab_size": 576, "tts_codec_pad_token_id": 516,
                   "tts_codec_start_token_id": 517, "tts_codec_end_token_id": 518,
                   "tts_codec_mask_token_id": 520}
# The talker keeps the real 7B's quirk: head_dim (here 64) is not hidden / heads (64 / 2),
# as Qwen2.5-Omni-7B's talker has 12 heads of 128 in a hidden 896 (mrope_section [16, 24, 24]).
TINY_TALKER_HEAD_DIM = 64
TINY_TALKER_MROPE_SECTION = (8, 12, 12)  # sums to TINY_TALKER_HEAD_DIM / 2
VOICE_BOS = {"Chelsie": -5, "Ethan": -4}  # spk_dict bos_token: offset from the thinker vocab end


def tiny_omni_config(thinker_config: Any) -> Any:
    """A Qwen2_5OmniConfig: `thinker_config`, a tiny talker and the tiny Token2Wav.

    Every part says float32, as a real checkpoint says bfloat16: vLLM reads the
    dtype of the text config when `dtype` is "auto".
    """
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniToken2WavConfig

    from omni_tools import tiny_token2wav

    vocab = thinker_config.text_config.vocab_size
    media_ids = {name: getattr(thinker_config, name) for name in (
        "audio_token_index", "image_token_index", "video_token_index", "vision_start_token_id",
        "vision_end_token_id", "audio_start_token_id", "audio_end_token_id")}
    talker = dict(
        **media_ids, **TINY_TALKER_IDS,
        # the thinker's text tokens the talker reads: unused ids at the end of its vocabulary
        tts_text_start_token_id=vocab - 3, tts_text_end_token_id=vocab - 2,
        tts_text_pad_token_id=vocab - 1,
        embedding_size=thinker_config.text_config.hidden_size, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=TINY_TALKER_HEAD_DIM, max_position_embeddings=TINY_MAX_LEN, max_window_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": list(TINY_TALKER_MROPE_SECTION)},
        initializer_range=0.5, dtype="float32")
    token2wav = Qwen2_5OmniToken2WavConfig(
        dit_config=dict(tiny_token2wav.TINY_DIT, num_embeds=TINY_CODEC_CODES + 1),
        bigvgan_config=dict(tiny_token2wav.TINY_BIGVGAN))
    thinker = thinker_config.to_dict()
    thinker["dtype"] = "float32"
    thinker["text_config"]["dtype"] = "float32"
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                               token2wav_config={**token2wav.to_dict(), "dtype": "float32"},
                               enable_audio_output=True)
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    config.dtype = "float32"
    return config


def quiet_non_audio_codes(talker: Any, audio_codes: int) -> None:
    """Zero the talker's codec-head rows of ids that are neither audio codes nor its stops.

    A real talker never emits them (Token2Wav has no embedding for them); a
    random one would, about one step in nine. With zero rows their logit is 0
    while the audio codes' spread around it (std ~4), so greedy and sampled
    decoding keep to audio codes, codec pad and codec end, as a trained one.
    """
    import torch

    cfg = talker.config
    keep = set(range(audio_codes)) | {cfg.tts_codec_pad_token_id, cfg.tts_codec_end_token_id}
    with torch.no_grad():
        for i in range(cfg.vocab_size):
            if i not in keep:
                talker.codec_head.weight[i].zero_()


def build_omni_checkpoint(out: Path, *, token2wav_dir: Path, seed: int = DEFAULT_SEED,
                          thinker_shape: str = "tiny") -> None:
    """Write a tiny Qwen2_5OmniForConditionalGeneration checkpoint into `out`, in the hub layout.

    `config.json` (Qwen2_5OmniConfig), one `model.safetensors` with the
    `thinker.*`, `talker.*` and `token2wav.*` weights, `spk_dict.pt` (voice ->
    `cond`, `ref_mel`, `bos_token`), `generation_config.json`, the tokenizer
    and `preprocessor_config.json` (Qwen2_5OmniProcessor's image and audio
    settings). The thinker is the one `build_omni_thinker` draws (same seed),
    the Token2Wav and voices are the ones in `token2wav_dir`
    (tiny_token2wav.build_token2wav), the talker is drawn here. `thinker_shape`
    "0.5b": the thinker's text model has Qwen2.5-0.5B's shapes (tiny_thinker_config).
    """
    import torch
    from safetensors.torch import load_file
    from transformers import (
        Qwen2_5OmniForConditionalGeneration,
        Qwen2_5OmniThinkerForConditionalGeneration,
        Qwen2_5OmniToken2WavModel,
    )

    from omni_serve.families.qwen2_5_omni.token2wav import SPEAKERS_FILE

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_omni_tokenizer(TINY_MAX_LEN)
    thinker_config = tiny_thinker_config(tokenizer, thinker_shape)
    config = tiny_omni_config(thinker_config)
    torch.manual_seed(seed)
    thinker = Qwen2_5OmniThinkerForConditionalGeneration(thinker_config).eval()
    torch.manual_seed(seed + 11)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    model.thinker.load_state_dict(thinker.state_dict())
    del thinker
    token2wav = Qwen2_5OmniToken2WavModel.from_pretrained(token2wav_dir)
    model.token2wav.load_state_dict(token2wav.state_dict())
    quiet_non_audio_codes(model.talker, TINY_CODEC_CODES)
    model.save_pretrained(out, safe_serialization=True)
    vocab = config.thinker_config.text_config.vocab_size
    voices = load_file(str(Path(token2wav_dir) / SPEAKERS_FILE))
    torch.save({name: {"cond": voices[f"{name}.cond"], "ref_mel": voices[f"{name}.ref_mel"],
                       "bos_token": vocab + offset} for name, offset in VOICE_BOS.items()},
               out / "spk_dict.pt")
    _save_thinker_files(out, tokenizer)

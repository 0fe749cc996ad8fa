"""Tiny random-weight models of real architectures, built locally from configs.

Where it runs: in the set-up / user process (`omni-build-tiny`), in the
repository generator (which needs the embedded default's model paths, via
`ensure_model`) and in tests (fixtures). Never inside tritonserver: the
server only reads the directories this module writes.

What it produces: `<cache>/<name>/`, a Hugging Face checkpoint directory
(config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, chat template) that loads with
`AutoModelForCausalLM.from_pretrained(path)` / `AutoTokenizer.from_pretrained(path)`
and with vLLM, exactly like a user's real checkpoint. Nothing is downloaded:
the tokenizer is a byte-level BPE trained locally (omni_tools.tiny_tokenizer)
on a corpus generated in code (omni_tools.tiny_corpus), and the weights are
random with a fixed seed, so every build is identical. The Qwen2.5-Omni
parts are drawn by omni_tools.tiny_omni and tiny_token2wav.

This module is the registry (name -> builder and recipe version), the
builders of the Qwen2 LMs and the Qwen-Image pipeline, and the CLI. The
cache itself is omni_tools.model_cache: `$OMNI_MODEL_CACHE` or
`~/.cache/omni-triton/models`, each model built once (into a temporary
directory in the cache, then renamed) under a file lock, so concurrent
processes never build the same model twice, and rebuilt when its recipe id
(`RECIPE_VERSION` and the model's own version) changes.

Adding an architecture: write a `_build_<arch>(out: Path) -> None` function
and register it with `@register("<name>")`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_tools.model_cache import Builder, build_once, cache_dir
from omni_tools.tiny_tokenizer import build_tokenizer, padded_vocab_size, special_ids

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI's --help must be instant
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

# Bump to rebuild every cached model (changes shared by all recipes, e.g. the
# tokenizer or the marker format). Per-model changes bump that model's version.
RECIPE_VERSION = 1
DEFAULT_SEED = 0


@dataclass(frozen=True)
class TinyModel:
    """A registered model: how to build it and the version of that recipe."""

    name: str
    build: Builder
    version: int = 1
    description: str = ""


TINY_MODELS: dict[str, TinyModel] = {}
DEFAULT_MODELS = ("qwen2-tiny",)


def register(name: str, *, version: int = 1, description: str = "") -> Callable[[Builder], Builder]:
    """Decorator: add a builder `fn(out_dir)` to TINY_MODELS under `name`."""

    def deco(fn: Builder) -> Builder:
        if name in TINY_MODELS:
            raise ValueError(f"tiny model {name!r} registered twice")
        TINY_MODELS[name] = TinyModel(name, fn, version, description or (fn.__doc__ or "").strip())
        return fn

    return deco


def recipe_id(name: str) -> str:
    """The recipe a build of `name` is marked with: the shared and the model's version."""
    return f"{RECIPE_VERSION}.{TINY_MODELS[name].version}"


def ensure_model(name: str, *, cache: Path | None = None, force: bool = False) -> Path:
    """Build tiny model `name` into `<cache>/<name>/` once and return that path.

    Reuses a complete build of the current recipe; `force=True` rebuilds.
    Safe to call from several processes at once (model_cache.build_once).
    """
    if name not in TINY_MODELS:
        known = ", ".join(sorted(TINY_MODELS))
        raise ValueError(f"unknown tiny model {name!r}; known models: {known}")
    return build_once(name, recipe_id(name), TINY_MODELS[name].build, cache=cache, force=force)


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------


def _save_causal_lm(
    out: Path,
    config: PreTrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = DEFAULT_SEED,
) -> None:
    """Random-init a causal LM from config (fixed seed) and save it with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    ids = special_ids(tokenizer)
    generation = GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        # Stop on the chat end and on the document end, as Qwen2.5 instruct does.
        eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]],
        pad_token_id=ids["pad_token_id"],
    )
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model


def _qwen2_config(tokenizer: PreTrainedTokenizerBase, **shape: Any) -> PreTrainedConfig:
    from transformers import Qwen2Config

    rope_theta = float(shape.pop("rope_theta", 10000.0))
    shape.setdefault("vocab_size", padded_vocab_size(tokenizer))
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    if head_dim * shape["num_attention_heads"] != shape["hidden_size"]:
        raise ValueError("hidden_size must be a multiple of num_attention_heads")
    if shape["vocab_size"] < len(tokenizer):
        raise ValueError("vocab_size smaller than the tokenizer")
    config = Qwen2Config(
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        max_window_layers=shape["num_hidden_layers"],
        tie_word_embeddings=shape.pop("tie_word_embeddings", True),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        dtype="float32",  # vLLM on CPU then loads fp32 (it reads config.dtype)
        **special_ids(tokenizer),
        **shape,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return config


@register("qwen2-tiny", version=2, description="Qwen2, hidden 128, 2 layers, head_dim 64")
def _build_qwen2_tiny(out: Path) -> None:
    """Qwen2ForCausalLM, hidden 128, 2 layers, 2 heads of 64, 1 KV head (GQA)."""
    max_len = 4096
    tokenizer = build_tokenizer(max_len)
    config = _qwen2_config(
        tokenizer,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        max_position_embeddings=max_len,
        # Untied head and a wide init: greedy output varies from token to token
        # instead of echoing the last prompt token, so text comparisons in
        # tests mean something.
        tie_word_embeddings=False,
        initializer_range=0.5,
    )
    _save_causal_lm(out, config, tokenizer)


@register("qwen2.5-0.5b-random", version=1, description="Qwen2.5-0.5B shapes, random weights")
def _build_qwen25_05b_random(out: Path) -> None:
    """Qwen2.5-0.5B shapes (~494M params, ~2 GB fp32), random weights, tiny tokenizer."""
    max_len = 32768
    tokenizer = build_tokenizer(max_len)
    config = _qwen2_config(
        tokenizer,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=max_len,
        rope_theta=1000000.0,
    )
    _save_causal_lm(out, config, tokenizer)


# --------------------------------------------------------------------------
# omni-chat: the whole Qwen2.5-Omni (thinker, talker, Token2Wav)
# --------------------------------------------------------------------------

OMNI_CODEC_VOCAB = 512


@register("qwen2.5-omni-tiny", version=5,
          description="Qwen2.5-Omni (thinker with vision+audio towers, talker, Token2Wav), hub layout")
def _build_qwen25_omni_tiny(out: Path) -> None:
    """The folder is a whole `Qwen2_5OmniForConditionalGeneration` checkpoint as the hub ships
    one (config.json, model.safetensors with thinker.*/talker.*/token2wav.*, spk_dict.pt,
    tokenizer and processor files): every omni-chat stage reads its part of it.
    token2wav/ is the Token2Wav the builder draws first (also in the audio stage's
    stand-alone layout).
    """
    from omni_tools import tiny_omni, tiny_token2wav

    tiny_token2wav.build_token2wav(out / "token2wav", codec_vocab=OMNI_CODEC_VOCAB)
    tiny_omni.build_omni_checkpoint(out, token2wav_dir=out / "token2wav")


@register("qwen2.5-omni-0.5b-random", version=1,
          description="Qwen2.5-Omni whose thinker has Qwen2.5-0.5B's text shapes (~2.5 GB fp32)")
def _build_qwen25_omni_05b_random(out: Path) -> None:
    """qwen2.5-omni-tiny's layout and towers, talker and Token2Wav, but the thinker's text
    model has Qwen2.5-0.5B's shapes (tiny_omni.QWEN25_05B_TEXT; untied head, ~630M
    parameters): per-token compute as a small real model, for benchmarks."""
    from omni_tools import tiny_omni, tiny_token2wav

    tiny_token2wav.build_token2wav(out / "token2wav", codec_vocab=OMNI_CODEC_VOCAB)
    tiny_omni.build_omni_checkpoint(out, token2wav_dir=out / "token2wav", thinker_shape="0.5b")


@register("qwen3-omni-tiny", version=3,
          description="Qwen3-Omni Instruct (MoE thinker, vision+AuT towers, MoE talker, Code2Wav), "
                      "hub layout")
def _build_qwen3_omni_tiny(out: Path) -> None:
    """A whole tiny `Qwen3OmniMoeForConditionalGeneration` checkpoint as the hub ships the
    Instruct model (tiny_qwen3_omni): thinker.*, talker.*, code2wav.*, tokenizer, processor files."""
    from omni_tools import tiny_qwen3_omni

    tiny_qwen3_omni.build_qwen3_omni_checkpoint(out)


@register("qwen3-omni-moe-small-random", version=1,
          description="Qwen3-Omni whose thinker has a real MoE shape scaled down (32 experts top-8, "
                      "hidden 1024, 10 layers; ~1.7 GB fp32)")
def _build_qwen3_omni_moe_small_random(out: Path) -> None:
    """qwen3-omni-tiny's layout and towers, talker and Code2Wav, but the thinker's text model is
    the real MoE at half its width with 10 layers and 32 experts, top-8
    (tiny_qwen3_omni.MOE_SMALL_TEXT; ~430M parameters, tiny tokenizer): per-token compute that
    matters, for benchmarks. The talker's routed experts are drawn (qwen3-omni-tiny keeps
    transformers' unset ones)."""
    from omni_tools import tiny_qwen3_omni

    tiny_qwen3_omni.build_qwen3_omni_checkpoint(out, thinker_shape="moe-small", talker_experts=True)


@register("qwen3-omni-thinking-tiny", version=3,
          description="Qwen3-Omni Thinking/Captioner layout: enable_audio_output false, thinker only")
def _build_qwen3_omni_thinking_tiny(out: Path) -> None:
    """qwen3-omni-tiny's thinker (same weights) in a talker-less folder, as the hub ships the
    Thinking and Captioner models."""
    from omni_tools import tiny_qwen3_omni

    tiny_qwen3_omni.build_qwen3_omni_checkpoint(out, talker=False)


# --------------------------------------------------------------------------
# diffusion pipelines
# --------------------------------------------------------------------------

# QwenImagePipeline wraps every prompt in this template and drops the first
# QWEN_IMAGE_TEMPLATE_DROP hidden states (the system part), counted in tokens
# of the *real* Qwen2.5 tokenizer, where each pre-token of the prefix is one
# token. The tiny tokenizer is trained with the prefix repeated so the same
# holds for it; the builder checks both against the installed diffusers.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_TEMPLATE_DROP = 34
QWEN_IMAGE_SCHEDULER = {  # Qwen/Qwen-Image scheduler/scheduler_config.json
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


def qwen_image_template_prefix_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of the template part the pipeline drops (everything before the prompt)."""
    return tokenizer(QWEN_IMAGE_TEMPLATE.split("{}")[0])["input_ids"]


def _check_qwen_image_template(pipe: Any) -> None:
    if pipe.prompt_template_encode != QWEN_IMAGE_TEMPLATE:
        raise RuntimeError("diffusers' Qwen-Image prompt template changed; update the recipe")
    drop = pipe.prompt_template_encode_start_idx
    prefix = qwen_image_template_prefix_ids(pipe.tokenizer)
    full = pipe.tokenizer(QWEN_IMAGE_TEMPLATE.format("a red cat"))["input_ids"]
    if len(prefix) != drop or full[:drop] != prefix:
        raise RuntimeError(
            f"tiny tokenizer encodes the template prefix in {len(prefix)} tokens; "
            f"the pipeline drops {drop}"
        )


@register("qwen-image-tiny", version=1, description="Qwen-Image pipeline, random weights, 64x64")
def _build_qwen_image_tiny(out: Path) -> None:
    """diffusers QwenImagePipeline: 2-layer DiT, 4-channel VAE, tiny Qwen2.5-VL encoder."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    max_len = 1024 + QWEN_IMAGE_TEMPLATE_DROP  # pipeline's tokenizer_max_length + drop
    prefix = QWEN_IMAGE_TEMPLATE.split("{}")[0]
    tokenizer = build_tokenizer(max_len, extra_text=(prefix,) * 200)
    text_hidden = 16
    torch.manual_seed(DEFAULT_SEED)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,  # 4 x VAE z_dim (2x2 latent patches)
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=text_hidden,
        axes_dims_rope=(8, 4, 4),  # sums to attention_head_dim
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    ids = special_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": padded_vocab_size(tokenizer),
            "hidden_size": text_hidden,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": max_len,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [1, 1, 2],  # sums to head_dim / 2
            },
            **ids,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": text_hidden,
            "fullatt_block_indexes": [1],
        },
        tie_word_embeddings=False,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    _check_qwen_image_template(pipe)
    pipe.save_pretrained(out, safe_serialization=True)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """omni-build-tiny [NAME ...] [--all] [--cache DIR] [--force]: build and print paths."""
    parser = argparse.ArgumentParser(
        prog="omni-build-tiny",
        description="Build tiny random-weight models (no downloads) and print their paths.",
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"models to build (default: {', '.join(DEFAULT_MODELS)}); "
        f"known: {', '.join(TINY_MODELS)}",
    )
    parser.add_argument("--all", action="store_true", help="build every known model")
    parser.add_argument(
        "--cache", type=Path, default=None, help=f"cache dir (default: {cache_dir()})"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("-q", "--quiet", action="store_true", help="only print the paths")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    names = list(TINY_MODELS) if args.all else (args.names or list(DEFAULT_MODELS))
    for name in names:
        try:
            path = ensure_model(name, cache=args.cache, force=args.force)
        except ValueError as exc:
            parser.error(str(exc))
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

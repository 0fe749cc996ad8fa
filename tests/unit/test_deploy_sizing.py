"""The sizing table of docs/deploy.md, computed: each model built at full size on the meta
device from tests/unit/full_configs (the hub's config.json values), its parameters counted,
bf16 weight bytes, the KV cache per token of its vLLM engines from the configs, and how many
tokens of KV cache fit beside the weights on 24/48/80/141 GB GPUs.

Where it runs: in the pytest process, on meta (no memory, no weights, ~20 s). Run it as a
script to print the table: `python -m tests.unit.test_deploy_sizing`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.unit.test_full_size_shapes import hub_config, qwen_image_components

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs" / "deploy.md"
BF16 = 2  # bytes per parameter and per KV element
GPUS_GB = (24, 48, 80, 141)
# What a GPU gives vLLM (gpu_memory_utilization 0.9) before the torch stages' and CUDA
# contexts' share: the rest of a 0.9 budget after weights is KV cache.
UTILIZATION = 0.9
GB = 1e9


@dataclass(frozen=True)
class Part:
    name: str
    params: int
    kv_bytes_per_token: int = 0  # 0: no KV cache (encoders, decoders, the DiT)


def _params(module: torch.nn.Module, prefix: str = "") -> int:
    return sum(p.numel() for n, p in module.named_parameters() if n.startswith(prefix))


def _kv(text_config) -> int:
    """K and V of every layer for one token, bf16."""
    head = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads)
    return 2 * text_config.num_hidden_layers * text_config.num_key_value_heads * head * BF16


def qwen2_5_omni_7b() -> list[Part]:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    config = Qwen2_5OmniConfig(**hub_config("qwen2_5_omni_7b.json"))
    with torch.device("meta"):
        m = Qwen2_5OmniForConditionalGeneration._from_config(config)
    thinker = config.thinker_config.text_config
    return [Part("thinker (LLM)", _params(m, "thinker.model.") + _params(m, "thinker.lm_head."),
                 _kv(thinker)),
            Part("vision encoder", _params(m, "thinker.visual.")),
            Part("audio encoder", _params(m, "thinker.audio_tower.")),
            Part("talker", _params(m, "talker."), _kv(config.talker_config)),
            Part("token2wav", _params(m, "token2wav."))]


def qwen3_omni_30b_a3b() -> list[Part]:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    config = Qwen3OmniMoeConfig(**hub_config("qwen3_omni_30b_a3b_instruct.json"))
    with torch.device("meta"):
        m = Qwen3OmniMoeForConditionalGeneration._from_config(config)
    talker = config.talker_config.text_config
    return [Part("thinker (MoE LLM)", _params(m, "thinker.model.") + _params(m, "thinker.lm_head."),
                 _kv(config.thinker_config.text_config)),
            Part("vision encoder", _params(m, "thinker.visual.")),
            Part("audio encoder", _params(m, "thinker.audio_tower.")),
            Part("talker (MoE) + code predictor", _params(m, "talker."), _kv(talker)),
            Part("code2wav", _params(m, "code2wav."))]


def qwen_image() -> list[Part]:
    parts = qwen_image_components()
    return [Part("transformer (DiT)", _params(parts["transformer"])),
            Part("text encoder (Qwen2.5-VL)", _params(parts["text_encoder"])),
            Part("VAE", _params(parts["vae"]))]


MODELS = {"Qwen2.5-Omni-7B": qwen2_5_omni_7b, "Qwen3-Omni-30B-A3B-Instruct": qwen3_omni_30b_a3b,
          "Qwen-Image": qwen_image}


def kv_tokens(parts: list[Part], gpu_gb: int) -> int | None:
    """Tokens of KV cache (thinker + talker per token) beside all weights on one GPU of
    `gpu_gb`, at UTILIZATION; None when the weights do not fit."""
    weights = sum(p.params for p in parts) * BF16
    free = gpu_gb * GB * UTILIZATION - weights
    per_token = sum(p.kv_bytes_per_token for p in parts)
    if free <= 0:
        return None
    return int(free // per_token) if per_token else -1


def rows() -> list[str]:
    """The table's rows: model | part | params (B) | bf16 weights (GB) | KV KiB/token."""
    out = []
    for model, build in MODELS.items():
        parts = build()
        for p in parts:
            kv = f"{p.kv_bytes_per_token / 1024:g}" if p.kv_bytes_per_token else "-"
            out.append(f"| {model} | {p.name} | {p.params / 1e9:.2f} | {p.params * BF16 / GB:.1f} | {kv} |")
        total = sum(p.params for p in parts)
        fits = []
        for gpu in GPUS_GB:
            tokens = kv_tokens(parts, gpu)
            fits.append("no" if tokens is None else "yes" if tokens < 0 else f"{tokens // 1000}k")
        out.append(f"| {model} | **all, one GPU** | {total / 1e9:.2f} | {total * BF16 / GB:.1f} | "
                   f"KV tokens on {'/'.join(map(str, GPUS_GB))} GB: {' / '.join(fits)} |")
    return out


_ROWS: list[str] = []


def rows_for(model: str) -> list[str]:
    """The computed rows of one model (all models are built once per session)."""
    if not _ROWS:
        _ROWS.extend(rows())
    return [r for r in _ROWS if r.startswith(f"| {model} |")]


@pytest.mark.parametrize("model", list(MODELS))
def test_the_deploy_sizing_table_is_what_the_configs_give(model):
    text = DEPLOY.read_text(encoding="utf-8")
    want = rows_for(model)
    missing = [r for r in want if r not in text]
    assert want and not missing, ("docs/deploy.md sizing rows differ from the configs; the "
                                  "computed rows:\n" + "\n".join(want))


def test_the_published_totals_are_in_range():
    # the hub's own model cards: Qwen2.5-Omni-7B ~10.7B, Qwen3-Omni ~35B (30B-A3B thinker), Qwen-Image 20B DiT
    totals = {m: float(re.search(r"\*\*all, one GPU\*\* \| ([\d.]+)", r).group(1))
              for m in MODELS for r in rows_for(m) if "**all" in r}
    assert 10.0 < totals["Qwen2.5-Omni-7B"] < 11.5, totals
    assert 30.0 < totals["Qwen3-Omni-30B-A3B-Instruct"] < 40.0, totals
    assert 25.0 < totals["Qwen-Image"] < 30.0, totals


if __name__ == "__main__":
    print("\n".join(rows()))

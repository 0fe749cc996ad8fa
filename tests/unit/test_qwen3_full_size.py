"""Qwen3-Omni at full size on meta: vLLM's thinker takes the hub's tensors, the tiny keeps the quirks.

Where it runs: in the pytest process, on the meta device (no memory, no weight files, ~15 s).
What flows through it: full_configs/qwen3_omni_30b_a3b_instruct.json (the hub's config.json of
Qwen/Qwen3-Omni-30B-A3B-Instruct; its .md names the sources), the tensors transformers writes for
it (names and shapes as the hub's safetensors hold them: experts one by one), and the tiny
checkpoint `omni-build-tiny qwen3-omni-tiny` writes.

Two checks. vLLM 0.32's native `Qwen3OmniMoeThinkerForConditionalGeneration`, built for the
whole-model folder as an engine builds it, loads every `thinker.*` tensor into a slot of its
shape and leaves none of its parameters unwritten (test_full_size_shapes.LoadTrace). And the
tiny checkpoint has the structural quirks of the real one (head_dim vs hidden / heads, 16 code
groups, 1920 samples a frame, the talker's gated shared expert, deepstack, ...), so goldens on
it exercise the code paths the 30B takes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import omni_tools.tiny_models as tm
from tests.unit.test_full_size_shapes import (  # noqa: F401  (vllm_world is a fixture)
    checkpoint_tensors,
    hub_config,
    load_vllm_model,
    vllm_world,
)

FULL = "qwen3_omni_30b_a3b_instruct.json"


@pytest.fixture(scope="module")
def full() -> tuple[dict, dict[str, torch.Tensor]]:
    """(the hub's config.json, its tensors on meta, named as the hub's safetensors name them)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    raw = hub_config(FULL)
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(Qwen3OmniMoeConfig(**raw))
    return raw, revert_weight_conversion(model, checkpoint_tensors(model))


@pytest.fixture(scope="module")
def tiny() -> tuple[dict, dict[str, tuple[int, ...]]]:
    folder = tm.ensure_model("qwen3-omni-tiny")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    return json.loads((folder / "config.json").read_text()), shapes


def quirks(raw: dict, names: set[str]) -> dict[str, object]:
    """The structural facts of a Qwen3-Omni checkpoint that the served code depends on."""
    from transformers import Qwen3OmniMoeConfig

    config = Qwen3OmniMoeConfig(**raw)
    thinker, talker, c2w = config.thinker_config, config.talker_config, config.code2wav_config
    text, talk, pred, vision = (thinker.text_config, talker.text_config, talker.code_predictor_config,
                                thinker.vision_config)
    codebook = c2w.codebook_size
    codec_ids = [talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id,
                 talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id]
    return {
        "thinker head_dim * heads != hidden": text.head_dim * text.num_attention_heads != text.hidden_size,
        "talker head_dim * heads != hidden": talk.head_dim * talk.num_attention_heads != talk.hidden_size,
        "predictor head_dim * heads != hidden": pred.head_dim * pred.num_attention_heads != pred.hidden_size,
        "thinker mrope: interleaved, sums to head_dim / 2": (
            bool(text.rope_parameters.get("interleaved")),
            bool(text.rope_parameters.get("mrope_interleaved")),
            2 * sum(text.rope_parameters["mrope_section"]) == text.head_dim),
        "talker mrope: interleaved, sums to head_dim / 2": (
            bool(talk.rope_parameters.get("interleaved")),
            2 * sum(talk.rope_parameters["mrope_section"]) == talk.head_dim),
        "thinker top-k > 1, normalized": (text.num_experts_per_tok > 1, text.norm_topk_prob),
        "talker top-k > 1, normalized": (talk.num_experts_per_tok > 1, talk.norm_topk_prob),
        "thinker shared expert": any(".mlp.shared_expert" in n for n in names if n.startswith("thinker.")),
        "talker gated shared expert": "talker.model.layers.0.mlp.shared_expert_gate.weight" in names,
        "qk-norm": {"thinker.model.layers.0.self_attn.q_norm.weight",
                    "talker.model.layers.0.self_attn.q_norm.weight"} <= names,
        "untied thinker head": (not thinker.tie_word_embeddings, not text.tie_word_embeddings,
                                "thinker.lm_head.weight" in names),
        "deepstack levels": len(vision.deepstack_visual_indexes),
        "deepstack inside the tower, last block not one": (
            max(vision.deepstack_visual_indexes) < vision.depth - 1),
        "deepstack mergers": sum(f"thinker.visual.merger_list.{i}.ln_q.weight" in names
                                 for i in range(len(vision.deepstack_visual_indexes))),
        "vision patch, merge, temporal patch": (vision.patch_size, vision.spatial_merge_size,
                                                vision.temporal_patch_size),
        "vision position grid = image_size / patch": (
            math.isqrt(vision.num_position_embeddings) ** 2 == vision.num_position_embeddings
            and vision.image_size // vision.patch_size == math.isqrt(vision.num_position_embeddings)),
        "code groups": (talker.num_code_groups, pred.num_code_groups, c2w.num_quantizers),
        "code predictor heads": sum(n.startswith("talker.code_predictor.lm_head.") for n in names),
        "samples per frame": math.prod(c2w.upsample_rates + c2w.upsampling_ratios),
        "codebook shared by predictor and Code2Wav": pred.vocab_size == codebook,
        "talker vocabulary above the codebook": talk.vocab_size - codebook,
        "codec ids above the codebook": [i - codebook for i in codec_ids],
        "voices above the codebook": {k: v - codebook for k, v in talker.speaker_id.items()},
        "talker reads a thinker layer": 0 < talker.accept_hidden_layer < text.num_hidden_layers,
        "talker input width": talker.thinker_hidden_size == text.hidden_size,
        "position ids per second, seconds per chunk": (thinker.position_id_per_seconds,
                                                       talker.position_id_per_seconds,
                                                       thinker.seconds_per_chunk),
        "audio windows": (thinker.audio_config.n_window, thinker.audio_config.n_window_infer,
                          thinker.audio_config.num_mel_bins),
    }


def test_the_full_config_has_the_published_figures(full) -> None:
    raw, tensors = full
    assert quirks(raw, set(tensors))["samples per frame"] == 1920
    assert raw["talker_config"]["speaker_id"] == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    total = sum(t.numel() for t in tensors.values())
    assert 35.0e9 < total < 35.5e9, total  # 35.26e9: the 30B-A3B thinker, its towers, talker, Code2Wav


def test_the_tiny_checkpoint_keeps_the_full_models_structural_quirks(full, tiny) -> None:
    want = quirks(full[0], set(full[1]))
    got = quirks(tiny[0], set(tiny[1]))
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}


def test_tiny_tensors_have_the_full_models_names(full, tiny) -> None:
    """Same tensor names but for the counts (layers, experts, blocks, heads): a loader that reads
    the tiny checkpoint finds every kind of tensor the 30B's files hold, and no other."""
    import re

    def kinds(names):
        return {re.sub(r"\.\d+\.", ".N.", re.sub(r"\.\d+\.", ".N.", n)) for n in names}

    assert kinds(tiny[1]) == kinds(full[1])


@pytest.mark.usefixtures("vllm_world")
def test_vllm_thinker_loads_the_full_size_thinker_tensors(full, tmp_path: Path) -> None:
    from vllm.model_executor.models.qwen3_omni_moe_thinker import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    raw, tensors = full
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(tensors, "model.safetensors")}))
    model, trace = load_vllm_model({"model": str(tmp_path), "skip_tokenizer_init": True}, tensors)
    assert isinstance(model, Qwen3OmniMoeThinkerForConditionalGeneration), type(model)
    assert not trace.problems(model), trace.problems(model)[:10]
    read = trace.read()
    assert {n for n in tensors if n.startswith("thinker.")} == read
    assert {n.split(".")[0] for n in set(tensors) - read} == {"talker", "code2wav"}

"""The benchmark Qwen3-Omni (`qwen3-omni-moe-small-random`): a real MoE shape that vLLM and transformers take.

Where it runs: in the pytest process, on the meta device (no weights, no folder written, seconds;
vLLM's thinker with its gloo world). What flows through it: omni_tools.tiny_qwen3_omni's configs
for `thinker_shape="moe-small"` and "tiny", the tensors transformers writes for them (names and
shapes as the saved folder holds them), vLLM's CPU kernel limits, and the bench's model table.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import omni_tools.tiny_models as tm
from omni_tools import tiny_qwen3_omni as q3
from omni_tools.bench import transformers_baseline as tb
from omni_tools.tiny_tokenizer import padded_vocab_size
from tests.unit.test_full_size_shapes import (  # noqa: F401  (vllm_world is a fixture)
    checkpoint_tensors,
    load_vllm_model,
    vllm_world,
)
from tests.unit.test_qwen3_full_size import quirks

NAME = "qwen3-omni-moe-small-random"


@pytest.fixture(scope="module")
def tokenizer():
    return q3.build_qwen3_omni_tokenizer()


def _on_meta(config) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes for `config` (hub names: experts one by one), on meta."""
    from transformers import Qwen3OmniMoeForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config)
    return revert_weight_conversion(model, checkpoint_tensors(model))


@pytest.fixture(scope="module")
def moe_small(tokenizer) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json of the benchmark model, its tensors on meta)."""
    config = q3.tiny_omni_config(tokenizer, thinker_shape="moe-small")
    return config.to_dict(), _on_meta(config)


def test_the_thinker_text_model_is_the_real_moe_at_half_width(moe_small, tokenizer) -> None:
    raw, _ = moe_small
    text = raw["thinker_config"]["text_config"]
    shape = {k: text[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "moe_intermediate_size",
                                  "num_experts", "num_experts_per_tok")}
    assert shape == {"hidden_size": 1024, "num_hidden_layers": 10, "num_attention_heads": 16,
                     "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 384,
                     "num_experts": 32, "num_experts_per_tok": 8}
    # the real M-RoPE sections at the real head_dim, interleaved as the hub's config says
    assert text["rope_parameters"]["mrope_section"] == [24, 20, 20]
    assert text["rope_parameters"]["interleaved"] and text["rope_parameters"]["mrope_interleaved"]
    # the tiny tokenizer's vocabulary (the real 152064 ids would not fit the size budget)
    assert text["vocab_size"] == padded_vocab_size(tokenizer) >= len(tokenizer)
    # the towers and the talker are fed at the text model's width; media rows from its middle
    thinker, talker = raw["thinker_config"], raw["talker_config"]
    assert thinker["vision_config"]["out_hidden_size"] == thinker["audio_config"]["output_dim"] == 1024
    assert talker["thinker_hidden_size"] == 1024
    assert talker["accept_hidden_layer"] == 5
    assert max(thinker["vision_config"]["deepstack_visual_indexes"]) < text["num_hidden_layers"]


def test_it_keeps_every_structural_quirk_of_the_tiny_and_the_real_checkpoint(moe_small, tokenizer) -> None:
    # test_qwen3_full_size holds the tiny's quirks to the 30B's; the same facts hold here
    raw, tensors = moe_small
    tiny = q3.tiny_omni_config(tokenizer)
    assert quirks(raw, set(tensors)) == quirks(tiny.to_dict(), set(_on_meta(tiny)))


def test_it_fits_beside_a_transformers_copy_on_a_small_machine(moe_small) -> None:
    raw, tensors = moe_small
    total = sum(t.numel() for t in tensors.values())
    thinker = sum(t.numel() for n, t in tensors.items() if n.startswith("thinker."))
    assert 4 * total < 2 * 10**9, total  # fp32 folder under 2 GB: ~1.73 GB
    assert thinker / total > 0.99  # the compute is the thinker's
    text = raw["thinker_config"]["text_config"]
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    experts = sum(t.numel() for n, t in tensors.items()
                  if n.startswith("thinker.model.layers.") and ".mlp.experts." in n)
    assert experts == layers * text["num_experts"] * 3 * hidden * text["moe_intermediate_size"]
    active = experts * text["num_experts_per_tok"] // text["num_experts"]
    assert active > 9 * 10**7  # what top-8 of 32 touches a token: ~94M of ~377M


def test_vllms_cpu_moe_and_attention_kernels_take_its_shapes(moe_small) -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = moe_small[0]["thinker_config"]["text_config"]
    align = math.lcm(CPUUnquantizedExperts.output_alignment, CPUUnquantizedExperts.reduction_alignment)
    assert text["hidden_size"] % align == 0 and text["moe_intermediate_size"] % align == 0
    assert text["head_dim"] in CPUAttentionBackend.get_supported_head_sizes()


@pytest.mark.usefixtures("vllm_world")
def test_vllms_thinker_loads_every_thinker_tensor_into_a_slot_of_its_shape(moe_small, tmp_path: Path) -> None:
    from vllm.model_executor.models.qwen3_omni_moe_thinker import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    raw, tensors = moe_small
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(tensors, "model.safetensors")}))
    model, trace = load_vllm_model({"model": str(tmp_path), "skip_tokenizer_init": True}, tensors)
    assert isinstance(model, Qwen3OmniMoeThinkerForConditionalGeneration), type(model)
    assert not trace.problems(model), trace.problems(model)[:10]
    assert trace.read() == {n for n in tensors if n.startswith("thinker.")}


def test_the_tiny_shape_is_what_the_goldens_were_recorded_on(tokenizer) -> None:
    config = q3.tiny_omni_config(tokenizer)
    text = config.thinker_config.text_config
    assert {k: getattr(text, k) for k in q3.TINY_TEXT} == q3.TINY_TEXT
    assert text.rope_parameters["mrope_section"] == [12, 10, 10]
    assert text.initializer_range == config.thinker_config.initializer_range == 0.5
    assert config.talker_config.accept_hidden_layer == 2


def test_draw_talker_experts_fills_the_routed_experts_and_router_from_its_seed(tokenizer) -> None:
    from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

    config = q3.tiny_omni_config(tokenizer).talker_config

    def drawn(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        talker = Qwen3OmniMoeTalkerForConditionalGeneration._from_config(config)
        shared = talker.model.layers[0].mlp.shared_expert.gate_proj.weight.clone()
        q3.draw_talker_experts(talker, seed)
        assert torch.equal(talker.model.layers[0].mlp.shared_expert.gate_proj.weight, shared)
        return {n: p.detach().clone() for n, p in talker.named_parameters()
                if ".mlp.gate." in n or ".mlp.experts." in n}

    a, b, c = drawn(13), drawn(13), drawn(14)
    assert len(a) == 3 * config.text_config.num_hidden_layers
    std = config.text_config.initializer_range
    for name, t in a.items():
        assert torch.equal(t, b[name]) and not torch.equal(t, c[name]), name
        assert float(t.std()) == pytest.approx(std, rel=0.15), name


def test_it_is_registered_and_benched_in_its_own_run() -> None:
    assert NAME in tm.TINY_MODELS and NAME not in tm.DEFAULT_MODELS
    bench = tb.MODELS["qwen3-moe"]
    assert (bench.name, bench.family, bench.preset) == (NAME, tb.QWEN3, False)
    quick = tb.SCENARIO.quick
    assert "qwen3-moe" not in quick[quick.index("--models") + 1:]
    assert "qwen3-moe" in tb.OWN_RUN


def test_a_runs_note_on_the_machine_is_kept_with_its_rows() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    tb.add_arguments(ap)
    args = ap.parse_args(["--models", "qwen3-moe", "--note", "beside: a test suite"])
    assert args.note == "beside: a test suite" and "--note" not in tb.model_command("qwen3-moe", args)
    results = {"models": {"qwen3-moe": {
        "model": NAME, "levels": {}, "measured": "2026-12-03 20:00 UTC", "note": args.note,
        "command": tb.model_command("qwen3-moe", args)}}}
    assert (f"{NAME}: `omni-bench transformers --models qwen3-moe --rounds 2 --requests-per-slot 2` "
            "(2026-12-03 20:00 UTC; beside: a test suite)") in tb.table(results)


def test_a_qwen3_run_keeps_the_qwen25_rows_recorded_before_families_were() -> None:
    # a Qwen3 run writes the file's talker_tokens as None (each family's default); the Qwen2.5
    # rows in it carry no talker_tokens of their own: they ran with that family's default
    previous = {"max_tokens": 32, "talker_tokens": None, "models": {
        "qwen3-tiny": {"family": "Qwen3-Omni", "talker_tokens": 16, "levels": "q3"},
        "0.5b": {"levels": "q25"}}}
    now = {"max_tokens": 32, "talker_tokens": None, "models": {"qwen3-moe": {}}}
    assert set(tb.kept_models(previous, now)) == {"qwen3-tiny", "0.5b"}
    # --talker-tokens 16 now: the Qwen2.5 rows had 64 codes, not kept
    assert set(tb.kept_models(previous, {**now, "talker_tokens": 16})) == {"qwen3-tiny"}
    # and the new model's rows stay when a later run measures others
    later = {"max_tokens": 32, "talker_tokens": None, "models": {"tiny": {}}}
    kept = {**previous, "models": {**previous["models"], "qwen3-moe": {
        "family": "Qwen3-Omni", "talker_tokens": 16, "levels": "moe"}}}
    assert set(tb.kept_models(kept, later)) == {"qwen3-tiny", "0.5b", "qwen3-moe"}

"""omni-bench scenarios: their pure parts (requests, queueing arithmetic, ratios, tables).

Runs in the pytest process; nothing is served or loaded. Each scenario's tests are
named after it (`test_transformers_*`: omni_tools.bench.transformers_baseline).
"""
from __future__ import annotations

import pytest

from omni_tools.bench import cli
from omni_tools.bench import transformers_baseline as tb

# --- transformers: omni-chat served vs a plain transformers script ---------------------


def test_transformers_prompts_are_seeded_and_distinct() -> None:
    a, b = tb.prompts(8, seed=0), tb.prompts(8, seed=0)
    assert a == b and len(set(a)) == 8
    assert tb.prompts(8, seed=1) != a
    assert tb.prompts(3, seed=0) == a[:3]  # a level's prompts are a prefix of the longest


def test_transformers_both_sides_ask_for_the_same_lengths() -> None:
    served = tb.omni_options(32, 64, "Chelsie", seed=5)
    local = tb.transformers_kwargs(32, 64, "Chelsie", [516, 518])
    assert served["sampling_parameters"] == {"max_tokens": 32, "ignore_eos": True,
                                             "temperature": 0}
    assert served["talker_sampling"] == {"max_tokens": 64, "min_tokens": 64, "temperature": 0}
    assert served["modalities"] == ["text", "audio"] and served["voice"] == "Chelsie"
    assert local["return_audio"] is True and local["speaker"] == "Chelsie"  # transformers' name
    # min = max on the thinker and the talker: EOS and the codec stops are held back
    assert local["thinker_max_new_tokens"] == local["thinker_min_new_tokens"] == 32
    assert local["talker_max_new_tokens"] == local["talker_min_new_tokens"] == 64
    assert local["thinker_do_sample"] is False and local["talker_do_sample"] is False
    assert local["talker_eos_token_id"] == [516, 518]


def test_transformers_queued_latencies_include_the_wait() -> None:
    assert tb.queued([1.0] * 4, 1) == ([1.0] * 4, 4.0)
    assert tb.queued([1.0] * 4, 4) == ([1.0, 2.0, 3.0, 4.0], 4.0)
    # c=2: request 2 is sent when request 0 ends (t=1), waits for request 1 (ends at 3)
    latencies, wall = tb.queued([1.0, 2.0, 1.0, 1.0], 2)
    assert latencies == [1.0, 3.0, 3.0, 2.0] and wall == 5.0


def test_transformers_batched_latency_is_the_whole_batch() -> None:
    assert tb.batched([4.0, 3.0], [2, 1]) == ([4.0, 4.0, 3.0], 7.0)


def test_transformers_level_summary() -> None:
    rows = [{"latency_s": float(i + 1), "ttfa_s": 0.5, "ttft_s": 0.1, "tokens": 32,
             "audio_s": 1.25} for i in range(4)]
    s = tb.level_summary(rows, wall_s=2.0)
    assert s["requests_s"] == 2.0 and s["tok_s"] == 64.0
    assert s["tokens_per_request"] == 32 and s["audio_s_per_request"] == 1.25
    assert s["latency_s_p50"] == 2.5 and s["ttfa_s_p99"] == 0.5 and s["ttft_s_p50"] == 0.1
    no_ttft = [{k: v for k, v in r.items() if k != "ttft_s"} for r in rows]
    assert "ttft_s_p50" not in tb.level_summary(no_ttft, 1.0)


def _side(requests_s: float) -> dict:
    return {"requests_s": requests_s, "latency_s_p50": 1.0, "latency_s_p95": 1.5,
            "latency_s_p99": 2.0, "ttfa_s_p50": 0.4, "ttfa_s_p95": 0.5, "ttfa_s_p99": 0.6,
            "tokens_per_request": 32.0, "audio_s_per_request": 1.28}


def _results() -> dict:
    return {"models": {"0.5b": {"model": "qwen2.5-omni-0.5b-random", "levels": {
        "1": {"omni": _side(1.0), "transformers": _side(0.5), "ratio": 2.0,
              "ratio_per_round": [1.9, 2.1]},
        "16": {"omni": _side(6.0), "transformers": _side(0.5),
               "transformers_batched": _side(2.0), "ratio": 12.0,
               "ratio_per_round": [11.0, 13.0], "ratio_batched": 3.0,
               "ratio_batched_per_round": [3.0, 3.0]}}}}}


def test_transformers_ratio_is_requests_s_at_16_against_10() -> None:
    r = tb.ratios(_results())[0]
    assert r.value == 12.0 and r.target == 10.0 and r.op == ">=" and r.met is True
    assert "concurrency 16" in r.name and "qwen2.5-omni-0.5b-random" in r.name
    missing = _results()
    del missing["models"]["0.5b"]["levels"]["16"]
    rs = tb.ratios(missing)
    assert rs[0].value is None and rs[0].met is None and rs[0].note
    assert [r.value is None for r in rs[1:]] == [False, False, True, True]  # c=1 is there


def test_transformers_table_rows() -> None:
    text = tb.table(_results())
    lines = text.splitlines()
    assert len(lines) == 2 + 2 + 3  # header, rule; two sides at 1, three at 16
    assert "**12.00** (11.00, 13.00)" in text and "**3.00** (3.00, 3.00)" in text
    assert "statically batched" in text


def test_transformers_plots(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    paths = tb.draw(_results(), tmp_path)
    assert [p.name for p in paths] == ["transformers_0.5b_throughput.png",
                                       "transformers_0.5b_latency.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_transformers_scenario_registered_after_openai() -> None:
    names = [s.name for s in cli.SCENARIOS]
    assert names[names.index("openai") + 1] == "transformers"
    sub = cli.parser()
    args = sub.parse_args(["transformers", *tb.SCENARIO.quick])
    assert args.models == ["tiny"] and args.rounds >= 2 and args.concurrency == [1, 16]


def test_transformers_batched_generate_check_says_why() -> None:
    pytest.importorskip("transformers")
    allowed, note = tb.batched_generate_allowed()
    assert isinstance(allowed, bool) and "return_audio" in note


def test_transformers_05b_thinker_shapes() -> None:
    from omni_tools import tiny_omni

    tokenizer = tiny_omni.build_omni_tokenizer()
    config = tiny_omni.tiny_thinker_config(tokenizer, "0.5b")
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.intermediate_size, text.vocab_size) == (
        896, 24, 14, 2, 4864, 151936)
    # the towers feed the text model: their outputs are its width
    assert config.vision_config.out_hidden_size == config.audio_config.output_dim == 896
    tiny = tiny_omni.tiny_thinker_config(tokenizer)
    assert tiny.text_config.hidden_size == tiny_omni.TINY_TEXT_HIDDEN
    assert tiny.text_config.num_hidden_layers == 2


def test_the_transformers_scenario_keeps_models_it_did_not_measure_when_lengths_match():
    from omni_tools.bench import transformers_baseline as tb

    previous = {"max_tokens": 32, "talker_tokens": 64,
                "models": {"tiny": {"levels": "old"}, "0.5b": {"levels": "kept"}}}
    now = {"max_tokens": 32, "talker_tokens": 64, "models": {"tiny": {"levels": "new"}}}
    assert tb.kept_models(previous, now) == {"0.5b": {"levels": "kept"}}
    assert tb.kept_models({**previous, "talker_tokens": 128}, now) == {}
    assert tb.kept_models(None, now) == {}


# --- split: omni-chat on one server vs the thinker on a second one ---------------------


def test_split_puts_the_thinker_alone_on_the_engine_server(tmp_path) -> None:
    from omni_tools import spec
    from omni_tools.bench import split

    data = spec.load_preset("omni-chat").model_dump(mode="json", exclude_none=True)
    parsed = spec.parse_spec(split.split_spec(data), base_dir=tmp_path)  # a valid spec
    servers = {name: stage.server for name, stage in parsed.stages.items()}
    assert servers.pop("llm") == "engine" and set(servers.values()) == {"front"}
    assert split.NO_SHM in servers and parsed.stages[split.NO_SHM].env == {
        "OMNI_SERVER_ENGINE_SHM": "none"}
    assert "server" not in data["stages"]["llm"]  # the preset's own data is left alone


def test_split_reads_the_thinkers_row_width_from_an_omni_or_a_plain_config() -> None:
    from omni_tools.bench import split

    assert split.thinker_width({"thinker_config": {"text_config": {"hidden_size": 896}}}) == 896
    assert split.thinker_width({"hidden_size": 128}) == 128

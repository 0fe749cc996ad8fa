"""omni-bench transformers across model families: the per-family table, arguments,
reply-length and real-time-factor arithmetic, report rows.

Runs in the pytest process; nothing is served. One test reads the tiny Qwen3-Omni
checkpoint's config (built once into the model cache) and transformers' source.
"""
from __future__ import annotations

import argparse

import pytest

from omni_tools.bench import cli
from omni_tools.bench import transformers_baseline as tb


def _args(*argv: str) -> argparse.Namespace:
    return cli.parser().parse_args(["transformers", *argv])


# --- the per-family table and arguments ------------------------------------------------


def test_every_model_has_a_family_and_qwen3_tiny_is_qwen3_omni() -> None:
    assert set(tb.MODELS) == {"tiny", "0.5b", "qwen3-tiny", "qwen3-moe"}
    q3 = tb.MODELS["qwen3-tiny"]
    assert q3.name == "qwen3-omni-tiny" and q3.family is tb.QWEN3 and not q3.preset
    assert q3.family.model_class == "Qwen3OmniMoeForConditionalGeneration"
    assert q3.family.processor_class == "AutoProcessor"
    assert all(tb.MODELS[m].family is tb.QWEN25 and tb.MODELS[m].preset for m in ("tiny", "0.5b"))
    # the levels hold the issue's: requests/s at 1 and 16, real-time factor at 1 and 8
    assert {1, 8, 16} <= set(tb.QWEN3.concurrency)
    assert tb.QWEN3.reply_tokens == (32, 64, 128)
    # the default talker lengths give both families the same speech per request
    assert tb.QWEN3.talker_tokens * tb.QWEN3.code_s == pytest.approx(
        tb.QWEN25.talker_tokens * tb.QWEN25.code_s)


def test_qwen3_tiny_is_a_model_choice_and_reply_tokens_parse() -> None:
    args = _args("--models", "qwen3-tiny", "--rounds", "1", "--concurrency", "1", "2",
                 "--max-tokens", "16", "--reply-tokens", "16")
    assert args.models == ["qwen3-tiny"] and args.reply_tokens == [16]
    assert _args("--reply-tokens").reply_tokens == []  # none: skip the lengths
    with pytest.raises(SystemExit):
        _args("--models", "qwen4-tiny")


def test_settings_fall_back_to_the_family_defaults() -> None:
    s = tb.settings("qwen3-tiny", _args("--models", "qwen3-tiny"))
    assert s == {"concurrency": [1, 8, 16], "talker_tokens": 16,
                 "reply_tokens": [32, 64, 128], "codes_per_token": 4}
    s = tb.settings("tiny", _args())
    assert s == {"concurrency": [1, 16], "talker_tokens": 64, "reply_tokens": [],
                 "codes_per_token": 15}
    given = _args("--concurrency", "1", "2", "--talker-tokens", "8", "--reply-tokens", "16",
                  "--codes-per-token", "3")
    for model in tb.MODELS:  # given arguments win for every family
        assert tb.settings(model, given) == {"concurrency": [1, 2], "talker_tokens": 8,
                                             "reply_tokens": [16], "codes_per_token": 3}
    assert tb.settings("qwen3-tiny", _args("--reply-tokens"))["reply_tokens"] == []


def test_model_command_repeats_only_what_was_given() -> None:
    assert tb.model_command("qwen3-tiny", _args("--rounds", "1")) == (
        "omni-bench transformers --models qwen3-tiny --rounds 1 --requests-per-slot 2")
    args = _args("--rounds", "1", "--concurrency", "1", "2", "--min-requests", "2",
                 "--max-tokens", "16", "--reply-tokens", "16", "--reply-requests", "1",
                 "--no-batched", "--seed", "3")
    assert tb.model_command("qwen3-tiny", args) == (
        "omni-bench transformers --models qwen3-tiny --rounds 1 --requests-per-slot 2 "
        "--concurrency 1 2 --min-requests 2 --max-tokens 16 --reply-tokens 16 "
        "--reply-requests 1 --no-batched --seed 3")
    # what it names parses back to the same settings
    again = _args(*tb.model_command("qwen3-tiny", args).split()[2:])
    assert tb.settings("qwen3-tiny", again) == tb.settings("qwen3-tiny", args)


def test_quick_set_still_measures_the_qwen25_tiny_model_at_1_and_16() -> None:
    args = _args(*tb.SCENARIO.quick)
    assert args.models == ["tiny"] and tb.settings("tiny", args)["concurrency"] == [1, 16]
    assert tb.settings("tiny", args)["reply_tokens"] == []


class _Tokenizer:
    def convert_tokens_to_ids(self, token: str) -> int:
        return {"<|im_end|>": 2}[token]


class _Obj:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def test_family_voice_and_generate_extras() -> None:
    q3 = _Obj(config=_Obj(talker_config=_Obj(speaker_id={"aiden": 383, "chelsie": 381})))
    assert tb.QWEN3.speaker(q3) == "aiden"  # config.json's first speaker
    assert tb.QWEN3.extras(q3, _Obj(tokenizer=_Tokenizer())) == {"thinker_eos_token_id": 2}
    q25 = _Obj(speaker_map={"Ethan": 0, "Chelsie": 1}, config=_Obj(talker_config=_Obj(
        tts_codec_pad_token_id=516, tts_codec_end_token_id=518)))
    assert tb.QWEN25.speaker(q25) == "Chelsie"
    assert tb.QWEN25.extras(q25, None) == {"talker_eos_token_id": [516, 518]}
    # transformers_kwargs: lengths forced with min = max; no talker stop ids unless given
    kw = tb.transformers_kwargs(16, 8, "aiden")
    assert "talker_eos_token_id" not in kw
    assert kw["thinker_min_new_tokens"] == kw["thinker_max_new_tokens"] == 16
    assert kw["talker_min_new_tokens"] == kw["talker_max_new_tokens"] == 8


def test_qwen3_generate_passes_min_new_tokens_on_and_takes_a_batch() -> None:
    pytest.importorskip("transformers")
    import inspect

    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    src = inspect.getsource(m.Qwen3OmniMoeForConditionalGeneration.generate)
    # thinker_* / talker_* kwargs go to the thinker's and the talker's generate
    assert 'key.startswith("thinker_")' in src and 'key.startswith("talker_")' in src
    allowed, note = tb.batched_generate_allowed(tb.QWEN3)
    assert allowed and "Qwen3OmniMoeForConditionalGeneration" in note
    assert tb.batched_generate_allowed(tb.QWEN25)[1] == tb.batched_generate_allowed()[1]


def test_the_qwen3_served_spec_is_the_preset_pointed_at_its_folder(tmp_path) -> None:
    pytest.importorskip("transformers")
    parsed = tb.served_spec("qwen3-tiny", tmp_path)
    stages = parsed.stages
    assert tb.IMAGE_STAGE not in stages
    # Qwen3-Omni's thinker takes images and audio raw: no encoder stages
    assert {"llm", "talker", "audio_decoder", "omni"} <= set(stages)
    assert "image_encoder" not in stages and "audio_encoder" not in stages
    assert stages["llm"].model.endswith("qwen3-omni-tiny")
    roles = stages["omni"].engine_args["stages"]
    assert "image_generator" not in roles and roles["talker"] == "talker"


# --- arithmetic ------------------------------------------------------------------------


def _side(requests_s: float, *, rtf: float = 1.0, ttfa: float = 0.4,
          latency: float = 1.0) -> dict:
    return {"requests_s": requests_s, "audio_s_per_s": rtf, "latency_s_p50": latency,
            "latency_s_p95": latency, "latency_s_p99": latency, "ttfa_s_p50": ttfa,
            "ttfa_s_p95": ttfa, "ttfa_s_p99": ttfa, "tokens_per_request": 16.0,
            "audio_s_per_request": 1.28}


def test_level_summary_real_time_factor_is_audio_over_wall_seconds() -> None:
    rows = [{"latency_s": 1.0, "ttfa_s": 0.2, "tokens": 16, "audio_s": 1.28}] * 4
    assert tb.level_summary(rows, wall_s=2.0)["audio_s_per_s"] == pytest.approx(2.56)


def test_level_result_ratios_per_round() -> None:
    lv = tb.level_result({"omni": [_side(2.0, rtf=4.0), _side(3.0, rtf=6.0)],
                          "transformers": [_side(1.0, rtf=2.0), _side(1.0, rtf=2.0)],
                          "transformers_batched": []}, requests=4)
    assert lv["requests"] == 4 and "transformers_batched" not in lv
    assert lv["ratio_per_round"] == [2.0, 3.0] and lv["ratio"] == 2.5
    assert lv["rtf_ratio_per_round"] == [2.0, 3.0] and lv["rtf_ratio"] == 2.5
    assert lv["omni"]["requests_s"] == 2.5 and "ratio_batched" not in lv


def test_reply_length_result_first_audio_over_total_and_over_transformers() -> None:
    omni = [_side(1.0, ttfa=0.5, latency=5.0), _side(1.0, ttfa=1.0, latency=5.0)]
    tf = [_side(0.2, latency=10.0), _side(0.2, latency=4.0)]
    r = tb.reply_length_result(omni, tf, talker_tokens=512)
    assert r["talker_tokens"] == 512
    assert r["first_audio_over_total_per_round"] == [0.1, 0.2]
    assert r["first_audio_over_total"] == pytest.approx(0.15)
    assert r["first_audio_over_transformers_per_round"] == [0.05, 0.25]
    assert r["first_audio_over_transformers"] == pytest.approx(0.15)
    alone = tb.reply_length_result(omni, [], talker_tokens=512)
    assert "first_audio_over_transformers" not in alone and "transformers" not in alone


def _results() -> dict:
    lengths = {str(n): tb.reply_length_result([_side(1.0, ttfa=0.5, latency=n / 8)],
                                              [_side(0.2, latency=n / 4)], n * 4)
               for n in (32, 64, 128)}
    return {"max_tokens": 32, "talker_tokens": None, "models": {"qwen3-tiny": {
        "model": "qwen3-omni-tiny", "family": "Qwen3-Omni", "talker_tokens": 16,
        "levels": {"1": tb.level_result({"omni": [_side(1.0, rtf=1.28)],
                                         "transformers": [_side(0.5, rtf=0.64)]}, 4),
                   "16": tb.level_result({"omni": [_side(6.0, rtf=7.7)],
                                          "transformers": [_side(0.5, rtf=0.64)],
                                          "transformers_batched": [_side(2.0)]}, 16)},
        "reply_lengths": lengths}}}


def test_ratios_read_first_audio_at_128_tokens() -> None:
    rs = tb.ratios(_results())
    assert [r.target for r in rs] == [10.0, 1.2, 0.5, 1.5, 1.0, 0.1, 0.5]
    total, vs = rs[5], rs[6]
    assert "128-token reply, spoken as 512 frames" in total.name and total.op == "<="
    assert total.value == pytest.approx(0.5 / 16) and total.met is True
    assert vs.value == pytest.approx(0.5 / 32) and vs.met is True
    shorter = _results()
    del shorter["models"]["qwen3-tiny"]["reply_lengths"]["128"]
    assert "64-token reply" in tb.ratios(shorter)[5].name  # else the longest measured


def test_ratios_against_transformers_on_the_default_reply() -> None:
    end_to_end, first_audio, one_at_a_time, batched = tb.ratios(_results())[1:5]
    # concurrency 1: served p50s over transformers' end to end p50 (1.0 s both: _side's)
    assert "end to end p50, concurrency 1 (qwen3-omni-tiny, 32-token reply)" in end_to_end.name
    assert end_to_end.value == pytest.approx(1.0) and end_to_end.met is True  # <= 1.2
    assert first_audio.value == pytest.approx(0.4) and first_audio.met is True  # <= 0.5
    # concurrency 16: requests/s, 6.0 against 0.5 one at a time and 2.0 batched
    assert one_at_a_time.value == pytest.approx(12.0) and one_at_a_time.met is True
    assert batched.value == pytest.approx(3.0) and batched.met is True
    slow = _results()
    slow["models"]["qwen3-tiny"]["levels"]["1"]["omni"]["latency_s_p50"] = 1.3
    assert tb.ratios(slow)[1].met is False


def test_table_shows_real_time_factor_and_the_reply_lengths(tmp_path) -> None:
    text = tb.table(_results())
    assert "real-time factor" in text.splitlines()[0]
    assert "| qwen3-omni-tiny | 16 | omni-chat (Triton) | 6.00 | 7.70 |" in text
    assert "First audio against reply length" in text
    row = next(line for line in text.splitlines() if line.startswith("| qwen3-omni-tiny | 128 |"))
    assert "| 512 |" in row and "**0.03** (0.03)" in row and "**0.02** (0.02)" in row
    pytest.importorskip("matplotlib")
    names = [p.name for p in tb.draw(_results(), tmp_path)]
    assert "transformers_qwen3-tiny_reply_length.png" in names


def test_kept_models_compare_each_family_s_talker_length() -> None:
    previous = {"max_tokens": 32, "talker_tokens": 64, "models": {
        "0.5b": {"levels": "kept"},  # from before families were recorded: Qwen2.5-Omni
        "qwen3-tiny": {"family": "Qwen3-Omni", "talker_tokens": 16, "levels": "kept"}}}
    now = {"max_tokens": 32, "talker_tokens": None, "models": {"tiny": {}}}
    assert set(tb.kept_models(previous, now)) == {"0.5b", "qwen3-tiny"}
    # --talker-tokens 16 now: the 0.5b rows had 64 codes, not kept
    assert set(tb.kept_models(previous, {**now, "talker_tokens": 16})) == {"qwen3-tiny"}
    assert tb.kept_models({**previous, "max_tokens": 16}, now) == {}


def test_a_failed_run_keeps_the_server_log(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tb.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    assert tb.keep_server_log(work, "qwen3-tiny") is None
    (work / "tritonserver.log").write_text("E1203 talker failed\n")
    kept = tb.keep_server_log(work, "qwen3-tiny")
    assert kept == tmp_path / "tmp" / "bench-transformers-qwen3-tiny-tritonserver.log"
    assert kept.read_text() == "E1203 talker failed\n"


def test_the_served_specs_are_the_presets_as_omni_gen_repo_writes_them(tmp_path) -> None:
    pytest.importorskip("transformers")
    for model in ("qwen3-tiny", "tiny"):
        assert "enforce_eager" not in tb.served_spec(model, tmp_path).stages["talker"].engine_args
    assert tb.QWEN3.served_note and not tb.QWEN3.served_engine_args

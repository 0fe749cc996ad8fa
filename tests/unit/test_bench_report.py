"""omni-bench's pure parts: ratios against targets, engine flags, the generated page."""
from __future__ import annotations

import argparse
import json

import pytest

from omni_tools.bench import cli, openai_chat, report, scenario
from omni_tools.bench.scenario import Ratio, Scenario


@pytest.mark.parametrize("value,op,met", [
    (1.0, ">=", True), (0.94, ">=", False), (0.08, "<=", True), (0.2, "<=", False),
    (None, ">=", None)])
def test_a_ratio_is_met_by_its_operator(value, op, met):
    assert Ratio("r", value, 0.95 if op == ">=" else 0.10, op).met is met


def test_vllm_serve_gets_the_engine_args_as_flags_without_the_stages_own():
    flags = openai_chat.vllm_flags({"model": "/m", "max_model_len": 2048, "enforce_eager": True,
                                    "trust_remote_code": False, "dtype": "float32",
                                    "worker_extension_cls": "x.Y", "max_queued": 4})
    assert flags == ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32"]


def _openai_results(ratio32: float) -> dict:
    side = {"tok_s": 1000.0, "requests_s": 10.0, "ttft_p50_ms": 50.0, "ttft_p99_ms": 90.0,
            "itl_p50_ms": 7.0, "latency_p50_ms": 400.0, "latency_p95_ms": 500.0,
            "latency_p99_ms": 600.0}
    return {"command": "omni-bench openai", "levels": {
        "32": {"omni": {**side, "tok_s": 1000.0 * ratio32}, "vllm": side, "ratio": ratio32,
               "ratio_per_round": [ratio32, ratio32],
               "vllm_nospin": {**side, "tok_s": 2000.0}, "ratio_nospin": ratio32 / 2,
               "ratio_nospin_per_round": [ratio32 / 2, ratio32 / 2]}}}


def test_the_page_lists_each_ratio_with_its_verdict_and_each_scenario(tmp_path, monkeypatch):
    monkeypatch.setattr(scenario, "RESULTS_DIR", tmp_path / "results")
    ran = Scenario(name="openai", title="Text chat", add_arguments=lambda ap: None,
                   run=lambda args: {}, ratios=openai_chat.ratios, table=openai_chat.table)
    never = Scenario(name="never", title="Never run", add_arguments=lambda ap: None,
                     run=lambda args: {})
    ran.save(_openai_results(0.80))
    page = report.render([ran, never], "omni-bench all")
    assert "| omni-openai + Triton / vllm serve, output tok/s at concurrency 32 | 0.80 | >= 0.95 " \
           "| **short** |" in page
    assert "| omni-openai + Triton / vllm serve + no-spin plugin, output tok/s at concurrency " \
           "32 | 0.40 | >= 0.95 | **short** |" in page
    assert "## Text chat" in page
    assert "| 32 | 800 | 1000 | 2000 | **0.80** (0.80, 0.80) | **0.40** (0.40, 0.40) | " \
           "50 / 50 / 50 |" in page
    assert "Not run into this page: never." in page and "## Never run" not in page
    ran.save(_openai_results(0.97))
    assert "| 0.97 | >= 0.95 | met |" in report.render([ran], "omni-bench all")


def _vllm_omni_results(diffusion_ran: bool) -> dict:
    from omni_tools.bench import vllm_omni

    diffusion = ({"ran": True, "levels": {"1": {"images_s": 10.0}, "8": {"images_s": 30.0}},
                  "shim_applied": ["a stub"]} if diffusion_ran else
                 {"ran": False, "error": "RuntimeError: boom", "where": ["x.py:1 in f"],
                  "root_causes": ["RuntimeError: Not support device type: cpu (at w.py:112)"]})
    results = {"paths": {"diffusion": diffusion,
                         "omni": {"ran": False, "error": "RuntimeError: init failed",
                                  "root_causes": ["RuntimeError: Not support device type: cpu"]}},
               "ours": {"levels": {"1": {"images_s": 15.0}, "8": {"images_s": 45.0}}},
               "psnr_db": None, "vllm_omni_version": "0.30.0", "vllm_version": "0.32"}
    results["notes"] = vllm_omni._notes(results["paths"], results["ours"], None)
    return results


def test_vllm_omni_ratios_are_ours_over_theirs_and_name_what_did_not_run():
    from omni_tools.bench import vllm_omni

    results = _vllm_omni_results(diffusion_ran=True)
    assert [r.value for r in vllm_omni.ratios(results)] == [1.5, 1.5]
    assert "| 8 | 30.0 | 45.0 | **1.50** |" in vllm_omni.table(results)
    assert "Qwen2.5-Omni thinker->talker->code2wav (Omni, qwen2.5-omni-tiny): did not run: " \
           "RuntimeError: Not support device type: cpu" in results["notes"]


def test_vllm_omni_ratios_are_not_measured_when_its_diffusion_path_failed():
    from omni_tools.bench import vllm_omni

    results = _vllm_omni_results(diffusion_ran=False)
    ratios = vllm_omni.ratios(results)
    assert [r.value for r in ratios] == [None, None]
    assert "did not run" in ratios[0].note


@pytest.mark.parametrize("name", [s.name for s in cli.SCENARIOS])
def test_omni_bench_all_can_parse_each_scenarios_quick_arguments(name):
    """`omni-bench all` runs every scenario with them: a bad one stops the whole run."""
    scenario = {s.name: s for s in cli.SCENARIOS}[name]
    sub = argparse.ArgumentParser(prog=name, exit_on_error=False)
    scenario.add_arguments(sub)
    args = sub.parse_args(list(scenario.quick))
    if hasattr(args, "module_args"):  # passed on to the child's command line as they are
        assert [a for a in args.module_args if a != "--"] == list(scenario.quick)[1:]


CHILD_MODULES = {"llm": "llm_stage", "dit": "dit_batching", "dit-cache": "dit_cache",
                 "pipelining": "pipelining", "split": "split", "spin": "spin",
                 "cold-start": "cold_start", "hidden-states": "hidden_states",
                 "stream-errors": "stream_errors", "unary-cancel": "unary_cancel",
                 "first-chunk": "first_chunk"}


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("name,module", CHILD_MODULES.items())
def test_each_child_scenario_runs_its_module_which_writes_the_scenarios_one_file(
        name, module, monkeypatch):
    """`omni-bench NAME` runs `python -m omni_tools.bench.MODULE ... --out FILE`; run alone,
    the module writes docs/benchmarks/NAME.json, the scenario's one results file."""
    import importlib

    scenario = {s.name: s for s in cli.SCENARIOS}[name]
    ap = argparse.ArgumentParser()
    scenario.add_arguments(ap)
    assert f"python -m omni_tools.bench.{module}" in " ".join(ap.format_help().split())
    child = importlib.import_module(f"omni_tools.bench.{module}")
    parse = argparse.ArgumentParser.parse_args
    parsed = {}

    def defaults_only(parser, args=None, namespace=None):
        parsed["args"] = parse(parser, [], namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", defaults_only)
    with pytest.raises(_Parsed):
        child.main([])
    assert parsed["args"].out == scenario.results_path


def test_a_measurements_results_keep_its_arguments_paths_as_text(tmp_path):
    out = tmp_path / "new" / "results.json"
    scenario.write_results(out, {"args": {"out": out, "rounds": 2}})
    assert json.loads(out.read_text()) == {"args": {"out": str(out), "rounds": 2}}


def test_on_demand_scenarios_stay_out_of_all_and_off_the_page(tmp_path, monkeypatch):
    monkeypatch.setattr(scenario, "RESULTS_DIR", tmp_path / "results")
    on_demand = [s.name for s in cli.SCENARIOS if not s.in_all]
    assert on_demand == ["split", "spin", "cold-start", "hidden-states", "stream-errors",
                         "unary-cancel", "first-chunk", "decoder", "server-start"]
    with pytest.raises(SystemExit):  # `all --skip` only names scenarios `all` runs
        cli.parser().parse_args(["all", "--skip", "spin"])
    spin = {s.name: s for s in cli.SCENARIOS}["spin"]
    spin.save({"summary": {}})
    page = report.render(cli.SCENARIOS, "omni-bench all")
    assert "## " + spin.title not in page
    assert "`omni-bench spin`: " + spin.title in page
    assert "Not run into this page: " in page and "spin" not in page.split(
        "Not run into this page: ")[1].split("\n")[0]


def test_pipelining_takes_first_audio_of_a_128_token_reply_from_the_length_sweep():
    from omni_tools.bench import subprocess_scenarios as scripts

    side = {"requests_s": 1.0, "ttfa_over_total_p50": 0.3, "audio_s_mean": 5.0}
    results = {"max_tokens": 64, "talker_codes": 256, "sweep_codes_per_token": 15,
               "levels": {"1": {"pipelined": side}, "8": {"throughput_ratio": 1.2}},
               "lengths": {"32": {**side, "ttfa_over_total_p50": 0.2},
                           "128": {**side, "ttfa_over_total_p50": 0.07, "audio_s_mean": 38.4}}}
    ratios = {r.name: r for r in scripts.PIPELINING.ratios(results)}
    sweep = ratios["omni-chat first audio / full response, p50 at concurrency 1 (128-token reply "
                   "spoken as 1920 codes, 38 s)"]
    assert (sweep.value, sweep.met) == (0.07, True)
    short = ratios["omni-chat first audio / full response, p50 at concurrency 1 (64-token reply "
                   "spoken as 256 codes)"]
    assert (short.value, short.met) == (0.3, False)
    assert ratios["omni-chat pipelined / stage-by-stage, requests/s at concurrency 8"].value == 1.2


def test_a_child_scenarios_help_ends_omni_bench_cleanly(capfd):
    """`omni-bench NAME -- --help` prints the module's options and exits 0, keeping nothing."""
    scenario = {s.name: s for s in cli.SCENARIOS}["spin"]
    ap = argparse.ArgumentParser()
    scenario.add_arguments(ap)
    with pytest.raises(SystemExit) as ended:
        scenario.run(ap.parse_args(["--", "--help"]))
    assert ended.value.code == 0
    assert "--sides" in capfd.readouterr().out  # the child's own options

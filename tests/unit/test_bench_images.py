"""omni-bench `images` (omni_tools.bench.openai_images) and AIPerf's image-generation command.

Runs in the pytest process; nothing is served, loaded or started: the AIPerf command is
built and inspected, never run; results are made-up dicts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_tools import aiperf
from omni_tools.bench import cli
from omni_tools.bench import openai_images as oi


def _flag_values(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag]


# --- aiperf: one runner, endpoint-specific arguments ----------------------------------------

def test_aiperf_image_command_asks_for_size_steps_and_the_file_in_order(tmp_path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    cmd = aiperf.command("http://127.0.0.1:9000", "text_to_image", "/m/tokenizer",
                         tmp_path / "artifacts",
                         aiperf.image_args(dataset, width=64, height=48, steps=4),
                         requests=32, concurrency=8)
    assert cmd[:2] == [str(aiperf.AIPERF), "profile"]
    assert _flag_values(cmd, "--endpoint-type") == ["image_generation"]
    assert _flag_values(cmd, "--extra-inputs") == ["size:64x48", "num_inference_steps:4"]
    assert _flag_values(cmd, "--input-file") == [str(dataset)]
    assert _flag_values(cmd, "--custom-dataset-type") == ["single_turn"]
    assert _flag_values(cmd, "--dataset-sampling-strategy") == ["sequential"]
    assert _flag_values(cmd, "--request-count") == ["32"]
    assert _flag_values(cmd, "--concurrency") == ["8"]
    assert _flag_values(cmd, "--model") == ["text_to_image"]
    assert _flag_values(cmd, "--tokenizer") == ["/m/tokenizer"]
    assert _flag_values(cmd, "--artifact-dir") == [str(tmp_path / "artifacts")]
    # nothing of the chat endpoint's
    for chat_only in ("--streaming", "--use-server-token-count", "--output-tokens-mean",
                      "--synthetic-input-tokens-mean"):
        assert chat_only not in cmd
    assert "--warmup-request-count" not in cmd


def test_aiperf_chat_command_keeps_its_flags(tmp_path) -> None:
    cmd = aiperf.command("http://h:1", "llm", "/tok", tmp_path / "a", aiperf.chat_args(32, 64),
                         requests=128, concurrency=32, warmup=8)
    assert _flag_values(cmd, "--endpoint-type") == ["chat"] and "--streaming" in cmd
    assert _flag_values(cmd, "--extra-inputs") == ["ignore_eos:true", "max_tokens:64"]
    assert _flag_values(cmd, "--synthetic-input-tokens-mean") == ["32"]
    assert _flag_values(cmd, "--output-tokens-mean") == ["64"]
    assert "--use-server-token-count" in cmd
    assert _flag_values(cmd, "--warmup-request-count") == ["8"]
    # the common part is the same as for images
    assert cmd.count("--random-seed") == 1 and _flag_values(cmd, "--workers-max") == ["2"]


def test_aiperf_image_dataset_has_one_seeded_request_per_line() -> None:
    text = aiperf.image_dataset([("a fox", 3), ("a tram", 4)])
    lines = [json.loads(line) for line in text.splitlines()]
    assert lines == [{"text": "a fox", "extra": {"seed": 3}},
                     {"text": "a tram", "extra": {"seed": 4}}]
    assert text.endswith("\n")


def test_aiperf_image_profile_writes_its_dataset_and_runs_one_command(tmp_path, monkeypatch):
    ran = []

    def fake_run(cmd, work, timeout_s=600):
        ran.append((cmd, work))
        return aiperf.Profile(list(cmd), 0, "", "", work / "artifacts")

    monkeypatch.setattr(aiperf, "run", fake_run)
    reqs = oi.prompts(5)
    prof = aiperf.image_profile("http://h:1", "text_to_image", "/tok", tmp_path / "w", reqs,
                                concurrency=1, width=64, height=64, steps=4)
    (cmd, work), = ran
    assert work == tmp_path / "w" and prof.artifacts == tmp_path / "w" / "artifacts"
    dataset = Path(_flag_values(cmd, "--input-file")[0])
    assert dataset.read_text() == aiperf.image_dataset(reqs)
    assert _flag_values(cmd, "--request-count") == ["5"]


# --- the images scenario: requests, measurement arithmetic --------------------------------

def test_images_prompts_are_seeded_distinct_and_prefixes() -> None:
    a = oi.prompts(16)
    assert a == oi.prompts(16) and len({p for p, _ in a}) == 16
    assert [s for _, s in a] == list(range(16))  # one seed per image
    assert oi.prompts(4) == a[:4]
    assert oi.prompts(4, seed=1) != a[:4]


def test_images_request_body_is_what_aiperf_sends() -> None:
    body = oi.request_body("a fox", 7, 64, 4)
    # AIPerf's image_generation payload, with our extra inputs and the per-request extra
    assert body == {"prompt": "a fox", "model": "text_to_image", "response_format": "b64_json",
                    "n": 1, "size": "64x64", "num_inference_steps": 4, "seed": 7}


def test_images_summarize_aiperf_is_requests_per_second() -> None:
    s = {"request_throughput": {"avg": 40.0}, "request_count": {"avg": 32.0},
         "request_latency": {"p50": 150.0, "p95": 200.0, "p99": 210.0, "avg": 160.0}}
    assert oi.summarize_aiperf(s) == {"images_s": 40.0, "requests": 32, "latency_p50_ms": 150.0,
                                      "latency_p95_ms": 200.0, "latency_p99_ms": 210.0}
    assert oi.summarize_aiperf(s, images_per_request=2)["images_s"] == 80.0


def test_images_timed_batches_chunks_and_latencies() -> None:
    calls = []
    out = oi.timed_batches(calls.append, oi.prompts(10), 4)
    assert [len(c) for c in calls] == [4, 4, 2]
    assert out["requests"] == 10 and out["batch"] == 4 and out["images_s"] > 0
    assert set(out) >= {"latency_p50", "latency_p95", "latency_p99"}


# --- ratios, table, plot from a results dict ------------------------------------------------

def _lat(p50: float) -> dict[str, float]:
    return {"latency_p50_ms": p50, "latency_p95_ms": p50 * 1.5, "latency_p99_ms": p50 * 2}


def _results() -> dict:
    served = {1: [{"images_s": 18.0, "requests": 32, **_lat(50)},
                  {"images_s": 22.0, "requests": 32, **_lat(40)}],
              8: [{"images_s": 50.0, "requests": 32, **_lat(150)},
                  {"images_s": 40.0, "requests": 32, **_lat(170)}]}
    one = [{"images_s": 20.0, "requests": 32, "batch": 1, **_lat(40)},
           {"images_s": 25.0, "requests": 32, "batch": 1, **_lat(38)}]
    batched = [{"images_s": 60.0, "requests": 32, "batch": 8, **_lat(110)},
               {"images_s": 80.0, "requests": 32, "batch": 8, **_lat(100)}]
    return oi.collect(served, one, batched) | {
        "size": 64, "steps": 4, "requests": 32, "batch": 8,
        "same_images": {"compared": 2, "identical": 2, "max_abs_pixel_diff": 0}}


def test_images_collect_takes_medians_of_per_round_ratios() -> None:
    r = _results()
    lv8 = r["levels"]["8"]
    assert lv8["ratio_per_round"] == [2.5, 1.6] and abs(lv8["ratio"] - 2.05) < 1e-9
    assert lv8["ratio_vs_batched_per_round"] == [50 / 60, 0.5]
    assert lv8["omni"]["images_s"] == 45.0 and lv8["omni"]["latency_p50_ms"] == 160.0
    assert r["levels"]["1"]["ratio_per_round"] == [0.9, 0.88]
    assert r["diffusers"]["one_at_a_time"]["images_s"] == 22.5
    assert r["diffusers"]["batched"]["batch"] == 8  # a count, not a median


def test_images_ratio_is_served_at_8_over_one_at_a_time() -> None:
    (ratio,) = oi.ratios(_results())
    assert abs(ratio.value - 2.05) < 1e-9 and ratio.target == 1.0 and ratio.op == ">="
    assert ratio.met and "concurrency 8" in ratio.name and "our own" in ratio.note
    only_1 = _results()
    del only_1["levels"]["8"]
    (missing,) = oi.ratios(only_1)
    assert missing.value is None and missing.met is None and "not measured" in missing.note


def test_images_table_rows() -> None:
    t = oi.table(_results())
    assert "| 8 | 45.0 | 22.5 | 70.0 | **2.05** (2.50, 1.60) | 0.67 | 160 / 240 / 320 |" in t
    assert "| 1 | 20.0 | 22.5 | 70.0 | **0.89** (0.90, 0.88) |" in t
    assert "diffusers batch 8" in t and "2 pixel-identical" in t
    assert t.index("| 1 |") < t.index("| 8 |")


def test_images_plot(tmp_path) -> None:
    (path,) = oi.draw(_results(), tmp_path)
    assert path.name == "openai_images.png" and path.stat().st_size > 0


def test_images_scenario_registered_and_quick_parses() -> None:
    names = [s.name for s in cli.SCENARIOS]
    assert "images" in names and "vllm-omni" in names
    args = cli.parser().parse_args(["images", *oi.SCENARIO.quick])
    assert args.concurrency == [1, 8] and args.rounds >= 2 and args.size == 64
    assert args.steps == 4 and args.batch == 8


def test_a_profile_raises_when_aiperf_failed_or_a_request_got_an_error(tmp_path):
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    records = artifacts / "profile_export.jsonl"
    records.write_text('{"metadata": {}}\n')
    aiperf.Profile(["aiperf"], 0, "", "", artifacts).raise_for_failures()  # a clean run
    with pytest.raises(RuntimeError, match="aiperf failed"):
        aiperf.Profile(["aiperf"], 2, "", "boom", artifacts).raise_for_failures()
    records.write_text('{"metadata": {}}\n{"error": {"code": 400, "message": "bad size"}}\n')
    with pytest.raises(RuntimeError, match="1 requests failed: .*bad size"):
        aiperf.Profile(["aiperf"], 0, "", "", artifacts).raise_for_failures()

"""Scenarios whose measurement runs in a child process: `python -m omni_tools.bench.<module>`.

Runs in the omni-bench process; the child starts its own servers (or engines) and
writes its JSON results, which omni-bench keeps as the scenario's results.
`omni-bench llm -- --models qwen2-tiny` passes what follows `--` to the module's own
command line (`python -m omni_tools.bench.llm_stage --help` lists it). The on-demand
scenarios at the end are not part of `omni-bench all`: each answers one question
about a setting or a Triton release; docs/benchmarks-notes.md has their figures.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from omni_tools.bench import plots
from omni_tools.bench.scenario import ROOT, Ratio, Results, Scenario


def _child_scenario(name: str, module: str, title: str, quick: list[str],
                    ratios: Callable[[Results], list[Ratio]] = lambda results: [],
                    table: Callable[[Results], str] = lambda results: "",
                    draw: Callable[[Results, Path], list[Path]] | None = None, *,
                    in_all: bool = True) -> Scenario:
    def add_arguments(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("module_args", nargs=argparse.REMAINDER,
                        help=f"arguments of python -m omni_tools.bench.{module} (after --)")

    def run(args: argparse.Namespace) -> Results:
        extra = [a for a in args.module_args if a != "--"]
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as d:
            out = Path(d) / "results.json"
            cmd = [sys.executable, "-m", f"omni_tools.bench.{module}", *extra, "--out", str(out)]
            print("+", " ".join(cmd[1:]), flush=True)
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code == 0 and {"-h", "--help"} & set(extra):
                raise SystemExit(0)  # the module printed its options: nothing to keep
            if not out.is_file():
                raise subprocess.CalledProcessError(code, cmd)
            results = json.loads(out.read_text())
        if code:  # a check that failed (a bound, a server that died): its results say how
            print(f"{name}: the measurement exited with {code}", flush=True)
            results["exit_code"] = code
        results["command"] = " ".join(["omni-bench", name, *(["--", *extra] if extra else [])])
        return results

    return Scenario(name=name, title=title, add_arguments=add_arguments, run=run,
                    quick=["--", *quick],  # the module's own flags, past omni-bench's parser
                    ratios=ratios, table=table, plots=draw or (lambda results, folder: []),
                    in_all=in_all)


# --- llm: the omni_llm stage in tritonserver vs the same AsyncLLM in-process -----------

def _llm_ratios(results: Results) -> list[Ratio]:
    out = []
    for r in results["results"]:
        level = r["levels"].get("32")
        out.append(Ratio(f"llm stage in Triton / AsyncLLM in-process, tok/s at concurrency 32 "
                         f"({r['model']})", None if level is None else level["throughput_ratio"],
                         0.95))
    return out


def _llm_table(results: Results) -> str:
    rows = ["| model | concurrency | in-process tok/s | Triton tok/s | ratio (per round) | "
            "TTFT p50 ms (in-process vs Triton) |", "|---|---:|---:|---:|---|---|"]
    for r in results["results"]:
        for c, lv in r["levels"].items():
            per = ", ".join(f"{x:.2f}" for x in lv["throughput_ratio_per_round"])
            rows.append(f"| {r['model']} | {c} | {lv['inprocess']['tok_s']:.0f} | "
                        f"{lv['triton']['tok_s']:.0f} | **{lv['throughput_ratio']:.2f}** ({per}) | "
                        f"{lv['inprocess']['ttft_p50_ms']:.0f} vs {lv['triton']['ttft_p50_ms']:.0f} |")
    return "\n".join(rows)


def _llm_plots(results: Results, folder: Path) -> list[Path]:
    out = []
    for r in results["results"]:
        xs = [int(c) for c in r["levels"]]
        out.append(plots.lines(
            folder / f"llm_stage_{r['model']}.png", f"omni_llm stage vs in-process ({r['model']})",
            "concurrency", "output tokens/s", xs,
            {side: [lv[side]["tok_s"] for lv in r["levels"].values()]
             for side in ("inprocess", "triton")}))
    return out


LLM = _child_scenario(
    "llm", "llm_stage", "LLM stage: tritonserver vs the same vLLM AsyncLLM in-process",
    ["--models", "qwen2-tiny", "--rounds", "2", "--concurrency", "1", "8", "32"],
    _llm_ratios, _llm_table, _llm_plots)


# --- dit: dynamic batching vs max_batch_size 1 -------------------------------------------

def _dit_ratios(results: Results) -> list[Ratio]:
    level = results["levels"].get("8")
    return [Ratio("DiT stage dynamic batching / max_batch_size 1, images/s at concurrency 8",
                  None if level is None else level["ratio"], 2.0)]


def _dit_table(results: Results) -> str:
    rows = ["| concurrency | batched images/s | max_batch_size 1 images/s | ratio (per round) |",
            "|---:|---:|---:|---|"]
    for c, lv in results["levels"].items():
        per = ", ".join(f"{x:.2f}" for x in lv["ratio_per_round"])
        rows.append(f"| {c} | {lv['batched_images_s']:.1f} | {lv['mbs1_images_s']:.1f} | "
                    f"**{lv['ratio']:.2f}** ({per}) |")
    return "\n".join(rows)


def _dit_plots(results: Results, folder: Path) -> list[Path]:
    levels = results["levels"]
    return [plots.lines(folder / "dit_batching.png", "DiT stage: images/s", "concurrency",
                        "images/s", [int(c) for c in levels],
                        {"dynamic batching": [lv["batched_images_s"] for lv in levels.values()],
                         "max_batch_size 1": [lv["mbs1_images_s"] for lv in levels.values()]})]


DIT = _child_scenario("dit", "dit_batching", "DiT stage: Triton dynamic batching vs batch size 1",
                      ["--rounds", "2", "--requests", "24"], _dit_ratios, _dit_table, _dit_plots)


# --- dit-cache: FirstBlockCache speed and quality -------------------------------------------

def _cache_table(results: Results) -> str:
    rows = ["| threshold | speedup (uncached / cached time) | PSNR dB | SSIM |", "|---:|---:|---:|---:|"]
    for r in results["rows"]:
        rows.append(f"| {r['threshold']} | {r['speedup']:.2f} | {r['psnr_db']:.1f} | "
                    f"{r['ssim']:.3f} |")
    split = results.get("split_s", {})
    if split:
        rows.append("\nUncached time per image: " + ", ".join(
            f"{k} {v * 1000:.0f} ms" for k, v in split.items()))
    return "\n".join(rows)


DIT_CACHE = _child_scenario("dit-cache", "dit_cache",
                            "DiT step cache (FirstBlockCache): speed and quality",
                            ["--repeats", "2"], table=_cache_table)


# --- pipelining: omni-chat pipelined vs stage by stage, first audio ------------------------

def _omni_ratios(results: Results) -> list[Ratio]:
    levels, lengths = results["levels"], results.get("lengths") or {}
    at8 = levels.get("8")
    out = [Ratio("omni-chat pipelined / stage-by-stage, requests/s at concurrency 8",
                 None if at8 is None else at8["throughput_ratio"], 1.5)]
    if "128" in lengths:  # the 128-token reply, spoken at a speaking rate
        codes = 128 * results["sweep_codes_per_token"]
        out.append(Ratio(f"omni-chat first audio / full response, p50 at concurrency 1 "
                         f"(128-token reply spoken as {codes} codes, "
                         f"{lengths['128']['audio_s_mean']:.0f} s)",
                         lengths["128"]["ttfa_over_total_p50"], 0.10, "<="))
    at1, tokens, codes = levels.get("1"), results.get("max_tokens"), results.get("talker_codes")
    spoken = f" spoken as {codes} codes" if codes else ""
    out.append(Ratio(f"omni-chat first audio / full response, p50 at concurrency 1 "
                     f"({tokens}-token reply{spoken})",
                     None if at1 is None else at1["pipelined"]["ttfa_over_total_p50"], 0.10, "<="))
    return out


def _omni_table(results: Results) -> str:
    rows = ["| concurrency | mode | requests/s | first audio p50 s | total p50 s | "
            "first audio / total | TTFT p50 s | audio s per reply |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c, lv in results["levels"].items():
        for mode in ("pipelined", "sequential"):
            m = lv[mode]
            rows.append(f"| {c} | {mode} | {m['requests_s']:.2f} | {m['ttfa_p50']:.2f} | "
                        f"{m['total_p50']:.2f} | {m['ttfa_over_total_p50']:.2f} | "
                        f"{m['ttft_p50']:.3f} | {m['audio_s_mean']:.1f} |")
    lengths = results.get("lengths") or {}
    if lengths:
        rows += ["", "First audio against reply length (pipelined, concurrency 1, "
                 f"{results['sweep_codes_per_token']} talker codes per reply token):", "",
                 "| reply tokens | audio s | first audio p50 s | total p50 s | first audio / total |",
                 "|---:|---:|---:|---:|---:|"]
        rows += [f"| {n} | {m['audio_s_mean']:.1f} | {m['ttfa_p50']:.2f} | {m['total_p50']:.2f} | "
                 f"{m['ttfa_over_total_p50']:.2f} |" for n, m in lengths.items()]
    return "\n".join(rows)


def _omni_plots(results: Results, folder: Path) -> list[Path]:
    levels = results["levels"]
    xs = [int(c) for c in levels]
    out = [plots.lines(folder / "omni_pipelining.png", "omni-chat speech replies: requests/s",
                       "concurrency", "requests/s", xs,
                       {m: [lv[m]["requests_s"] for lv in levels.values()]
                        for m in ("pipelined", "sequential")}),
           plots.lines(folder / "omni_first_audio.png", "omni-chat: first audio and full reply",
                       "concurrency", "seconds (p50)", xs,
                       {"first audio (pipelined)": [lv["pipelined"]["ttfa_p50"]
                                                    for lv in levels.values()],
                        "full reply (pipelined)": [lv["pipelined"]["total_p50"]
                                                   for lv in levels.values()],
                        "first audio (sequential)": [lv["sequential"]["ttfa_p50"]
                                                     for lv in levels.values()]})]
    lengths = results.get("lengths") or {}
    if lengths:
        out.append(plots.lines(folder / "omni_first_audio_vs_length.png",
                               "omni-chat: first audio vs reply length (concurrency 1)",
                               "reply tokens", "seconds (p50)", [int(n) for n in lengths],
                               {"first audio": [m["ttfa_p50"] for m in lengths.values()],
                                "full reply": [m["total_p50"] for m in lengths.values()]}))
    return out


PIPELINING = _child_scenario(
    "pipelining", "pipelining", "omni-chat: pipelined vs stage-by-stage, first audio",
    ["--rounds", "2", "--max-tokens", "64", "--requests-per-slot", "1"],
    _omni_ratios, _omni_table, _omni_plots)


# --- on demand: not in `omni-bench all` (figures in docs/benchmarks-notes.md) ----------------

SPLIT = _child_scenario(
    "split", "split", "omni-chat on one tritonserver vs the thinker on a second one", [],
    in_all=False)
SPIN = _child_scenario(
    "spin", "spin", "LLM stage: vLLM's sched_yield spin vs the omni plugin's short sleep", [],
    in_all=False)
COLD_START = _child_scenario(
    "cold-start", "cold_start", "omni-chat: first speech requests on a fresh server, cancelled",
    [], in_all=False)
HIDDEN_STATES = _child_scenario(
    "hidden-states", "hidden_states", "LLM stage: what streaming hidden states costs", [],
    in_all=False)
STREAM_ERRORS = _child_scenario(
    "stream-errors", "stream_errors",
    "Triton: gRPC streams that end in an error, with or without triton_grpc_error", [],
    in_all=False)
UNARY_CANCEL = _child_scenario(
    "unary-cancel", "unary_cancel", "Triton: unary calls cancelled while queued, running or done",
    [], in_all=False)
FIRST_CHUNK = _child_scenario(
    "first-chunk", "first_chunk",
    "omni-chat: the first audio chunk's size vs first audio and playback stalls, per family",
    [], in_all=False)
DECODER = _child_scenario(
    "decoder", "decoder_cost",
    "Audio stage: Token2Wav per chunk, with and without the speaker-encoder memo, 1 or 2 threads",
    [], in_all=False)
SERVER_START = _child_scenario(
    "server-start", "server_start",
    "Server start: a fresh tritonserver's launch to ready, per preset, engine cores forked or "
    "spawned", [], in_all=False)

"""Scenario `timeline`: where one speech request's time goes, hop by hop.

Runs in the omni-bench process. For each model it starts tritonserver serving the
omni-chat preset on it (tiny Qwen2.5-Omni, or the tiny Qwen3-Omni:
transformers_baseline.served_spec), sends speech requests with `return_timeline` at
each concurrency through omni_client, and reads the orchestrator's timeline of each
(orchestrator/events.py): when each stage call was sent and answered first and last,
and when each audio chunk went out. It keeps every timeline as JSON in `--out`, draws
the median request's (one row per stage call: a bar from sent to last response, a mark
at the first), and reports the median of each hop from the request's start to its
first audio, and the time no stage call was in flight.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import Any

from omni_tools.bench.scenario import Results, Scenario

Timeline = Mapping[str, Any]  # the `timeline` of an omni request's final metrics


# --- one timeline --------------------------------------------------------------------

def _calls(t: Timeline, stage: str) -> list[Mapping[str, Any]]:
    return [c for c in t["calls"] if c["stage"] == stage]


def _steps(t: Timeline, step: str) -> list[float]:
    return [s["at_s"] for s in t["steps"] if s["step"] == step]


def idle_s(t: Timeline) -> float:
    """Seconds of the request during which no stage call was in flight (the orchestrator,
    gRPC and the event loop's own time, and waits for nothing)."""
    spans = sorted((c["sent_s"], c["last_s"] if c["last_s"] is not None else t["end_s"])
                   for c in t["calls"])
    busy, reach = 0.0, 0.0
    for start, end in spans:
        start = max(start, reach)
        if end > start:
            busy += end - start
            reach = end
    return t["end_s"] - busy


def hops(t: Timeline) -> dict[str, float | None]:
    """A speech request's hops, in seconds (None where the request had no such hop)."""
    thinker = (_calls(t, "thinker") or [None])[0]
    talker = (_calls(t, "talker") or [None])[0]
    decoder = (_calls(t, "audio_decoder") or [None])[0]
    out = (_steps(t, "audio_out") or [None])[0]

    def gap(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    return {
        "start -> task started": (_steps(t, "task_started") or [None])[0],
        "start -> thinker sent": thinker and thinker["sent_s"],
        "thinker sent -> first token": thinker and gap(thinker["sent_s"], thinker["first_s"]),
        "thinker first token -> talker sent": thinker and talker and gap(
            thinker["first_s"], talker["sent_s"]),
        "talker sent -> first codes": talker and gap(talker["sent_s"], talker["first_s"]),
        "first codes -> first decoder chunk sent": talker and decoder and gap(
            talker["first_s"], decoder["sent_s"]),
        "first decoder chunk: sent -> back": decoder and gap(decoder["sent_s"],
                                                             decoder["last_s"]),
        "decoder chunk back -> first audio out": decoder and gap(decoder["last_s"], out),
        "start -> first audio out": out,
        "start -> end": t["end_s"],
        "no stage call in flight": idle_s(t),
    }


# the orchestrator's own hops: no stage call is waited for in them (the other hops wait
# for a stage's output: its compute, its queue and the gRPC hop to it)
OVERHEAD_HOPS = ("start -> task started", "start -> thinker sent", "decoder chunk back -> first audio out",
                 "no stage call in flight")


def median_hops(timelines: Sequence[Timeline]) -> dict[str, float | None]:
    """The median of each hop over `timelines` (None where no request had it)."""
    rows = [hops(t) for t in timelines]
    out: dict[str, float | None] = {}
    for name in rows[0] if rows else ():
        values = [r[name] for r in rows if r[name] is not None]
        out[name] = median(values) if values else None
    return out


# --- the picture ---------------------------------------------------------------------

def draw(path: Path, t: Timeline, title: str) -> Path:
    """One row per stage call (in the order sent): a bar from sent to last response and a
    mark at the first; a last row with the orchestrator's steps."""
    from omni_tools.bench.plots import _figure, _save

    plt, fig, ax = _figure()
    fig.set_size_inches(8.0, 0.9 + 0.28 * (len(t["calls"]) + 1))
    labels: list[str] = []
    counts: dict[str, int] = {}
    for row, call in enumerate(t["calls"]):
        counts[call["stage"]] = counts.get(call["stage"], 0) + 1
        many = len(_calls(t, call["stage"])) > 1
        labels.append(f"{call['stage']} {counts[call['stage']]}" if many else call["stage"])
        last = call["last_s"] if call["last_s"] is not None else t["end_s"]
        ax.barh(row, last - call["sent_s"], left=call["sent_s"], height=0.6,
                color=f"C{list(counts).index(call['stage']) % 10}")
        if call["first_s"] is not None:
            ax.plot([call["first_s"]], [row], marker="|", markersize=12, color="black")
    row = len(t["calls"])
    labels.append("orchestrator")
    for step in t["steps"]:
        ax.plot([step["at_s"]], [row], marker="v" if step["step"] == "audio_out" else "o",
                color="C3" if step["step"] == "audio_out" else "C7", linestyle="none")
    ax.set_yticks(range(len(labels)), labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlim(0, t["end_s"] * 1.02)
    ax.set(title=title, xlabel="s from the request's start (bar: sent -> last response, "
                               "|: first response, v: audio out)")
    return _save(plt, fig, path)


# --- the run -------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    from omni_tools.bench.transformers_baseline import MODELS

    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=["tiny", "qwen3-tiny"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, default=8, help="per concurrency (at least it)")
    ap.add_argument("--max-tokens", type=int, default=32, help="thinker reply tokens")
    ap.add_argument("--talker-tokens", type=int, default=None,
                    help="talker codes (default: the family's, as `omni-bench transformers`)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for every timeline (JSON) and its pictures (default: a temp "
                         "folder)")


def _request(client: Any, text: str, options: dict[str, Any]) -> dict[str, Any]:
    from omni_client.types import AudioChunk, Final

    t0 = time.perf_counter()
    first_audio = None
    metrics: Mapping[str, Any] = {}
    for event in client.stream(text, timeout=600, **options):
        if isinstance(event, AudioChunk) and first_audio is None:
            first_audio = time.perf_counter() - t0
        elif isinstance(event, Final):
            metrics = event.metrics
    if "timeline" not in metrics:
        raise RuntimeError(f"the reply to {text!r} has no timeline: {dict(metrics)}")
    return {"client_first_audio_s": first_audio, "client_latency_s": time.perf_counter() - t0,
            "timeline": metrics["timeline"]}


def measure(client: Any, texts: Sequence[str], concurrency: int,
            options: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Every request's timeline and what the client saw of it, `concurrency` at a time."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda i: _request(client, texts[i], options(i)),
                             range(len(texts))))


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-hop medians, the client's first audio and latency, and the median request."""
    timelines = [r["timeline"] for r in rows]
    by_latency = sorted(rows, key=lambda r: r["timeline"]["end_s"])
    client = [r["client_first_audio_s"] for r in rows if r["client_first_audio_s"] is not None]
    # the entry hop: client -> Triton -> the orchestrator's task, and its first audio back
    entry = [r["client_first_audio_s"] - _steps(r["timeline"], "audio_out")[0] for r in rows
             if r["client_first_audio_s"] is not None and _steps(r["timeline"], "audio_out")]
    return {"requests": len(rows), "hops_p50": median_hops(timelines),
            "client_first_audio_s_p50": median(client) if client else None,
            "entry_s_p50": median(entry) if entry else None,
            "client_latency_s_p50": median(r["client_latency_s"] for r in rows),
            "example": by_latency[len(by_latency) // 2]["timeline"]}


def _run_model(model: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from omni_client import OmniClient
    from omni_tools import gen_repo
    from omni_tools.bench.transformers_baseline import (
        ENTRY,
        MODELS,
        omni_options,
        prompts,
        served_spec,
    )
    from omni_tools.server import TritonServer

    family = MODELS[model].family
    talker_tokens = args.talker_tokens or family.talker_tokens
    work = Path(tempfile.mkdtemp(prefix=f"omni-bench-timeline-{model}-"))
    repo = work / "repo"
    gen_repo.generate(served_spec(model, work), repo, force=True)

    def options(i: int) -> dict[str, Any]:
        opts = omni_options(args.max_tokens, talker_tokens, "", seed=i)
        opts.pop("voice")  # the stage's own
        return {**opts, "inputs": {"return_timeline": True}}

    result: dict[str, Any] = {"family": family.title, "talker_tokens": talker_tokens,
                              "concurrency": {}}
    with TritonServer(repo, log_path=work / "tritonserver.log") as server, \
            OmniClient(server.grpc_url, timeout=600, model=ENTRY) as client:
        measure(client, prompts(2), 2, options)  # warm-up
        for c in args.concurrency:
            load = os.getloadavg()[0]
            rows = measure(client, prompts(max(args.requests, c)), c, options)
            (out / f"timeline-{model}-c{c}.json").write_text(json.dumps(rows, indent=1) + "\n")
            result["concurrency"][str(c)] = {**summarize(rows), "load_average_1m": load}
            print(f"timeline {model} c={c}: " + ", ".join(
                f"{k} {v * 1000:.0f} ms" for k, v in
                result["concurrency"][str(c)]["hops_p50"].items() if v is not None), flush=True)
    return result


def run(args: argparse.Namespace) -> Results:
    out = args.out or Path(tempfile.mkdtemp(prefix="omni-bench-timeline-"))
    out.mkdir(parents=True, exist_ok=True)
    results: Results = {"max_tokens": args.max_tokens, "models": {}, "artifacts": str(out)}
    for model in args.models:
        results["models"][model] = _run_model(model, args, out)
    plots(results, out)
    return results


def plots(results: Results, folder: Path) -> list[Path]:
    """The median request's timeline per model and concurrency."""
    paths = []
    for model, r in results["models"].items():
        for c, level in r["concurrency"].items():
            paths.append(draw(
                folder / f"timeline-{model}-c{c}.png", level["example"],
                f"{r['family']} (tiny): a median speech request at concurrency {c}"))
    return paths


def table(results: Results) -> str:
    levels = [(model, r, c, level) for model, r in results["models"].items()
              for c, level in r["concurrency"].items()]
    head = " | ".join(f"{r['family']} c={c}" for _, r, c, _ in levels)
    rows = [f"Speech replies of {results['max_tokens']} thinker tokens; medians in ms over "
            "each run's requests, from the orchestrator's `return_timeline` (seconds from the "
            "request's start at which each stage call was sent and answered). Rows marked * "
            "wait for no stage: they are the pipeline's overhead; the others wait for a "
            "stage's output (its compute and queue, and the gRPC hop to it).", "",
            f"| hop | {head} |", "|---|" + "---:|" * len(levels)]
    names = list(levels[0][3]["hops_p50"]) if levels else []
    for name in names:
        mark = "*" if name in OVERHEAD_HOPS else ""
        cells = " | ".join("–" if lv["hops_p50"][name] is None else
                           f"{lv['hops_p50'][name] * 1000:.0f}" for *_, lv in levels)
        rows.append(f"| {name}{mark} | {cells} |")
    cells = " | ".join("–" if lv["client_first_audio_s_p50"] is None else
                       f"{lv['client_first_audio_s_p50'] * 1000:.0f}" for *_, lv in levels)
    rows.append(f"| first audio at the client | {cells} |")
    cells = " | ".join("–" if lv.get("entry_s_p50") is None else
                       f"{lv['entry_s_p50'] * 1000:.0f}" for *_, lv in levels)
    rows.append(f"| entry hop (client's first audio - the orchestrator's)* | {cells} |")
    loads = ", ".join(f"{r['family']} c={c} {lv['load_average_1m']:.1f}"
                      for _, r, c, lv in levels)
    rows += ["", f"Load average (1 min) when each run began: {loads}."]
    return "\n".join(rows)


SCENARIO = Scenario(name="timeline", title="Where a request's time goes (per-request timeline)",
                    add_arguments=add_arguments, run=run, table=table, plots=plots,
                    quick=["--concurrency", "1", "--requests", "4"])

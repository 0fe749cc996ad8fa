"""Benchmark: the first audio chunk's size against first audio and playback stalls, per family.

Runs as omni-bench's child process (`omni-bench first-chunk -- ...`). Per model
(omni-bench transformers' MODELS: `tiny` is Qwen2.5-Omni, `qwen3-tiny` Qwen3-Omni) one
tritonserver serves the omni-chat preset on that checkpoint (without text_to_image)
with one orchestrator per `--first` value (`omni_first<N>`, the same stages behind
them, only `first_chunk_codes` differs, `min_first_chunk_codes` set to it so the size
is fixed) and per `--adaptive LEAST-MOST` (`omni_first<LEAST>_<MOST>`: the first chunk
sized from the measured pace, orchestrator/pace.py; `LEAST-MOST/NEXT`: the later
chunks too, from NEXT up), so every variant is measured on
the same engines, order alternating per round. Each request: a reply of `--max-tokens`
tokens (ignore_eos) spoken as `--codes-per-token` talker codes per token (min_tokens
= max_tokens, greedy), `--concurrency` at a time.

Per request the client plays the audio as it comes: playback starts when the first
chunk arrives, and a chunk that arrives after the audio before it has finished
playing is a stall (its wait is stall time). The smallest first chunk after which
the second chunk never came late (at every concurrency where some size managed that)
is the family's default
(`Family.speech_chunks`); docs/omni-chat.md has the figures.

    omni-bench first-chunk -- --models tiny qwen3-tiny --first 4 8 12 24 --adaptive 4-12
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from omni_tools.bench.scenario import results_file, write_results
from omni_tools.bench.stats import median, pct

ENTRY = "omni"


class Stalls(NamedTuple):
    count: int  # gaps heard
    seconds: float  # their total length
    first: int | None  # the index of the first chunk that came late; None: none did


def stalls(chunks: Iterable[tuple[float, float]]) -> Stalls:
    """The gaps a listener hears: `chunks` are (arrival, duration) seconds in stream order;
    playback starts at the first arrival and each chunk plays as soon as it has arrived
    and the one before it has finished."""
    count, waited, first, playing_until = 0, 0.0, None, None
    for i, (arrival, duration) in enumerate(chunks):
        if playing_until is not None and arrival > playing_until:
            count += 1
            waited += arrival - playing_until
            first = i if first is None else first
        start = arrival if playing_until is None else max(arrival, playing_until)
        playing_until = start + duration
    return Stalls(count, waited, first)


def _variant(label: str) -> str:
    return f"{ENTRY}_first{label.replace('-', '_').replace('.', '_').replace('/', '_n')}"


def variants(firsts: list[int], adaptive: list[str]) -> dict[str, dict[str, Any]]:
    """{label: the orchestrator's engine_args}: `12` fixed, `4-12` the first chunk sized
    from the pace, `4-12x1.2` with first_chunk_margin 1.2, `4-12/4` the later chunks too,
    from min_chunk_codes 4 (without it they are chunk_codes, whatever the family says)."""
    out: dict[str, dict[str, Any]] = {
        str(f): {"first_chunk_codes": f, "min_first_chunk_codes": f, "min_chunk_codes": None}
        for f in firsts}
    for label in adaptive:
        head, _, later = label.partition("/")
        sizes, _, margin = head.partition("x")
        least, _, most = sizes.partition("-")
        try:
            args = {"first_chunk_codes": int(most), "min_first_chunk_codes": int(least),
                    "min_chunk_codes": int(later) if later else None}
            if margin:
                args["first_chunk_margin"] = float(margin)
        except ValueError:
            args = {}
        if not args or not 1 <= args["min_first_chunk_codes"] <= args["first_chunk_codes"] \
                or (args["min_chunk_codes"] is not None and args["min_chunk_codes"] < 1):
            raise SystemExit(f"--adaptive {label!r}: give LEAST-MOST[xMARGIN][/NEXT], "
                             "e.g. 4-12, 4-12x1.2 or 4-12/4")
        out[label] = args
    return out


def served_spec(model: str, sizes: dict[str, dict[str, Any]], work: Path) -> Any:
    """omni-bench transformers' served spec for `model`, with one orchestrator per variant."""
    from omni_tools import spec
    from omni_tools.bench.transformers_baseline import served_spec as base_spec

    base = base_spec(model, work)
    data = base.model_dump(mode="json", exclude_none=True)
    orchestrator = data["stages"].pop(ENTRY)
    for label, engine_args in sizes.items():
        stage = json.loads(json.dumps(orchestrator))
        stage.setdefault("engine_args", {}).update(engine_args)
        data["stages"][_variant(label)] = stage
    data["entry"] = _variant(next(iter(sizes)))
    return spec.parse_spec(data, base_dir=work, source=f"{base.source} (first-chunk variants)")


def one_request(client: Any, model: str, text: str, options: dict[str, Any]) -> dict[str, Any]:
    """One streamed speech request: first audio, full response, stalls while playing it."""
    from omni_client.types import AudioChunk, Final

    t0 = time.perf_counter()
    chunks: list[tuple[float, float]] = []
    codes = None  # the server's metrics: the talker steps the first chunk voiced
    for event in client.stream(text, model=model, timeout=600, **options):
        if isinstance(event, AudioChunk):
            chunks.append((time.perf_counter() - t0, event.duration_s))
        elif isinstance(event, Final):
            codes = event.metrics.get("first_chunk_codes")
    total = time.perf_counter() - t0
    if not chunks:
        raise RuntimeError(f"no audio in the reply to {text!r}")
    heard = stalls(chunks)
    return {"ttfa_s": chunks[0][0], "latency_s": total, "stalls": heard.count,
            "stall_s": heard.seconds, "second_chunk_late": heard.first == 1,
            "first_chunk_audio_s": chunks[0][1], "audio_s": sum(d for _, d in chunks),
            "first_chunk_codes": codes}


def level(client: Any, model: str, texts: list[str], concurrency: int,
          options: dict[str, Any]) -> dict[str, Any]:
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda t: one_request(client, model, t, options), texts))
    return {"ttfa_s_p50": median([r["ttfa_s"] for r in rows]),
            "ttfa_s_p90": pct([r["ttfa_s"] for r in rows], 90),
            "latency_s_p50": median([r["latency_s"] for r in rows]),
            "stalled_requests": sum(r["stalls"] > 0 for r in rows), "requests": len(rows),
            # the stall a bigger first chunk would cover: the second chunk came late
            "second_chunk_late": sum(r["second_chunk_late"] for r in rows),
            "stall_s_mean": sum(r["stall_s"] for r in rows) / len(rows),
            "first_chunk_audio_s": median([r["first_chunk_audio_s"] for r in rows]),
            "first_chunk_codes": sorted(r["first_chunk_codes"] or 0 for r in rows),
            "audio_s_mean": sum(r["audio_s"] for r in rows) / len(rows)}


def run_model(model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from omni_client import OmniClient
    from omni_tools import gen_repo
    from omni_tools.bench.transformers_baseline import MODELS, prompts
    from omni_tools.server import TritonServer

    family = MODELS[model].family
    codes = args.max_tokens * (args.codes_per_token or family.codes_per_token)
    options = {"modalities": ["text", "audio"],
               "sampling_parameters": {"max_tokens": args.max_tokens, "ignore_eos": True,
                                       "temperature": 0},
               "talker_sampling": {"max_tokens": codes, "min_tokens": codes, "temperature": 0}}
    repo = work / model / "repo"
    sizes = variants(args.first, args.adaptive)
    gen_repo.generate(served_spec(model, sizes, work / model), repo, force=True)
    per: dict[int, dict[str, list[dict[str, Any]]]] = {
        c: {f: [] for f in sizes} for c in args.concurrency}
    with TritonServer(repo, log_path=work / model / "tritonserver.log") as server, \
            OmniClient(server.grpc_url, timeout=600) as client:
        for first in sizes:  # warm-up: every orchestrator and the engines' shapes
            level(client, _variant(first), prompts(2, 99), 2, options)
        for rnd in range(args.rounds):
            order = list(sizes) if rnd % 2 == 0 else list(reversed(sizes))
            for c in args.concurrency:
                texts = prompts(max(args.min_requests, args.requests_per_slot * c), rnd)
                for first in order:
                    r = level(client, _variant(first), texts, c, options)
                    per[c][first].append(r)
                    print(f"first-chunk {model} round={rnd} c={c} first={first:>5}: first audio "
                          f"p50 {r['ttfa_s_p50']:.3f} s, full p50 {r['latency_s_p50']:.3f} s, "
                          f"stalled {r['stalled_requests']}/{r['requests']} "
                          f"(second chunk late {r['second_chunk_late']}) "
                          f"({r['stall_s_mean']:.3f} s each); first chunks "
                          f"{r['first_chunk_codes']}", flush=True)
    levels = {}
    for c, by_first in per.items():
        levels[c] = {first: _merge(rows) for first, rows in by_first.items()}
    return {"family": family.title, "talker_codes": codes, "code_s": family.code_s,
            "levels": levels, "default": choose(levels)}


def _merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one (concurrency, first) cell: medians of their p50s, stalls summed."""
    out = {k: median([r[k] for r in rows]) for k in rows[0]
           if k not in ("stalled_requests", "requests", "second_chunk_late", "first_chunk_codes")}
    out["first_chunk_codes"] = sorted(n for r in rows for n in r["first_chunk_codes"])
    out["stalled_requests"] = sum(r["stalled_requests"] for r in rows)
    out["requests"] = sum(r["requests"] for r in rows)
    out["second_chunk_late"] = sum(r["second_chunk_late"] for r in rows)
    return out


def choose(levels: dict[int, dict[str, dict[str, Any]]]) -> int | None:
    """The smallest fixed first chunk after which the second chunk never came late (`levels`:
    {concurrency: {label: cell}}, adaptive variants left out), at every concurrency where
    some size managed that.

    The first chunk's size decides only that gap. A level where the second chunk came late
    after every size tried is one where the decoder voices slower than real time: no first
    chunk covers it, so it does not vote. None when no level has a size that managed."""
    clean = {c: {int(f) for f, cell in cells.items()
                 if f.isdigit() and cell["second_chunk_late"] == 0}
             for c, cells in levels.items()}
    voting = [ok for ok in clean.values() if ok]
    ok = set.intersection(*voting) if voting else set()
    return min(ok) if ok else None


def main(argv: list[str] | None = None) -> int:
    from omni_tools.bench.transformers_baseline import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=["tiny", "qwen3-tiny"])
    ap.add_argument("--first", nargs="+", type=int, default=[4, 8, 12, 24],
                    help="fixed first chunk sizes (talker steps: codes, or frames of 16)")
    ap.add_argument("--adaptive", nargs="*", default=[], metavar="LEAST-MOST[xMARGIN][/NEXT]",
                    help="first chunks sized from the measured pace, between LEAST and MOST "
                         "(/NEXT: the later ones too, from NEXT up to chunk_codes)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--codes-per-token", type=int, default=None,
                    help="talker steps per reply token (default: the family's, as in "
                         "omni-bench transformers)")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep the repositories and server logs here (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=results_file("first-chunk"))
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"command": " ".join(["python", *sys.argv]),
                               "max_tokens": args.max_tokens, "models": {}}
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="bench-first-chunk-")))
        for model in args.models:
            results["models"][model] = run_model(model, args, work)
            write_results(args.out, results)
    for model, r in results["models"].items():
        print(f"{model} ({r['family']}): smallest first chunk the second never came late "
              f"after: {r['default']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

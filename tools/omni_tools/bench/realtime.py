"""Scenario `realtime`: concurrent /v1/realtime voice sessions, first audio and real-time factor.

Processes. The omni-bench process starts, as children, tritonserver serving the omni-chat
preset and `omni-openai` in front of it; the sessions are asyncio tasks in the omni-bench
process, each one connection of the official `openai` package's realtime client.

What flows. Each of `--sessions` sessions sets its voice, seed and reply length, then
speaks `--turns` turns: a second of audio (a tone, different per session and turn) as
PCM16 24 kHz appended in 100 ms pieces, committed by hand, then `response.create`. Per
turn: first audio = commit sent -> first `response.output_audio.delta`; real-time factor
= commit sent -> `response.done` over the seconds of speech received (below 1: the reply
is made faster than it plays). Every concurrency level in `--concurrency` runs all
sessions with that many at once, after a warm-up session.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from omni_tools.bench.scenario import Ratio, Results, Scenario
from omni_tools.bench.stats import pct

PRESET = "omni-chat"
MODEL = "omni"
RATE = 24000
APPEND_BYTES = RATE * 2 // 10  # 100 ms of PCM16
TARGET_FIRST_AUDIO_S = 2.0  # ours: the issue sets no target


# --- one session (asyncio, openai's realtime client) ---------------------------------------

def turn_audio(session: int, turn: int, seconds: float = 1.0) -> bytes:
    """A second of PCM16 24 kHz tone, its pitch set by the session and the turn."""
    t = np.arange(int(seconds * RATE)) / RATE
    freq = 220.0 + 40.0 * session + 10.0 * turn
    return (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes()


async def _session(base_url: str, index: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    turns = []
    async with client.realtime.connect(model=MODEL) as conn:
        await conn.session.update(session={
            "type": "realtime", "audio": {"output": {"voice": args.voice}},
            "max_output_tokens": args.max_tokens, "seed": index})
        for turn in range(args.turns):
            data = turn_audio(index, turn)
            for at in range(0, len(data), APPEND_BYTES):
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(data[at:at + APPEND_BYTES]).decode())
            committed = time.perf_counter()
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first, samples, status = None, 0, None
            while status is None:
                event = await asyncio.wait_for(conn.recv(), args.event_timeout)
                if event.type == "response.output_audio.delta":
                    first = first or time.perf_counter()
                    samples += len(base64.b64decode(event.delta)) // 2
                elif event.type == "response.done":
                    status = event.response.status
                elif event.type == "error":
                    raise RuntimeError(f"session {index}: {event.error.message}")
            done = time.perf_counter()
            audio_s = samples / RATE
            turns.append({"session": index, "turn": turn, "status": status,
                          "first_audio_s": None if first is None else first - committed,
                          "audio_s": audio_s,
                          "rtf": (done - committed) / audio_s if audio_s else None})
    return turns


async def _level(base_url: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> list[dict[str, Any]]:
        async with gate:
            return await _session(base_url, index, args)

    started = time.perf_counter()
    per_session = await asyncio.gather(*(one(i) for i in range(args.sessions)))
    wall = time.perf_counter() - started
    return summarize([t for turns in per_session for t in turns], wall)


def summarize(turns: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """First-audio and real-time-factor percentiles of a level's turns."""
    first = [t["first_audio_s"] for t in turns if t["first_audio_s"] is not None]
    rtf = [t["rtf"] for t in turns if t["rtf"] is not None]
    return {"turns": len(turns), "wall_s": wall_s,
            "audio_s": sum(t["audio_s"] for t in turns),
            "first_audio_p50_s": pct(first, 50), "first_audio_p99_s": pct(first, 99),
            "rtf_p50": pct(rtf, 50), "rtf_p99": pct(rtf, 99),
            "statuses": sorted({t["status"] for t in turns})}


# --- the scenario --------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--sessions", type=int, default=4, help="sessions per level")
    ap.add_argument("--turns", type=int, default=3, help="turns per session")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_output_tokens per reply")
    ap.add_argument("--voice", default="alloy")
    ap.add_argument("--event-timeout", type=float, default=300.0,
                    help="seconds to wait for any one server event")


def run(args: argparse.Namespace) -> Results:
    from omni_tools import gen_repo, spec
    from omni_tools.server import OpenAIFrontend, TritonServer

    work = Path(tempfile.mkdtemp(prefix="omni-bench-realtime-"))  # logs stay for a look
    print(f"realtime: logs in {work}", flush=True)
    repo = work / "repo"
    gen_repo.generate(spec.load_preset(PRESET), repo, force=True)
    levels = {}
    with TritonServer(repo, log_path=work / "tritonserver.log") as triton, \
            OpenAIFrontend(triton.grpc_url, log_path=work / "omni-openai.log") as front:
        warm = argparse.Namespace(**{**vars(args), "turns": 1})
        asyncio.run(_session(front.base_url, 0, warm))
        for c in args.concurrency:
            levels[str(c)] = m = asyncio.run(_level(front.base_url, c, args))
            print(f"realtime c={c}: first audio p50 {m['first_audio_p50_s']:.2f} s, p99 "
                  f"{m['first_audio_p99_s']:.2f} s; RTF p50 {m['rtf_p50']:.2f}, p99 "
                  f"{m['rtf_p99']:.2f}", flush=True)
    return {"levels": levels, "sessions": args.sessions, "turns": args.turns,
            "max_tokens": args.max_tokens, "voice": args.voice,
            "notes": f"{PRESET} preset (tiny Qwen2.5-Omni, random weights) on CPU; the "
                     "sessions' client runs on the same cores. First audio is measured "
                     "from the commit, as the client sees it."}


def ratios(results: Results) -> list[Ratio]:
    level = results["levels"].get("1")
    return [Ratio("realtime first audio p50 after the commit, one session (s)",
                  None if level is None else level["first_audio_p50_s"], TARGET_FIRST_AUDIO_S,
                  op="<=", note="our own target" if level else "concurrency 1 not measured")]


def table(results: Results) -> str:
    rows = ["| concurrent sessions | turns | first audio p50 / p99 s | real-time factor "
            "p50 / p99 | speech s | wall s |", "|---:|---:|---|---|---:|---:|"]
    for c, lv in sorted(results["levels"].items(), key=lambda kv: int(kv[0])):
        rows.append(f"| {c} | {lv['turns']} | {lv['first_audio_p50_s']:.2f} / "
                    f"{lv['first_audio_p99_s']:.2f} | {lv['rtf_p50']:.2f} / {lv['rtf_p99']:.2f} "
                    f"| {lv['audio_s']:.1f} | {lv['wall_s']:.0f} |")
    rows.append(f"\n{results['sessions']} sessions of {results['turns']} turns per level (a "
                f"second of tone committed by hand, replies of up to {results['max_tokens']} "
                f"tokens, voice {results['voice']}). Real-time factor: commit -> response.done "
                "over the seconds of speech (below 1: made faster than it plays).")
    return "\n".join(rows)


SCENARIO = Scenario(
    name="realtime", title="/v1/realtime voice sessions: first audio and real-time factor",
    add_arguments=add_arguments, run=run,
    quick=("--concurrency", "1", "4", "--sessions", "4", "--turns", "2"),
    ratios=ratios, table=table)

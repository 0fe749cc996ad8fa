"""Benchmark: the first speech requests on a freshly started omni-chat server, then cancelled.

Starts a new tritonserver on the omni-chat preset (nothing warmed by earlier
requests), sends `--waves` waves of `--concurrency` long speech requests
(text + audio out, `--tokens` greedy tokens with ignore_eos) through the
asyncio SDK, cancels each `--cancel-after` seconds after its first text, and
measures per request: time to first text and first audio, and the longest
silence between two events of its stream; per wave: the longest gap of a
process beside the server that sleeps 10 ms in a loop (other processes'
wake-ups), how long
after the last cancel every vLLM engine reports no running request, and
whether any token was generated after that.

    omni-bench cold-start
    omni-bench cold-start -- --busy 2   # beside two CPU-bound loops
    omni-bench cold-start -- --server-env OMNI_VLLM_SPIN_SLEEP_MAX_US=50

Prints one line per request and per wave and a summary; exits non-zero when a
first text took longer than `--ttft-bound` or an engine stayed busy for more
than `--idle-bound` seconds after the cancels. The `cold-start` scenario of
omni-bench (its child process; on demand).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from omni_client import AsyncOmniClient, AudioChunk, TextDelta
from omni_tools.bench.scenario import results_file, write_results
from omni_tools.server import TritonServer, metric_sample

ENGINES = ("llm", "talker")
# Beside the server while a wave runs: sleeps 10 ms in a loop, prints its longest gap (s).
HEARTBEAT = """
import sys, time
start = last = time.monotonic(); worst = 0.0
while True:
    time.sleep(0.01)
    now = time.monotonic(); worst = max(worst, now - last); last = now
    if now - start > float(sys.argv[1]): break
print(worst)
"""
PROMPT = "speak for a long time"


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def engine_state(url: str) -> dict[str, tuple[float, float]]:
    """engine -> (running requests, generated tokens so far)."""
    text = _scrape(url)
    return {e: (metric_sample(text, "omni_llm_engine_running_requests", model=e),
                metric_sample(text, "omni_llm_generation_tokens_total", model=e))
            for e in ENGINES}


async def one_request(client: AsyncOmniClient, index: int, args) -> dict:
    """One long speech request, cancelled `args.cancel_after` s after its first text."""
    loop = asyncio.get_running_loop()
    row: dict = {"request": index}
    t0 = time.monotonic()
    last = t0
    silence = 0.0  # the longest wait between two events after the first text
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(None) as deadline:
            async with contextlib.aclosing(client.stream(
                    PROMPT, modalities=["text", "audio"], max_tokens=args.tokens, temperature=0,
                    sampling_parameters={"ignore_eos": True}, seed=index)) as stream:
                async for event in stream:
                    now = time.monotonic()
                    if "first_text_s" in row:
                        silence = max(silence, now - last)
                    last = now
                    if isinstance(event, TextDelta) and "first_text_s" not in row:
                        row["first_text_s"] = round(now - t0, 3)
                        deadline.reschedule(loop.time() + args.cancel_after)
                    if isinstance(event, AudioChunk) and "first_audio_s" not in row:
                        row["first_audio_s"] = round(now - t0, 3)
    row["cancelled_at_s"] = round(time.monotonic() - t0, 3)
    row["longest_silence_s"] = round(max(silence, time.monotonic() - last), 3)
    return row


async def wave(server: TritonServer, first: int, args) -> tuple[list[dict], dict]:
    beat = subprocess.Popen([sys.executable, "-c", HEARTBEAT, str(args.cancel_after + 2)],
                            stdout=subprocess.PIPE, text=True)
    async with AsyncOmniClient(server.grpc_url, timeout=120) as client:
        rows = await asyncio.gather(*(one_request(client, first + i, args)
                                      for i in range(args.concurrency)))
    cancelled = time.monotonic()  # every request of the wave is cancelled now
    deadline = cancelled + 30
    while True:
        state = engine_state(server.metrics_url)
        if all(running == 0 for running, _ in state.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    idle_s = time.monotonic() - cancelled
    worst_gap = float(beat.communicate(timeout=60)[0].strip())
    await asyncio.sleep(1.0)
    later = engine_state(server.metrics_url)
    return rows, {"heartbeat_worst_gap_s": round(worst_gap, 3), "idle_after_s": round(idle_s, 3),
                  "running_then": {e: state[e][0] for e in ENGINES},
                  "tokens_after_idle": {e: later[e][1] - state[e][1] for e in ENGINES}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1900)
    p.add_argument("--cancel-after", type=float, default=1.0)
    p.add_argument("--ttft-bound", type=float, default=1.5)
    p.add_argument("--idle-bound", type=float, default=5.0)
    p.add_argument("--busy", type=int, default=0, help="CPU-bound loops beside the server")
    p.add_argument("--repo", type=Path, help="an omni-chat repository (default: generate one)")
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the server (repeatable), e.g. "
                        "OMNI_VLLM_SPIN_SLEEP_MAX_US=50 for the earlier fixed 50 us polls")
    p.add_argument("--out", type=Path, default=results_file("cold-start"))
    args = p.parse_args(argv)
    server_env = dict(item.split("=", 1) for item in args.server_env)

    tmp = Path(tempfile.mkdtemp(prefix="bench-cold-start-"))
    repo = args.repo or tmp / "repo"
    if args.repo is None:
        subprocess.run([str(Path(sys.prefix) / "bin" / "omni-gen-repo"), "--preset", "omni-chat",
                        "-o", str(repo)], check=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    server = TritonServer(repo, log_path=tmp / "tritonserver.log", env=server_env)
    requests: list[dict] = []
    waves: list[dict] = []
    try:
        t_start = time.monotonic()
        server.start()
        ready_s = time.monotonic() - t_start
        print(f"server ready in {ready_s:.1f} s (log: {server.log_path})")
        for w in range(args.waves):
            rows, summary = asyncio.run(wave(server, w * args.concurrency, args))
            for row in rows:
                print(json.dumps(row))
            summary["wave"] = w
            print(json.dumps(summary))
            requests.extend(rows)
            waves.append(summary)
    finally:
        server.stop()
        for b in busy:
            b.kill()
    ttfts = [r.get("first_text_s", float("inf")) for r in requests]
    silence = max(r["longest_silence_s"] for r in requests)
    worst_idle = max(w["idle_after_s"] for w in waves)
    worst_beat = max(w["heartbeat_worst_gap_s"] for w in waves)
    late_tokens = sum(sum(w["tokens_after_idle"].values()) for w in waves)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "server_ready_s": round(ready_s, 1),
              "requests": requests, "waves": waves,
              "worst_first_text_s": max(ttfts), "worst_silence_s": silence,
              "worst_idle_after_s": worst_idle, "heartbeat_worst_gap_s": worst_beat,
              "tokens_after_idle": late_tokens}
    print(f"first text: worst {max(ttfts):.3f} s of {len(ttfts)} requests; longest silence in a "
          f"stream {silence:.3f} s; heartbeat gap {worst_beat:.3f} s; engines idle at worst "
          f"{worst_idle:.3f} s after the cancels; {late_tokens:g} tokens generated after that")
    write_results(args.out, result)
    ok = max(ttfts) <= args.ttft_bound and worst_idle <= args.idle_bound and late_tokens == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

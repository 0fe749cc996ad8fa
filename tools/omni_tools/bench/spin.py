"""Benchmark: vLLM's sched_yield() spin vs the omni plugin's short sleep, on the LLM stage.

vLLM's engine core and worker hand every step over through a shared-memory
queue whose reader spins in `os.sched_yield()`; omni_serve's vLLM plugin
(omni_serve/llm/vllm_plugin.py) makes it sleep `OMNI_VLLM_SPIN_SLEEP_US`
microseconds instead (default 50 on CPU). This runs the same text-chat stage
in a real tritonserver both ways, the sides alternating per round, one server
alive at a time, optionally beside `--busy N` CPU-bound processes (other
work on the host), and measures per side:

- throughput and TTFT at each concurrency (perf_analyzer, C++ client, gRPC
  streaming; as the llm scenario);
- other processes' timer wake-ups while one long reply streams: a process
  beside the server sleeps 20 ms in a loop; its longest gap is reported;
- delivery: when the first streamed response of that reply reaches a
  client, and how much of the reply arrives in its last 10% (a burst at the
  end means the responses were held back);
- cancellation: requests cancelled a fixed 0.3 s after they were sent; how
  many tokens the engine still generated (the reply is 1800 tokens).

Sides: `spin` (vLLM's own), `sleep` (the plugin's sleeps, the default), `sleep50` (a
fixed 50 us), `wake` (the sleeps, and each reader woken by its writer,
omni_serve/llm/shm_wake.py, `OMNI_VLLM_SHM_WAKE=1`).

The `spin` scenario of omni-bench (its child process; on demand).

    omni-bench spin -- --rounds 2 --busy 0
    omni-bench spin -- --rounds 3 --sides sleep wake --concurrency 1 8 32
    .venv/bin/python -m omni_tools.bench.spin --report docs/benchmarks/spin.json   # the table
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from omni_client._llm_io import build_inputs
from omni_serve.env import VLLM_SHM_WAKE
from omni_serve.llm.vllm_plugin import ENV, MAX_ENV
from omni_tools.bench.llm_stage import ENGINE_ARGS, pct, perf_analyzer_level
from omni_tools.bench.scenario import results_file, write_results

WAKE_ENV = VLLM_SHM_WAKE.name
# vLLM's own spin; the plugin's sleeps (50 us doubling to 1 ms, the default); a fixed 50 us
# (the earlier default); the sleeps and a reader woken by its writer (omni_serve/llm/shm_wake.py)
SIDES = {"spin": {ENV: "0", WAKE_ENV: "0"}, "sleep": {WAKE_ENV: "0"},
         "sleep50": {MAX_ENV: "50", WAKE_ENV: "0"}, "wake": {WAKE_ENV: "1"}}
LONG = {"temperature": 0, "max_tokens": 1800, "ignore_eos": True}

_HEARTBEAT = """
import sys, time
end = time.monotonic() + float(sys.argv[1]); last = time.monotonic(); worst = 0.0
while time.monotonic() < end:
    time.sleep(0.02)
    now = time.monotonic(); worst = max(worst, now - last); last = now
print(worst)
"""


class _Stream:
    """One gRPC stream to the llm model; response arrival times on the client's clock."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.arrivals: list[float] = []
        self.done: queue.Queue = queue.Queue()

        def on_response(result, error):
            self.arrivals.append(time.monotonic())
            final = error is not None or result.get_response().parameters[
                "triton_final_response"].bool_param
            if final:
                self.done.put(error)

        self.client.start_stream(callback=on_response)

    def send(self, prompt: str, sampling: dict) -> float:
        inputs = build_inputs(prompt, stream=True, sampling_parameters=sampling)
        sent = time.monotonic()
        self.client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
        return sent

    def close(self, cancel: bool) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _generated(server) -> float:
    from omni_tools.server import metric_sample

    return metric_sample(server.metrics(), "omni_llm_generation_tokens_total", model="llm")


def long_reply(server) -> dict:
    """One 1800-token streamed reply with a heartbeat process beside it."""
    beat = subprocess.Popen([sys.executable, "-c", _HEARTBEAT, "6"], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    time.sleep(0.3)
    s = _Stream(server.grpc_url)
    sent = s.send("tell me everything", LONG)
    s.done.get(timeout=120)
    s.close(cancel=False)
    worst_gap = float(beat.communicate(timeout=60)[0].strip())
    arr = [a - sent for a in s.arrivals]
    tail_from = arr[-1] * 0.9
    return {"first_response_s": arr[0], "reply_s": arr[-1], "responses": len(arr),
            "share_in_last_10pct": sum(a >= tail_from for a in arr) / len(arr),
            "heartbeat_worst_gap_s": worst_gap}


def cancels(server, n: int) -> list[dict]:
    """`n` long requests, each cancelled 0.3 s after it was sent."""
    out = []
    for _ in range(n):
        before = _generated(server)
        s = _Stream(server.grpc_url)
        sent = s.send("cancel me", LONG)
        time.sleep(0.3)
        late = time.monotonic() - sent - 0.3  # how late this process woke up
        s.close(cancel=True)
        time.sleep(1.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the counter settles
            a = _generated(server)
            time.sleep(0.5)
            if _generated(server) == a:
                break
        out.append({"tokens_after_cancel": _generated(server) - before, "client_sleep_late_s": late})
    return out


def side_run(name: str, repo: Path, workdir: Path, args, rnd: int) -> dict:
    from omni_tools.server import TritonServer

    server = TritonServer(repo, log_path=workdir / f"triton-{name}-{rnd}.log", env=SIDES[name])
    server.start(timeout=600)
    try:
        perf_analyzer_level(server.grpc_url, 2, 4, 8, workdir)  # warm-up
        levels = {}
        for c in args.concurrency:
            run = perf_analyzer_level(server.grpc_url, c, max(args.min_requests, 2 * c),
                                      args.max_tokens, workdir)
            levels[c] = {"tok_s": run.tok_s, "ttft_ms": [x * 1e3 for x in run.ttft_s]}
            print(f"[{name}] round={rnd} c={c:<3} {run.tok_s:8.1f} tok/s "
                  f"ttft p50 {pct(run.ttft_s, 50) * 1e3:7.1f} ms", flush=True)
        longs = [long_reply(server) for _ in range(args.long_replies)]
        print(f"[{name}] round={rnd} long replies {longs}", flush=True)
        cancelled = cancels(server, args.cancels)
        print(f"[{name}] round={rnd} cancels {cancelled}", flush=True)
        return {"side": name, "round": rnd, "levels": levels, "long_replies": longs,
                "cancels": cancelled}
    finally:
        server.stop()


def summarize(runs: list[dict], concurrency: list[int], sides: list[str]) -> dict:
    out: dict = {}
    for name in sides:
        rs = [r for r in runs if r["side"] == name]
        levels = {}
        for c in concurrency:
            ls = [r["levels"][c] for r in rs]
            ttft = [x for lv in ls for x in lv["ttft_ms"]]
            levels[c] = {"tok_s": sum(lv["tok_s"] for lv in ls) / len(ls),
                         "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99)}
        longs = [x for r in rs for x in r["long_replies"]]
        cs = [x for r in rs for x in r["cancels"]]
        out[name] = {
            "levels": levels,
            "first_response_p50_s": pct([x["first_response_s"] for x in longs], 50),
            "first_response_max_s": max(x["first_response_s"] for x in longs),
            "share_in_last_10pct_p50": pct([x["share_in_last_10pct"] for x in longs], 50),
            "heartbeat_worst_gap_max_s": max(x["heartbeat_worst_gap_s"] for x in longs),
            "reply_s_p50": pct([x["reply_s"] for x in longs], 50),
            "cancels_effective": sum(x["tokens_after_cancel"] < LONG["max_tokens"] / 2 for x in cs),
            "cancels": len(cs),
            "tokens_after_cancel_p50": pct([x["tokens_after_cancel"] for x in cs], 50),
            "client_sleep_late_max_s": max(x["client_sleep_late_s"] for x in cs),
        }
    for base in ("spin", "sleep"):
        if base not in sides:
            continue
        others = [name for name in sides if name not in ("spin", base)]
        key = "" if base == "spin" else f"_{base}"
        out[f"ratio_over_{base}"] = {name: {
            c: out[name]["levels"][c]["tok_s"] / out[base]["levels"][c]["tok_s"]
            for c in concurrency} for name in others}
        out[f"ratio_per_round{key}"] = {name: {c: [
            s["levels"][c]["tok_s"] / p["levels"][c]["tok_s"]
            for s, p in zip([r for r in runs if r["side"] == name],
                            [r for r in runs if r["side"] == base])] for c in concurrency}
            for name in others}
    return out


def to_markdown(report: dict) -> str:
    s = report["summary"]
    lines = [f"busy processes beside the server: {report['busy']}", "",
             "| side | " + " | ".join(f"c={c} tok/s (TTFT p50/p99 ms)" for c in report["concurrency"])
             + " | first response p50 / max s | reply in its last 10% | heartbeat worst gap s "
               "| cancels effective | tokens after cancel p50 |",
             "|---|" + "---:|" * (len(report["concurrency"]) + 5)]
    for name in report["sides"]:
        x = s[name]
        cells = [f"{x['levels'][c]['tok_s']:.0f} ({x['levels'][c]['ttft_p50_ms']:.1f} / "
                 f"{x['levels'][c]['ttft_p99_ms']:.1f})" for c in report["concurrency"]]
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {x['first_response_p50_s']:.2f} / {x['first_response_max_s']:.2f} "
                       f"| {x['share_in_last_10pct_p50']:.0%} | {x['heartbeat_worst_gap_max_s']:.2f} "
                       f"| {x['cancels_effective']}/{x['cancels']} | {x['tokens_after_cancel_p50']:.0f} |")
    lines.append("")
    for base, key in (("spin", ""), ("sleep", "_sleep")):
        for name, ratio in s.get(f"ratio_over_{base}", {}).items():
            rounds = s[f"ratio_per_round{key}"][name]
            lines.append(f"throughput {name}/{base}: " + ", ".join(
                f"c={c}: {ratio[c]:.2f} (per round " + ", ".join(f"{r:.2f}" for r in rounds[c])
                + ")" for c in report["concurrency"]))
    return "\n".join(lines)


def _read_report(path: Path) -> dict:
    """A results file, with its concurrency keys back to ints (files written before the
    third side have one sleep side and its ratios at the top)."""
    report = json.loads(path.read_text())
    summary = report["summary"]
    if "ratio_sleep_over_spin" in summary:
        summary["ratio_over_spin"] = {"sleep": summary.pop("ratio_sleep_over_spin")}
        summary["ratio_per_round"] = {"sleep": summary["ratio_per_round"]}
    report.setdefault("sides", [k for k in summary if not k.startswith("ratio")])
    for name in report["sides"]:
        summary[name]["levels"] = {int(c): lv for c, lv in summary[name]["levels"].items()}
    for key in ("ratio_over_spin", "ratio_per_round", "ratio_over_sleep", "ratio_per_round_sleep"):
        if key in summary:
            summary[key] = {name: {int(c): v for c, v in x.items()}
                            for name, x in summary[key].items()}
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--long-replies", type=int, default=3)
    ap.add_argument("--cancels", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0,
                    help="CPU-bound processes to run beside the server (other work on the host)")
    ap.add_argument("--out", type=Path, default=results_file("spin"))
    ap.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES),
                    help="which sides to run (spin, the baseline of the ratios, always runs)")
    ap.add_argument("--report", type=Path, help="only print the table of a results file")
    args = ap.parse_args(argv)
    if args.report:
        print(to_markdown(_read_report(args.report)))
        return 0
    sides = ["spin"] + [s for s in dict.fromkeys(args.sides) if s != "spin"]

    from omni_tools import gen_repo, spec
    from omni_tools.tiny_models import ensure_model

    workdir = Path(tempfile.mkdtemp(prefix="bench-spin-"))
    path = ensure_model("qwen2-tiny")
    data = {"pipeline": "bench", "stages": {"llm": {
        "backend": "omni_llm", "model": str(path), "engine_args": ENGINE_ARGS}}}
    repo = workdir / "repo"
    gen_repo.generate(spec.parse_spec(data, base_dir=workdir), repo, force=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(args.busy)]
    runs = []
    try:
        for rnd in range(args.rounds):
            order = sides if rnd % 2 == 0 else sides[::-1]
            for name in order:
                runs.append(side_run(name, repo, workdir, args, rnd))
    finally:
        for p in busy:
            p.kill()
    report = {"model": "qwen2-tiny", "engine_args": ENGINE_ARGS, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "busy": args.busy, "concurrency": args.concurrency,
              "sides": sides, "summary": summarize(runs, args.concurrency, sides), "runs": runs}
    print(to_markdown(report))
    write_results(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

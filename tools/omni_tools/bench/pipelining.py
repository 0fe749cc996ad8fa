"""Benchmark: omni-chat speech replies, pipelined vs stage-by-stage, on one tritonserver.

One server serves the omni-chat preset with two entry models over the same
stages: `omni` (the product's orchestrator: the talker starts on the thinker's
first reply tokens, the decoder on the first codec chunk) and `omni_sequential`
(omni_tools.bench.stage_by_stage: thinker, then talker, then decoder, each waiting
for the previous stage to finish, one decoder chunk at a time). Every round
measures each concurrency level on both, order alternating, so drift hits both
alike. Per request the client records the time to the first audio chunk and to the
final response; per level it reports requests/s. Each request: text + a 1 s WAV in,
text + speech out: a reply of exactly --max-tokens tokens (ignore_eos) spoken as
exactly --codes-per-token codes per reply token (talker min_tokens = max_tokens,
greedy: a random-weight talker would otherwise stop at an arbitrary point). Then, at
concurrency 1 on the pipelined model, first audio against reply length for each of
--lengths, spoken at --sweep-codes-per-token (15: Qwen2.5-Omni's codec runs at 50
codes per second of speech, and spoken English is ~3.3 tokens per second, so a
128-token reply is ~38 s of speech). The `pipelining` scenario of omni-bench (its
child process); its request and level are shared with the `split` scenario.

    omni-bench pipelining -- --rounds 2
"""
from __future__ import annotations

import argparse
import io
import json
import queue
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from omni_serve.contract import OMNI
from omni_tools.bench import stage_by_stage
from omni_tools.bench.scenario import results_file, write_results

MODES = {"pipelined": "omni", "sequential": "omni_sequential"}


def wav() -> bytes:
    """1 s of a 330 Hz tone, 16 kHz WAV: every benchmark request's audio."""
    import soundfile as sf

    t = np.arange(16000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def one_request(url: str, model: str, i: int, max_tokens: int, audio: bytes | None, *,
                image: bytes | None = None, modalities: tuple[str, ...] = ("text", "audio"),
                talker_codes: int | None = None) -> dict:
    """Send one streamed request; client-side times to first text, first audio and the end,
    and the orchestrator's own `metrics` JSON (per-stage seconds) from the final response."""
    import tritonclient.grpc as grpcclient

    def t(name, arr, dtype):
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        return x

    sampling = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    inputs = [t(OMNI.TEXT_INPUT, np.array([f"request {i}: tell me a story".encode()], object), "BYTES"),
              t(OMNI.MODALITIES, np.array([m.encode() for m in modalities], object), "BYTES"),
              t(OMNI.SAMPLING_PARAMETERS, np.array([json.dumps(sampling).encode()], object), "BYTES"),
              t(OMNI.SEED, np.array([i], np.int64), "INT64")]
    if talker_codes is not None:
        talker = {"temperature": 0, "max_tokens": talker_codes, "min_tokens": talker_codes}
        inputs.append(t(OMNI.TALKER_SAMPLING_PARAMETERS,
                        np.array([json.dumps(talker).encode()], object), "BYTES"))
    for name, media in ((OMNI.AUDIO, audio), (OMNI.IMAGE, image)):
        if media is not None:
            inputs.append(t(name, np.array([media], object), "BYTES"))
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    t0 = time.perf_counter()
    first_text = first_audio = None
    audio_s = 0.0
    metrics: dict = {}
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            res = result.get_response()
            names = {o.name for o in res.outputs}
            now = time.perf_counter() - t0
            if OMNI.TEXT_OUTPUT in names and first_text is None:
                first_text = now
            if OMNI.AUDIO_CHUNK in names:
                first_audio = first_audio if first_audio is not None else now
                audio_s += result.as_numpy(OMNI.AUDIO_CHUNK).size / int(
                    result.as_numpy(OMNI.SAMPLE_RATE)[0])
            if OMNI.METRICS in names:
                metrics = json.loads(result.as_numpy(OMNI.METRICS)[0])
            final = res.parameters.get("triton_final_response")
            if final and final.bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return {"ttft": first_text, "ttfa": first_audio, "total": time.perf_counter() - t0,
            "audio_s": audio_s, "metrics": metrics}


def level(url: str, model: str, concurrency: int, n: int, max_tokens: int, audio: bytes,
          talker_codes: int | None = None) -> dict:
    """`n` speech requests, `concurrency` at a time: requests/s and latency percentiles."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda i: one_request(url, model, i, max_tokens, audio,
                                                   talker_codes=talker_codes), range(n)))
    wall = time.perf_counter() - t0
    ttfa = [r["ttfa"] for r in rows]
    total = [r["total"] for r in rows]
    stages = {role: float(np.median([r["metrics"].get("stage_seconds", {}).get(role, np.nan)
                                     for r in rows]))
              for role in ("audio_encoder", "thinker", "talker", "audio_decoder")}
    return {"requests_s": n / wall, "ttfa_p50": float(np.median(ttfa)),
            "total_p50": float(np.median(total)),
            "ttfa_over_total_p50": float(np.median([a / b for a, b in zip(ttfa, total)])),
            "ttft_p50": float(np.median([r["ttft"] for r in rows])),
            "audio_s_mean": float(np.mean([r["audio_s"] for r in rows])),
            "ttfa_p99": float(np.percentile(ttfa, 99)), "total_p99": float(np.percentile(total, 99)),
            "ttft_p99": float(np.percentile([r["ttft"] for r in rows], 99)),
            **{f"{role}_s_p50": seconds for role, seconds in stages.items()}}


def main(argv=None) -> int:
    from omni_tools import gen_repo, spec
    from omni_tools.server import TritonServer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests-per-slot", type=int, default=2,
                    help="requests per level = this x concurrency (at least 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--codes-per-token", type=int, default=4,
                    help="talker codes per reply token (50 codes = 1 s of speech; spoken "
                         "English is ~12 per token: fewer makes first audio / total larger)")
    ap.add_argument("--lengths", nargs="*", type=int, default=[32, 64, 128],
                    help="reply lengths for first audio vs reply length (concurrency 1)")
    ap.add_argument("--sweep-codes-per-token", type=int, default=15)
    ap.add_argument("--sweep-requests", type=int, default=2, help="requests per length")
    ap.add_argument("--out", type=Path, default=results_file("pipelining"))
    args = ap.parse_args(argv)

    data = spec.load_preset("omni-chat").model_dump(mode="json", exclude_none=True)
    seq = json.loads(json.dumps(data["stages"]["omni"]))
    seq["engine_args"]["parallel_chunks"] = 1  # stage by stage: one decoder chunk at a time
    data["stages"][MODES["sequential"]] = seq
    audio = wav()
    codes = args.codes_per_token * args.max_tokens
    results: dict = {"command": " ".join(["python", *sys.argv]), "max_tokens": args.max_tokens,
                     "talker_codes": codes, "codes_per_token": args.codes_per_token,
                     "sweep_codes_per_token": args.sweep_codes_per_token,
                     "levels": {}, "lengths": {}}
    runs: dict = {c: {m: [] for m in MODES} for c in args.concurrency}
    with tempfile.TemporaryDirectory(prefix="bench-omni-") as d:
        repo = Path(d) / "repo"
        gen_repo.generate(spec.parse_spec(data, base_dir=Path(d)), repo, force=True)
        stage_by_stage.install(repo / MODES["sequential"])
        server = TritonServer(repo, log_path=Path(d) / "tritonserver.log").start()
        try:
            for model in MODES.values():  # warm-up
                level(server.grpc_url, model, 2, 2, 16, audio)
            for rnd in range(args.rounds):
                for c in args.concurrency:
                    order = list(MODES) if rnd % 2 == 0 else list(reversed(MODES))
                    for mode in order:
                        n = max(4, args.requests_per_slot * c)
                        r = level(server.grpc_url, MODES[mode], c, n, args.max_tokens, audio,
                                  codes)
                        runs[c][mode].append(r)
                        print(f"round={rnd} c={c} {mode:10s} {r['requests_s']:.3f} req/s  "
                              f"first audio p50 {r['ttfa_p50']:.3f}s  total p50 {r['total_p50']:.3f}s "
                              f"(ratio {r['ttfa_over_total_p50']:.3f})", flush=True)
            for tokens in args.lengths:
                spoken = args.sweep_codes_per_token * tokens
                r = level(server.grpc_url, MODES["pipelined"], 1, args.sweep_requests, tokens,
                          audio, spoken)
                results["lengths"][tokens] = r
                print(f"reply {tokens} tokens ({spoken} codes): first "
                      f"audio p50 {r['ttfa_p50']:.3f}s  total p50 {r['total_p50']:.3f}s "
                      f"(ratio {r['ttfa_over_total_p50']:.3f})", flush=True)
        finally:
            server.stop()
    for c, r in runs.items():
        summary = {}
        for mode, rows in r.items():
            summary[mode] = {k: float(np.mean([row[k] for row in rows])) for k in rows[0]}
        p, s = summary["pipelined"], summary["sequential"]
        summary["throughput_ratio"] = p["requests_s"] / s["requests_s"]
        summary["throughput_ratio_per_round"] = [a["requests_s"] / b["requests_s"]
                                                 for a, b in zip(r["pipelined"], r["sequential"])]
        results["levels"][c] = summary
        print(f"c={c}: pipelined {p['requests_s']:.3f} vs sequential {s['requests_s']:.3f} req/s -> "
              f"{summary['throughput_ratio']:.2f}x; first audio / total (pipelined) "
              f"{p['ttfa_over_total_p50']:.3f}, (sequential) {s['ttfa_over_total_p50']:.3f}")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scenario `transformers`: omni-chat served by Triton vs a plain transformers script.

Processes. The omni-bench process plays both sides, one after the other: it starts
tritonserver (a child) serving the omni-chat preset (audio/image encoders, the vLLM
thinker `llm`, the vLLM talker, the Token2Wav `audio_decoder`, the orchestrator `omni`;
its text_to_image stage, not on this path, left out),
and it loads, in itself, what a user without a server runs: the same checkpoint folder
with `Qwen2_5OmniForConditionalGeneration.from_pretrained` and `Qwen2_5OmniProcessor`.
Both stay loaded the whole run (the idle engines sleep); each side has the machine to
itself while it is measured.

What flows. The same seeded text prompts go to both, text in, text + speech out, greedy,
with the checkpoint's first voice and the orchestrator's system prompt. Served: one
OmniClient stream per request (`modalities` text+audio, sampling_parameters
{max_tokens: N, ignore_eos: true, temperature: 0}, talker_sampling {max_tokens: M,
min_tokens: M, temperature: 0}), `concurrency` client threads, each sending its next
request when its last one ends; a request's time to first audio is its first
AudioChunk. transformers: `generate(..., return_audio=True, speaker=...)` with
thinker_max_new_tokens = thinker_min_new_tokens = N and talker_max_new_tokens =
talker_min_new_tokens = M (min_new_tokens holds every stop id back: same lengths on both
sides), greedy thinker and talker; one request at a time, so at concurrency c the c
clients' requests queue and a request's latency (and its time to first audio: audio
only comes at the end of generate) includes its wait. Where transformers allows batched
generate with audio out, it is also measured statically batched (c requests per
generate). Warm-up first on both; each round runs every level on both sides, order
alternating; medians of the rounds.

Models: `tiny` (the preset's embedded qwen2.5-omni-tiny: per-step overhead dominates)
and `0.5b` (qwen2.5-omni-0.5b-random: the thinker's text model has Qwen2.5-0.5B's
shapes, random weights; compute matters there, as on real hardware).
"""
from __future__ import annotations

import argparse
import inspect
import json
import random
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omni_tools.bench import plots
from omni_tools.bench.scenario import Ratio, Results, Scenario
from omni_tools.bench.stats import median, summary

MODELS = {"tiny": "qwen2.5-omni-tiny", "0.5b": "qwen2.5-omni-0.5b-random"}
PRESET_MODEL = "tiny:qwen2.5-omni-tiny"  # what the omni-chat preset's stages serve
SIDES = ("omni", "transformers", "transformers_batched")
LABELS = {"omni": "omni-chat (Triton)", "transformers": "transformers, one at a time",
          "transformers_batched": "transformers, statically batched"}
ENTRY = "omni"
IMAGE_STAGE = "text_to_image"
RATIO_LEVEL = 16
WORDS = ("river", "lantern", "violin", "harbor", "meadow", "comet", "glacier", "orchard",
         "signal", "market", "falcon", "bridge", "desert", "thunder", "garden", "engine",
         "castle", "forest", "island", "mirror", "rocket", "winter", "spring", "clock")


# --- requests (pure) -----------------------------------------------------------------

def prompts(n: int, seed: int = 0) -> list[str]:
    """`n` fixed text prompts drawn from `seed` (the same on every run and on both sides)."""
    rng = random.Random(seed)
    return [f"Request {i}: tell me a short story about a {rng.choice(WORDS)}, a "
            f"{rng.choice(WORDS)} and a {rng.choice(WORDS)}." for i in range(n)]


def omni_options(max_tokens: int, talker_tokens: int, voice: str, seed: int) -> dict[str, Any]:
    """OmniClient.stream options of one served request: N thinker tokens (ignore_eos),
    M talker codes (min_tokens = max_tokens), both greedy."""
    return {"modalities": ["text", "audio"],
            "sampling_parameters": {"max_tokens": max_tokens, "ignore_eos": True,
                                    "temperature": 0},
            "talker_sampling": {"max_tokens": talker_tokens, "min_tokens": talker_tokens,
                                "temperature": 0},
            "voice": voice, "seed": seed}


def transformers_kwargs(max_tokens: int, talker_tokens: int, voice: str,
                        talker_stop_ids: Sequence[int]) -> dict[str, Any]:
    """`Qwen2_5OmniForConditionalGeneration.generate` arguments of the same request."""
    return {"return_audio": True, "speaker": voice,  # transformers' name
            "thinker_max_new_tokens": max_tokens, "thinker_min_new_tokens": max_tokens,
            "thinker_do_sample": False,
            "talker_max_new_tokens": talker_tokens, "talker_min_new_tokens": talker_tokens,
            "talker_do_sample": False, "talker_eos_token_id": list(talker_stop_ids)}


def queued(service_s: Sequence[float], concurrency: int) -> tuple[list[float], float]:
    """One-at-a-time processing of requests from `concurrency` closed-loop clients.

    `service_s[i]`: how long request i took alone, in arrival order. Client k sends
    requests k, k + c, ...; each when its previous one ended. Returns each request's
    latency (its wait in the queue + its own time) and the wall time of them all.
    """
    ends: list[float] = []
    clock = 0.0
    latencies = []
    for i, s in enumerate(service_s):
        sent = ends[i - concurrency] if i >= concurrency else 0.0
        clock = max(clock, sent) + s
        ends.append(clock)
        latencies.append(clock - sent)
    return latencies, clock


def batched(batch_s: Sequence[float], sizes: Sequence[int]) -> tuple[list[float], float]:
    """Static batches (batch j: `sizes[j]` requests, `batch_s[j]` seconds) from as many
    closed-loop clients: every request of a batch waits for the whole batch; the next
    batch starts when it ends. Returns the latencies and the wall time."""
    return [s for s, n in zip(batch_s, sizes) for _ in range(n)], float(sum(batch_s))


def level_summary(rows: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """requests/s, tokens/s, latency and first-audio percentiles of one level's requests."""
    n = len(rows)
    out: dict[str, Any] = {"requests": n, "requests_s": n / wall_s,
                           "tok_s": sum(r["tokens"] for r in rows) / wall_s,
                           "audio_s_per_s": sum(r["audio_s"] for r in rows) / wall_s,
                           "tokens_per_request": sum(r["tokens"] for r in rows) / n,
                           "audio_s_per_request": sum(r["audio_s"] for r in rows) / n}
    out.update(summary([r["latency_s"] for r in rows], "latency_s"))
    out.update(summary([r["ttfa_s"] for r in rows], "ttfa_s"))
    if all(r.get("ttft_s") is not None for r in rows):
        out.update(summary([r["ttft_s"] for r in rows], "ttft_s"))
    return out


def batched_generate_allowed() -> tuple[bool, str]:
    """Whether the installed transformers lets generate(return_audio=True) take a batch."""
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m

    src = inspect.getsource(m.Qwen2_5OmniForConditionalGeneration.generate)
    if "batch_size" in src and "wavs.append" in src:
        return True, ("transformers' Qwen2_5OmniForConditionalGeneration.generate takes a batch "
                      "with return_audio=True (one waveform per row, Token2Wav decodes the rows "
                      "one by one), so it is also measured statically batched (c requests per "
                      "generate, left-padded).")
    for marker in ("batch_size > 1", "batch_size != 1", "only supports batch"):
        if marker in src:
            return False, ("transformers' Qwen2_5OmniForConditionalGeneration.generate refuses a "
                           f"batch with return_audio=True (`{marker}`): one request at a time only.")
    return False, "could not tell whether generate(return_audio=True) takes a batch: not measured."


# --- the transformers side -----------------------------------------------------------

class TransformersSide:
    """The checkpoint folder loaded as a user's script does, in this process."""

    def __init__(self, folder: str | Path, system_prompt: str):
        import torch
        from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

        t0 = time.perf_counter()
        self.torch = torch
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32).eval()
        self.processor = Qwen2_5OmniProcessor.from_pretrained(folder)
        self.processor.tokenizer.padding_side = "left"  # batched decoder-only generate
        self.load_s = time.perf_counter() - t0
        self.system_prompt = system_prompt
        talker = self.model.config.talker_config
        self.stop_ids = [talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id]
        self.voices = list(self.model.speaker_map)
        self.sample_rate = 24000  # Token2Wav's BigVGAN output

    def render(self, text: str) -> str:
        chat = [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": text}]
        return self.processor.apply_chat_template(chat, tokenize=False,
                                                  add_generation_prompt=True)

    def generate(self, texts: Sequence[str], seed: int, kwargs: dict[str, Any]
                 ) -> tuple[float, list[dict[str, Any]]]:
        """One generate over `texts` (a batch when more than one): its seconds, and per
        row the reply tokens and audio seconds."""
        inputs = self.processor(text=[self.render(t) for t in texts], return_tensors="pt",
                                padding=True)
        self.torch.manual_seed(seed)  # Token2Wav starts from noise
        t0 = time.perf_counter()
        sequences, wavs = self.model.generate(**inputs, **kwargs)
        seconds = time.perf_counter() - t0
        wavs = wavs if isinstance(wavs, list) else [wavs]
        tokens = sequences.shape[1] - inputs["input_ids"].shape[1]
        return seconds, [{"tokens": int(tokens), "audio_s": w.numel() / self.sample_rate}
                         for w in wavs]


def measure_transformers(side: TransformersSide, texts: Sequence[str], concurrency: int,
                         kwargs: dict[str, Any], *, batch: bool) -> dict[str, Any]:
    """Every request through `side`, one generate after another (`batch`: `concurrency`
    requests per generate); the queueing of `concurrency` clients is computed from the
    measured generate times (`queued`, `batched`): the model runs one call at a time."""
    rows: list[dict[str, Any]] = []
    service: list[float] = []
    sizes: list[int] = []
    size = concurrency if batch else 1
    for start in range(0, len(texts), size):
        chunk = texts[start:start + size]
        seconds, out = side.generate(chunk, start, kwargs)
        service.append(seconds)
        sizes.append(len(chunk))
        rows += out
    latencies, wall = (batched(service, sizes) if batch else queued(service, concurrency))
    for r, lat in zip(rows, latencies):
        r["latency_s"] = r["ttfa_s"] = lat  # text and audio come when generate returns
    result = level_summary(rows, wall)
    result["service_s_p50"] = median(service)
    return result


# --- the served side -----------------------------------------------------------------

def _served_request(client: Any, text: str, options: dict[str, Any]) -> dict[str, Any]:
    from omni_client.types import AudioChunk, Final, TextDelta

    t0 = time.perf_counter()
    ttft = ttfa = None
    audio_s = 0.0
    tokens = 0
    stages: dict[str, float] = {}
    for event in client.stream(text, model=ENTRY, timeout=600, **options):
        now = time.perf_counter() - t0
        if isinstance(event, TextDelta) and ttft is None:
            ttft = now
        elif isinstance(event, AudioChunk):
            ttfa = now if ttfa is None else ttfa
            audio_s += event.duration_s
        elif isinstance(event, Final):
            tokens = event.usage.completion_tokens if event.usage else 0
            stages = dict(event.metrics.get("stage_seconds") or {})
    latency = time.perf_counter() - t0
    if ttfa is None:
        raise RuntimeError(f"no audio in the reply to {text!r}")
    return {"latency_s": latency, "ttft_s": ttft, "ttfa_s": ttfa, "audio_s": audio_s,
            "tokens": tokens, "stage_seconds": stages}


def measure_served(client: Any, texts: Sequence[str], concurrency: int, args, voice: str
                   ) -> dict[str, Any]:
    def one(i: int) -> dict[str, Any]:
        return _served_request(client, texts[i], omni_options(
            args.max_tokens, args.talker_tokens, voice, seed=i))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, range(len(texts))))
    out = level_summary(rows, time.perf_counter() - t0)
    for role in ("thinker", "talker", "audio_decoder"):  # the orchestrator's own timings
        seconds = [r["stage_seconds"][role] for r in rows if role in r["stage_seconds"]]
        if seconds:
            out[f"{role}_s_p50"] = median(seconds)
    return out


# --- the run -------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=["tiny"],
                    help="tiny: the preset's qwen2.5-omni-tiny; 0.5b: its thinker with "
                         "Qwen2.5-0.5B's shapes")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, RATIO_LEVEL])
    ap.add_argument("--requests-per-slot", type=int, default=2,
                    help="requests per level = this x concurrency (at least --min-requests)")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="thinker reply tokens (N)")
    ap.add_argument("--talker-tokens", type=int, default=64, help="talker codec codes (M)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-batched", action="store_true",
                    help="skip transformers' statically batched generate")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts")


def _spec(model: str, work: Path) -> Any:
    """The omni-chat preset, its stages on `model`'s checkpoint, without text_to_image."""
    from omni_tools import spec

    data = spec.load_preset("omni-chat").model_dump(mode="json", exclude_none=True)
    # Its text-to-image stage (a Qwen-Image DiT) is not on this path: left out, the
    # server starts sooner on a small machine.
    data["stages"].pop(IMAGE_STAGE, None)
    data["stages"][ENTRY]["engine_args"]["stages"].pop("image_generator", None)
    name = f"tiny:{MODELS[model]}"
    for stage in data["stages"].values():
        if stage.get("model") == PRESET_MODEL:
            stage["model"] = name
    return spec.parse_spec(data, base_dir=work)


def _run_model(model: str, args: argparse.Namespace, work: Path, batch_ok: bool
               ) -> dict[str, Any]:
    from omni_client import OmniClient
    from omni_serve.families.qwen2_5_omni import SYSTEM_PROMPT
    from omni_tools import gen_repo
    from omni_tools.server import TritonServer

    repo = work / "repo"
    gen_repo.generate(_spec(model, work), repo, force=True)
    folder = json.loads((repo / "llm" / "engine.json").read_text())["model"]
    counts = {c: max(args.min_requests, args.requests_per_slot * c) for c in args.concurrency}
    texts = prompts(max(counts.values()), args.seed)
    sides = [s for s in SIDES if s != "transformers_batched" or batch_ok]
    runs: dict[int, dict[str, list]] = {c: {s: [] for s in sides} for c in args.concurrency}
    t0 = time.perf_counter()
    with TritonServer(repo, log_path=work / "tritonserver.log") as server, \
            OmniClient(server.grpc_url, timeout=600, model=ENTRY) as client:
        ready_s = time.perf_counter() - t0
        tf = TransformersSide(folder, SYSTEM_PROMPT)
        voice = "Chelsie" if "Chelsie" in tf.voices else tf.voices[0]
        kwargs = transformers_kwargs(args.max_tokens, args.talker_tokens, voice, tf.stop_ids)
        t1 = time.perf_counter()  # warm-up: the same shapes, both sides, batched too
        measure_served(client, texts[:2], 2, args, voice)
        tf.generate(texts[:1], 0, kwargs)
        if batch_ok:
            tf.generate(texts[:2], 0, kwargs)
        warmup_s = time.perf_counter() - t1
        for rnd in range(args.rounds):
            for c in args.concurrency:
                order = sides if rnd % 2 == 0 else sides[::-1]
                for side in order:
                    if side == "transformers_batched" and c == 1:
                        continue  # a batch of one is the one-at-a-time run
                    batch_texts = texts[:counts[c]]
                    if side == "omni":
                        m = measure_served(client, batch_texts, c, args, voice)
                    else:
                        m = measure_transformers(tf, batch_texts, c, kwargs,
                                                 batch=side == "transformers_batched")
                    runs[c][side].append(m)
                    print(f"transformers {model} round={rnd} c={c} {side:20s} "
                          f"{m['requests_s']:6.2f} req/s  latency p50 {m['latency_s_p50']:.2f} s  "
                          f"first audio p50 {m['ttfa_s_p50']:.2f} s  "
                          f"{m['tokens_per_request']:.0f} tok, {m['audio_s_per_request']:.2f} "
                          "s audio/request", flush=True)
        load_s = tf.load_s
        del tf
    levels: dict[str, Any] = {}
    for c, by_side in runs.items():
        lv: dict[str, Any] = {"requests": counts[c]}
        for side, ms in by_side.items():
            if ms:
                lv[side] = {k: median([m[k] for m in ms]) for k in ms[0]}
        per_round = [o["requests_s"] / t["requests_s"]
                     for o, t in zip(by_side["omni"], by_side["transformers"])]
        lv["ratio"] = median(per_round)
        lv["ratio_per_round"] = per_round
        if by_side.get("transformers_batched"):
            per_b = [o["requests_s"] / t["requests_s"]
                     for o, t in zip(by_side["omni"], by_side["transformers_batched"])]
            lv["ratio_batched"] = median(per_b)
            lv["ratio_batched_per_round"] = per_b
        levels[str(c)] = lv
    return {"model": MODELS[model], "checkpoint": folder, "voice": voice,
            "server_ready_s": ready_s, "transformers_load_s": load_s, "warmup_s": warmup_s,
            "transformers_generate_kwargs": kwargs,
            "served_options": omni_options(args.max_tokens, args.talker_tokens, voice, 0),
            "levels": levels}


def run(args: argparse.Namespace) -> Results:
    batch_ok, batch_note = batched_generate_allowed()
    batch_ok = batch_ok and not args.no_batched
    results: Results = {"max_tokens": args.max_tokens, "talker_tokens": args.talker_tokens,
                        "rounds": args.rounds, "concurrency": args.concurrency,
                        "batched_generate": batch_ok, "models": {}}
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix=f"bench-transformers-{model}-") as d:
            t0 = time.perf_counter()
            r = _run_model(model, args, Path(d), batch_ok)
            r["wall_s"] = time.perf_counter() - t0
            r["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            r["command"] = (f"omni-bench transformers --models {model} --rounds {args.rounds} "
                            f"--requests-per-slot {args.requests_per_slot}")
            results["models"][model] = r
    results["models"].update(kept_models(SCENARIO.load(), results))
    results["notes"] = _notes(results, batch_note)
    return results


def kept_models(previous: Results | None, results: Results) -> dict[str, Any]:
    """The models of the last results file that this run did not measure, kept when
    their requests had the same lengths (`omni-bench all` runs the tiny model only; the
    0.5b comparison, ~20 minutes, comes from its own run, each side by side in one run)."""
    if not previous or any(previous.get(k) != results[k] for k in ("max_tokens", "talker_tokens")):
        return {}
    return {m: r for m, r in previous.get("models", {}).items() if m not in results["models"]}


def _notes(results: Results, batch_note: str) -> str:
    n, m = results["max_tokens"], results["talker_tokens"]
    return (
        f"Same requests on both sides: {n} thinker tokens (served: ignore_eos; transformers: "
        f"thinker_min_new_tokens = thinker_max_new_tokens), {m} talker codes (min = max on "
        "both), greedy thinker and talker, the same voice and system prompt; tokens and "
        "audio seconds per request are in the JSON to show the lengths match. transformers "
        "runs one request at a time: at concurrency c the clients' requests queue, and the "
        "latency and first audio a request sees include its wait (transformers returns text "
        "and audio only when generate ends; the served side streams, first audio = its first "
        f"audio chunk). {batch_note} The `0.5b` model (qwen2.5-omni-0.5b-random: thinker text "
        "model with Qwen2.5-0.5B's shapes, untied head, random weights, tiny towers, talker "
        "and Token2Wav) is not in the quick set: it takes longer than the quick budget; "
        "its rows come from its own run (`omni-bench transformers --models 0.5b`), kept "
        "when a later run measures only the tiny model; each model's `command` and "
        "`measured` say which run it is.")


# --- report --------------------------------------------------------------------------

def ratios(results: Results) -> list[Ratio]:
    out = []
    for model, r in results["models"].items():
        level = r["levels"].get(str(RATIO_LEVEL))
        out.append(Ratio(f"omni-chat / transformers end-to-end requests/s at concurrency "
                         f"{RATIO_LEVEL} ({r['model']})",
                         None if level is None else level["ratio"], 10.0,
                         note="" if level is not None else f"concurrency {RATIO_LEVEL} not measured"))
    return out


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def table(results: Results) -> str:
    rows = ["| model | concurrency | side | requests/s | latency p50 / p95 / p99 s | "
            "first audio p50 / p99 s | tokens, audio s per request | omni-chat / this "
            "(per round) |", "|---|---:|---|---:|---|---|---|---|"]
    for model, r in results["models"].items():
        for c, lv in r["levels"].items():
            for side in SIDES:
                m = lv.get(side)
                if m is None:
                    continue
                if side == "omni":
                    vs = ""
                else:
                    key = "ratio" if side == "transformers" else "ratio_batched"
                    per = ", ".join(f"{x:.2f}" for x in lv[f"{key}_per_round"])
                    vs = f"**{lv[key]:.2f}** ({per})"
                rows.append(
                    f"| {r['model']} | {c} | {LABELS[side]} | {m['requests_s']:.2f} | "
                    f"{_fmt(m['latency_s_p50'])} / {_fmt(m['latency_s_p95'])} / "
                    f"{_fmt(m['latency_s_p99'])} | {_fmt(m['ttfa_s_p50'])} / "
                    f"{_fmt(m['ttfa_s_p99'])} | {m['tokens_per_request']:.0f}, "
                    f"{m['audio_s_per_request']:.2f} | {vs} |")
    runs = [f"{r['model']}: `{r['command']}` ({r['measured']})"
            for r in results["models"].values() if r.get("command")]
    if runs:
        rows.append("\nEach model's rows come from one run: " + "; ".join(runs) + ".")
    return "\n".join(rows)


def draw(results: Results, folder: Path) -> list[Path]:
    out = []
    for model, r in results["models"].items():
        levels = r["levels"]
        xs = [int(c) for c in levels]
        sides = [s for s in SIDES if any(s in lv for lv in levels.values())]
        out.append(plots.lines(
            folder / f"transformers_{model}_throughput.png",
            f"Speech replies: requests/s ({r['model']})", "concurrency", "requests/s", xs,
            {LABELS[s]: [lv.get(s, {}).get("requests_s") for lv in levels.values()]
             for s in sides}))
        top = levels.get(str(RATIO_LEVEL)) or levels[str(max(xs))]
        c = RATIO_LEVEL if str(RATIO_LEVEL) in levels else max(xs)
        series = {}
        for s in sides:
            if s in top:
                series[f"{LABELS[s]}: latency"] = [top[s][f"latency_s_p{q}"] for q in (50, 95, 99)]
                series[f"{LABELS[s]}: first audio"] = [top[s][f"ttfa_s_p{q}"] for q in (50, 95, 99)]
        out.append(plots.percentiles(
            folder / f"transformers_{model}_latency.png",
            f"Latency and first audio at concurrency {c} ({r['model']})", "s", series))
    return out


SCENARIO = Scenario(
    name="transformers",
    title="omni-chat (Triton) vs a plain transformers script: speech replies",
    add_arguments=add_arguments, run=run, ratios=ratios, table=table, plots=draw,
    quick=["--models", "tiny", "--rounds", "2", "--requests-per-slot", "1"])

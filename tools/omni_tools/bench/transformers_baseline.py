"""Scenario `transformers`: omni-chat served by Triton vs a plain transformers script.

Processes. The omni-bench process plays both sides, one after the other: it starts
tritonserver (a child) serving the omni-chat preset on the model's checkpoint folder
(Qwen2.5-Omni: audio/image encoders, the vLLM thinker `llm`, the vLLM talker, the
Token2Wav `audio_decoder`; Qwen3-Omni: the thinker with raw media, the talker with its
code predictor, the Code2Wav `audio_decoder`; the orchestrator `omni`; the preset's
text_to_image stage, not on this path, left out), and it loads, in itself, what a user
without a server runs: the same checkpoint folder with the family's
`...ForConditionalGeneration.from_pretrained` and processor. Both stay loaded the whole
run (the idle engines sleep); each side has the machine to itself while it is measured.

What flows. The same seeded text prompts go to both, text in, text + speech out, greedy,
with the checkpoint's voice (FAMILIES) and the family's system prompt (the
orchestrator's default). Served: one OmniClient stream per request (`modalities`
text+audio, sampling_parameters {max_tokens: N, ignore_eos: true, temperature: 0},
talker_sampling {max_tokens: M, min_tokens: M, temperature: 0}), `concurrency` client
threads, each sending its next request when its last one ends; a request's time to
first audio is its first AudioChunk. transformers: `generate(..., return_audio=True,
speaker=...)` with thinker_max_new_tokens = thinker_min_new_tokens = N and
talker_max_new_tokens = talker_min_new_tokens = M (min_new_tokens holds every stop id
back: same lengths on both sides), greedy thinker and talker; one request at a time, so
at concurrency c the c clients' requests queue and a request's latency (and its time to
first audio: audio only comes at the end of generate) includes its wait. Where
transformers allows batched generate with audio out, it is also measured statically
batched (c requests per generate). Then, per reply length (`--reply-tokens`), both
sides at concurrency 1 with N tokens spoken as N x codes-per-token talker codes: the
served first audio against its full response and against transformers' end-to-end
time. Warm-up first on both; each round runs every level and length on both sides,
order alternating; medians of the rounds. Real-time factor: audio seconds produced per
wall second, per level and length.

Models (MODELS; what differs between families is in FAMILIES): `tiny` (the preset's
embedded qwen2.5-omni-tiny: per-step overhead dominates), `0.5b`
(qwen2.5-omni-0.5b-random: the thinker's text model has Qwen2.5-0.5B's shapes, random
weights; compute matters there, as on real hardware), `qwen3-tiny` (qwen3-omni-tiny,
the tiny Qwen3-Omni of the full architecture, served through `omni-gen-repo --preset
omni-chat --model <its folder>`) and `qwen3-moe` (qwen3-omni-moe-small-random, served the
same way: its thinker's text model is the real MoE shape scaled down, 32 experts top-8,
hidden 1024, 10 layers; compute matters there too).
"""
from __future__ import annotations

import argparse
import inspect
import json
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_tools.bench import plots
from omni_tools.bench.scenario import Ratio, Results, Scenario
from omni_tools.bench.stats import median, summary

PRESET_MODEL = "tiny:qwen2.5-omni-tiny"  # what the omni-chat preset's stages serve
SIDES = ("omni", "transformers", "transformers_batched")
LABELS = {"omni": "omni-chat (Triton)", "transformers": "transformers, one at a time",
          "transformers_batched": "transformers, statically batched"}
ENTRY = "omni"
IMAGE_STAGE = "text_to_image"
RATIO_LEVEL = 16
FIRST_AUDIO_LENGTH = 128  # the reply length of the first-audio targets
FIRST_AUDIO_TARGET = 0.1  # served first audio / served full response, at most
VS_TRANSFORMERS_TARGET = 0.5  # served first audio / transformers end-to-end, at most
# the default reply (--max-tokens), served against transformers: end to end p50 at
# concurrency 1 at most, requests/s at RATIO_LEVEL at least (one at a time, batched)
END_TO_END_TARGET = 1.2
ONE_AT_A_TIME_TARGET = 1.5
BATCHED_TARGET = 1.0
WORDS = ("river", "lantern", "violin", "harbor", "meadow", "comet", "glacier", "orchard",
         "signal", "market", "falcon", "bridge", "desert", "thunder", "garden", "engine",
         "castle", "forest", "island", "mirror", "rocket", "winter", "spring", "clock")


# --- what differs between model families ---------------------------------------------

def _qwen25_speaker(model: Any) -> str:
    voices = list(model.speaker_map)
    return "Chelsie" if "Chelsie" in voices else voices[0]


def _qwen25_extras(model: Any, processor: Any) -> dict[str, Any]:
    # the talker stops on codec pad and end; min_new_tokens holds both back
    talker = model.config.talker_config
    return {"talker_eos_token_id": [talker.tts_codec_pad_token_id,
                                    talker.tts_codec_end_token_id]}


def _qwen3_speaker(model: Any) -> str:
    return next(iter(model.config.talker_config.speaker_id))  # config.json's first


def _qwen3_extras(model: Any, processor: Any) -> dict[str, Any]:
    # generate stops the thinker on the real <|im_end|> id (151645) unless told; the
    # talker's stop (codec_eos) generate sets itself, talker_min_new_tokens holds it back
    return {"thinker_eos_token_id": processor.tokenizer.convert_tokens_to_ids("<|im_end|>")}


@dataclass(frozen=True)
class Family:
    """One model family's row: its transformers classes, voice, lengths and defaults."""

    title: str
    module: str  # transformers.models.<module>, where model_class lives
    model_class: str
    processor_class: str  # from transformers
    talker_tokens: int  # default talker codes per request at the concurrency levels (M)
    code_s: float  # audio seconds per talker code
    code_name: str  # what one talker step makes ("codes"; Qwen3-Omni: frames of 16 codes)
    codes_per_token: int  # talker codes per reply token in the reply-length runs
    concurrency: tuple[int, ...]  # default levels
    reply_tokens: tuple[int, ...]  # default reply lengths (concurrency 1)
    speaker: Callable[[Any], str]  # the voice, from the loaded model
    extras: Callable[[Any, Any], dict[str, Any]]  # more generate() kwargs (model, processor)
    # how transformers' generate is told the lengths (the report's notes)
    lengths: str
    # source markers of generate: batch with return_audio taken / refused
    batch_markers: tuple[str, ...]
    refuse_markers: tuple[str, ...] = ("batch_size > 1", "batch_size != 1", "only supports batch")
    batch_note: str = ""
    # engine_args the served stages get on top of the preset's, by orchestrator role, and why
    served_engine_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    served_note: str = ""


QWEN25 = Family(
    title="Qwen2.5-Omni", module="qwen2_5_omni",
    model_class="Qwen2_5OmniForConditionalGeneration", processor_class="Qwen2_5OmniProcessor",
    talker_tokens=64, code_s=0.02, code_name="codes", codes_per_token=15, concurrency=(1, RATIO_LEVEL),
    reply_tokens=(),  # the pipelining scenario measures its reply lengths
    speaker=_qwen25_speaker, extras=_qwen25_extras,
    lengths=("thinker_min_new_tokens = thinker_max_new_tokens, talker_min_new_tokens = "
             "talker_max_new_tokens with talker_eos_token_id = [codec pad, codec end]"),
    batch_markers=("batch_size", "wavs.append"),
    batch_note="one waveform per row, Token2Wav decodes the rows one by one")
QWEN3 = Family(
    title="Qwen3-Omni", module="qwen3_omni_moe",
    model_class="Qwen3OmniMoeForConditionalGeneration", processor_class="AutoProcessor",
    # 16 frames of 80 ms: the Qwen2.5 rows' 1.28 s of speech per request
    talker_tokens=16, code_s=0.08, code_name="frames", codes_per_token=4, concurrency=(1, 8, RATIO_LEVEL),
    reply_tokens=(32, 64, FIRST_AUDIO_LENGTH),
    speaker=_qwen3_speaker, extras=_qwen3_extras,
    lengths=("generate passes thinker_* and talker_* kwargs on to the thinker's and the "
             "talker's generate, so thinker_min_new_tokens = thinker_max_new_tokens (with "
             "thinker_eos_token_id = the tokenizer's <|im_end|>) and talker_min_new_tokens "
             "= talker_max_new_tokens (frames of 16 codes; codec_eos held back)"),
    batch_markers=("talker_codes.shape[0] == 1", "talker_code_lengths"),
    batch_note="one waveform per row, cut at its own length after one Code2Wav decode",
    served_note="The served Qwen3-Omni stages run as the preset writes them (compiled).")


@dataclass(frozen=True)
class BenchModel:
    name: str  # the tiny model's registry name (omni_tools.tiny_models)
    family: Family
    preset: bool  # True: the preset's embedded model, swapped by name; False: --model folder


MODELS: dict[str, BenchModel] = {
    "tiny": BenchModel("qwen2.5-omni-tiny", QWEN25, preset=True),
    "0.5b": BenchModel("qwen2.5-omni-0.5b-random", QWEN25, preset=True),
    "qwen3-tiny": BenchModel("qwen3-omni-tiny", QWEN3, preset=False),
    "qwen3-moe": BenchModel("qwen3-omni-moe-small-random", QWEN3, preset=False),
}
# Models whose run takes longer than the quick set's budget: measured in their own runs,
# their rows kept when a later run measures others (kept_models).
OWN_RUN = {"0.5b": "qwen2.5-omni-0.5b-random: thinker text model with Qwen2.5-0.5B's shapes, "
                   "untied head, random weights, tiny towers, talker and Token2Wav",
           "qwen3-moe": "qwen3-omni-moe-small-random: thinker text model with the real MoE "
                        "scaled down (hidden 1024, 10 layers, 16 heads of 128, 2 KV heads, 32 "
                        "experts of 384, top-8, ~430M parameters), random weights, the tiny "
                        "tokenizer (2048 ids; the real one has 152064), tiny towers, talker (its "
                        "routed experts drawn) and Code2Wav"}


def settings(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """What `model` is measured with: the arguments given, else its family's defaults."""
    family = MODELS[model].family
    return {"concurrency": list(args.concurrency or family.concurrency),
            "talker_tokens": args.talker_tokens or family.talker_tokens,
            "reply_tokens": list(family.reply_tokens if args.reply_tokens is None
                                 else args.reply_tokens),
            "codes_per_token": args.codes_per_token or family.codes_per_token}


def model_command(model: str, args: argparse.Namespace) -> str:
    """The command that measures `model` alone with this run's settings."""
    out = [f"omni-bench transformers --models {model} --rounds {args.rounds} "
           f"--requests-per-slot {args.requests_per_slot}"]
    if args.concurrency:
        out.append("--concurrency " + " ".join(map(str, args.concurrency)))
    if args.min_requests != 4:
        out.append(f"--min-requests {args.min_requests}")
    if args.max_tokens != 32:
        out.append(f"--max-tokens {args.max_tokens}")
    if args.talker_tokens:
        out.append(f"--talker-tokens {args.talker_tokens}")
    if args.reply_tokens is not None:
        out.append(" ".join(["--reply-tokens", *map(str, args.reply_tokens)]))
    if args.codes_per_token:
        out.append(f"--codes-per-token {args.codes_per_token}")
    if args.reply_requests != 2:
        out.append(f"--reply-requests {args.reply_requests}")
    if args.no_batched:
        out.append("--no-batched")
    if args.seed:
        out.append(f"--seed {args.seed}")
    return " ".join(out)


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
                        talker_stop_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """`generate` arguments of the same request (the family's extras go on top)."""
    out = {"return_audio": True, "speaker": voice,  # transformers' name
           "thinker_max_new_tokens": max_tokens, "thinker_min_new_tokens": max_tokens,
           "thinker_do_sample": False,
           "talker_max_new_tokens": talker_tokens, "talker_min_new_tokens": talker_tokens,
           "talker_do_sample": False}
    if talker_stop_ids is not None:
        out["talker_eos_token_id"] = list(talker_stop_ids)
    return out


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
    """requests/s, tokens/s, real-time factor (`audio_s_per_s`: audio seconds produced
    per wall second), latency and first-audio percentiles of one level's requests."""
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


def _medians(ms: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {k: median([m[k] for m in ms]) for k in ms[0]}


def level_result(by_side: dict[str, list[dict[str, Any]]], requests: int) -> dict[str, Any]:
    """One concurrency level from its rounds (a side -> one summary per round): per side
    the medians of the rounds; omni-chat / transformers requests/s (one at a time and
    batched) and the real-time factors' ratio, per round and their median."""
    lv: dict[str, Any] = {"requests": requests}
    for side, ms in by_side.items():
        if ms:
            lv[side] = _medians(ms)
    omni = by_side.get("omni") or []
    for key, side in (("ratio", "transformers"), ("ratio_batched", "transformers_batched")):
        if by_side.get(side):
            per = [o["requests_s"] / t["requests_s"] for o, t in zip(omni, by_side[side])]
            lv[key], lv[f"{key}_per_round"] = median(per), per
    if omni and by_side.get("transformers"):
        per = [o["audio_s_per_s"] / t["audio_s_per_s"]
               for o, t in zip(omni, by_side["transformers"])]
        lv["rtf_ratio"], lv["rtf_ratio_per_round"] = median(per), per
    return lv


def reply_length_result(omni: Sequence[dict[str, Any]], tf: Sequence[dict[str, Any]],
                        talker_tokens: int) -> dict[str, Any]:
    """One reply length at concurrency 1 from its rounds: per side the medians; per round
    the served first audio over its full response (`first_audio_over_total`, p50s) and
    over transformers' end-to-end time for the same requests
    (`first_audio_over_transformers`), and their medians."""
    out: dict[str, Any] = {"talker_tokens": talker_tokens}
    if omni:
        out["omni"] = _medians(omni)
        per = [o["ttfa_s_p50"] / o["latency_s_p50"] for o in omni]
        out["first_audio_over_total"] = median(per)
        out["first_audio_over_total_per_round"] = per
    if tf:
        out["transformers"] = _medians(tf)
    if omni and tf:
        per = [o["ttfa_s_p50"] / t["latency_s_p50"] for o, t in zip(omni, tf)]
        out["first_audio_over_transformers"] = median(per)
        out["first_audio_over_transformers_per_round"] = per
    return out


def batched_generate_allowed(family: Family = QWEN25) -> tuple[bool, str]:
    """Whether the installed transformers lets the family's generate(return_audio=True)
    take a batch (read from its source)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
    src = inspect.getsource(getattr(module, family.model_class).generate)
    name = f"transformers' {family.model_class}.generate"
    if all(marker in src for marker in family.batch_markers):
        return True, (f"{name} takes a batch with return_audio=True ({family.batch_note}), so "
                      "it is also measured statically batched (c requests per generate, "
                      "left-padded).")
    for marker in family.refuse_markers:
        if marker in src:
            return False, (f"{name} refuses a batch with return_audio=True (`{marker}`): one "
                           "request at a time only.")
    return False, (f"could not tell whether {name}(return_audio=True) takes a batch: not "
                   "measured.")


# --- the transformers side -----------------------------------------------------------

class TransformersSide:
    """The checkpoint folder loaded as a user's script does, in this process."""

    def __init__(self, folder: str | Path, family: Family, system_prompt: str):
        import importlib

        import torch
        import transformers

        t0 = time.perf_counter()
        self.torch = torch
        model_class = getattr(importlib.import_module(
            f"transformers.models.{family.module}"), family.model_class)
        self.model = model_class.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.processor = getattr(transformers, family.processor_class).from_pretrained(str(folder))
        self.processor.tokenizer.padding_side = "left"  # batched decoder-only generate
        self.load_s = time.perf_counter() - t0
        self.system_prompt = system_prompt
        self.voice = family.speaker(self.model)
        self.extras = family.extras(self.model, self.processor)
        self.sample_rate = 24000  # Token2Wav's BigVGAN / Code2Wav output

    def kwargs(self, max_tokens: int, talker_tokens: int) -> dict[str, Any]:
        return {**transformers_kwargs(max_tokens, talker_tokens, self.voice), **self.extras}

    def render(self, text: str) -> str:
        chat = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        chat.append({"role": "user", "content": text})
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
        with self.torch.no_grad():
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


def measure_served(client: Any, texts: Sequence[str], concurrency: int, max_tokens: int,
                   talker_tokens: int, voice: str) -> dict[str, Any]:
    def one(i: int) -> dict[str, Any]:
        return _served_request(client, texts[i], omni_options(
            max_tokens, talker_tokens, voice, seed=i))

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
                         "Qwen2.5-0.5B's shapes; qwen3-tiny: qwen3-omni-tiny; qwen3-moe: its "
                         "thinker a real MoE shape scaled down")
    ap.add_argument("--concurrency", nargs="+", type=int, default=None,
                    help="levels (default: per family, Qwen2.5-Omni 1 16, Qwen3-Omni 1 8 16)")
    ap.add_argument("--requests-per-slot", type=int, default=2,
                    help="requests per level = this x concurrency (at least --min-requests)")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="thinker reply tokens (N)")
    ap.add_argument("--talker-tokens", type=int, default=None,
                    help="talker codes (M) at the levels (default: per family, 1.28 s of "
                         "speech: Qwen2.5-Omni 64 codes, Qwen3-Omni 16 frames)")
    ap.add_argument("--reply-tokens", nargs="*", type=int, default=None,
                    help="reply lengths measured at concurrency 1, first audio against the "
                         "full response (default: per family, Qwen2.5-Omni none (see "
                         "`omni-bench pipelining`), Qwen3-Omni 32 64 128; none: skip)")
    ap.add_argument("--codes-per-token", type=int, default=None,
                    help="talker codes per reply token at those lengths (default: per family, "
                         "about 0.3 s of speech a token: Qwen2.5-Omni 15, Qwen3-Omni 4)")
    ap.add_argument("--reply-requests", type=int, default=2,
                    help="requests per reply length and side")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-batched", action="store_true",
                    help="skip transformers' statically batched generate")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts")
    ap.add_argument("--note", default="",
                    help="what else ran on the machine meanwhile (kept with the model's rows)")


def drop_image_stage(data: dict[str, Any]) -> dict[str, Any]:
    """The omni-chat preset's spec data without its text-to-image stage (a Qwen-Image DiT,
    not on this path: the server starts sooner on a small machine)."""
    data["stages"].pop(IMAGE_STAGE, None)
    data["stages"][ENTRY]["engine_args"]["stages"].pop("image_generator", None)
    return data


def served_spec(model: str, work: Path) -> Any:
    """The omni-chat preset on `model`'s checkpoint, without text_to_image: the preset's
    own tiny stages renamed (Qwen2.5-Omni), or pointed at the folder as `omni-gen-repo
    --preset omni-chat --model DIR` does (the stages the family does without left out);
    then the family's `served_engine_args`."""
    from omni_tools import checkpoint, spec
    from omni_tools.tiny_models import ensure_model

    data = drop_image_stage(spec.load_preset("omni-chat").model_dump(mode="json",
                                                                     exclude_none=True))
    bench_model = MODELS[model]
    source = "<spec>"
    if bench_model.preset:
        for stage in data["stages"].values():
            if stage.get("model") == PRESET_MODEL:
                stage["model"] = f"tiny:{bench_model.name}"
    else:
        folder = Path(ensure_model(bench_model.name)).absolute()
        data, problems = checkpoint.point_preset_at(data, folder)
        if problems:
            raise RuntimeError(f"omni-chat cannot serve {folder}: " + "; ".join(problems))
        source = f"preset omni-chat --model {folder}"
    roles = data["stages"][ENTRY]["engine_args"]["stages"]
    for role, extra in bench_model.family.served_engine_args.items():
        data["stages"][roles[role]].setdefault("engine_args", {}).update(extra)
    return spec.parse_spec(data, base_dir=work, source=source)


def _system_prompt(folder: str) -> str:
    """The orchestrator's default system prompt for this checkpoint: its family's."""
    from omni_serve import families

    return families.for_checkpoint(folder).system_prompt or ""


def _run_model(model: str, args: argparse.Namespace, work: Path, batch_ok: bool
               ) -> dict[str, Any]:
    from omni_client import OmniClient
    from omni_tools import gen_repo
    from omni_tools.server import TritonServer

    family = MODELS[model].family
    cfg = settings(model, args)
    n, m = args.max_tokens, cfg["talker_tokens"]
    repo = work / "repo"
    gen_repo.generate(served_spec(model, work), repo, force=True)
    folder = json.loads((repo / "llm" / "engine.json").read_text())["model"]
    counts = {c: max(args.min_requests, args.requests_per_slot * c) for c in cfg["concurrency"]}
    lengths = {r: r * cfg["codes_per_token"] for r in cfg["reply_tokens"]}
    texts = prompts(max([*counts.values(), args.reply_requests]), args.seed)
    sides = [s for s in SIDES if s != "transformers_batched" or batch_ok]
    runs: dict[int, dict[str, list]] = {c: {s: [] for s in sides} for c in cfg["concurrency"]}
    by_length: dict[int, dict[str, list]] = {r: {"omni": [], "transformers": []}
                                             for r in lengths}

    def log(what: str, rnd: int, side: str, r: dict[str, Any]) -> None:
        print(f"transformers {model} round={rnd} {what} {side:20s} "
              f"{r['requests_s']:6.2f} req/s  latency p50 {r['latency_s_p50']:.2f} s  "
              f"first audio p50 {r['ttfa_s_p50']:.2f} s  real-time factor "
              f"{r['audio_s_per_s']:.2f}  {r['tokens_per_request']:.0f} tok, "
              f"{r['audio_s_per_request']:.2f} s audio/request", flush=True)

    t0 = time.perf_counter()
    with TritonServer(repo, log_path=work / "tritonserver.log") as server, \
            OmniClient(server.grpc_url, timeout=600, model=ENTRY) as client:
        ready_s = time.perf_counter() - t0
        tf = TransformersSide(folder, family, _system_prompt(folder))
        voice = tf.voice
        kwargs = tf.kwargs(n, m)
        t1 = time.perf_counter()  # warm-up: the same shapes, both sides, batched too
        measure_served(client, texts[:2], 2, n, m, voice)
        tf.generate(texts[:1], 0, kwargs)
        if batch_ok:
            tf.generate(texts[:2], 0, kwargs)
        warmup_s = time.perf_counter() - t1
        for rnd in range(args.rounds):
            for c in cfg["concurrency"]:
                order = sides if rnd % 2 == 0 else sides[::-1]
                for side in order:
                    if side == "transformers_batched" and c == 1:
                        continue  # a batch of one is the one-at-a-time run
                    batch_texts = texts[:counts[c]]
                    if side == "omni":
                        r = measure_served(client, batch_texts, c, n, m, voice)
                    else:
                        r = measure_transformers(tf, batch_texts, c, kwargs,
                                                 batch=side == "transformers_batched")
                    runs[c][side].append(r)
                    log(f"c={c}", rnd, side, r)
            for reply, codes in lengths.items():
                order = ["omni", "transformers"][::1 if rnd % 2 == 0 else -1]
                for side in order:
                    reply_texts = texts[:args.reply_requests]
                    if side == "omni":
                        r = measure_served(client, reply_texts, 1, reply, codes, voice)
                    else:
                        r = measure_transformers(tf, reply_texts, 1, tf.kwargs(reply, codes),
                                                 batch=False)
                    by_length[reply][side].append(r)
                    log(f"reply={reply}", rnd, side, r)
        load_s = tf.load_s
        del tf
    return {"model": MODELS[model].name, "family": family.title, "checkpoint": folder,
            "voice": voice, "max_tokens": n, **cfg,
            "server_ready_s": ready_s, "transformers_load_s": load_s, "warmup_s": warmup_s,
            "transformers_generate_kwargs": kwargs,
            "served_options": omni_options(n, m, voice, 0),
            "served_engine_args": family.served_engine_args,
            "levels": {str(c): level_result(by_side, counts[c]) for c, by_side in runs.items()},
            "reply_lengths": {str(reply): reply_length_result(
                by_length[reply]["omni"], by_length[reply]["transformers"], lengths[reply])
                for reply in lengths}}


def run(args: argparse.Namespace) -> Results:
    families = {MODELS[m].family.title: MODELS[m].family for m in args.models}
    batch = {title: batched_generate_allowed(f) for title, f in families.items()}
    results: Results = {"max_tokens": args.max_tokens, "talker_tokens": args.talker_tokens,
                        "rounds": args.rounds, "concurrency": args.concurrency,
                        "reply_tokens": args.reply_tokens,
                        "batched_generate": {t: ok and not args.no_batched
                                             for t, (ok, _) in batch.items()},
                        "models": {}}
    for model in args.models:
        title = MODELS[model].family.title
        with tempfile.TemporaryDirectory(prefix=f"bench-transformers-{model}-") as d:
            t0 = time.perf_counter()
            try:
                r = _run_model(model, args, Path(d), results["batched_generate"][title])
            except BaseException:
                kept = keep_server_log(Path(d), model)
                if kept:
                    print(f"transformers {model}: tritonserver's log kept in {kept}", flush=True)
                raise
            r["wall_s"] = time.perf_counter() - t0
            r["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            r["command"] = model_command(model, args)
            if args.note:
                r["note"] = args.note
            results["models"][model] = r
    results["models"].update(kept_models(SCENARIO.load(), results))
    notes = {t: n for t, (_, n) in batch.items()}
    for r in results["models"].values():  # kept models' families too
        f = _family_of(r)
        if f.title not in notes:
            notes[f.title] = batched_generate_allowed(f)[1]
    results["notes"] = _notes(results, notes)
    return results


def keep_server_log(work: Path, model: str) -> Path | None:
    """Copy a failed run's tritonserver log out of its temporary folder (which goes with
    the run): <tmp>/bench-transformers-<model>-tritonserver.log; None when there is none."""
    import shutil

    log = work / "tritonserver.log"
    if not log.is_file():
        return None
    kept = Path(tempfile.gettempdir()) / f"bench-transformers-{model}-tritonserver.log"
    shutil.copyfile(log, kept)
    return kept


def _family_of(r: dict[str, Any]) -> Family:
    """A results model's family (files from before families were recorded: Qwen2.5-Omni)."""
    return QWEN3 if r.get("family") == QWEN3.title else QWEN25


def kept_models(previous: Results | None, results: Results) -> dict[str, Any]:
    """The models of the last results file that this run did not measure, kept when
    their requests had the same lengths (`omni-bench all` runs the tiny model only; the
    OWN_RUN models' comparisons, ~20 minutes each, come from their own runs, each side by
    side in one run):
    the same thinker tokens, and the same talker codes as this run gives that model's
    family (its `--talker-tokens`, else the family's default)."""
    if not previous or previous.get("max_tokens") != results["max_tokens"]:
        return {}
    out = {}
    for m, r in previous.get("models", {}).items():
        if m in results["models"]:
            continue
        # a model recorded without its own talker codes ran with the file's, and a file's
        # None is the family's default, as for this run
        before = (r.get("talker_tokens") or previous.get("talker_tokens")
                  or _family_of(r).talker_tokens)
        now = results.get("talker_tokens") or _family_of(r).talker_tokens
        if before == now:
            out[m] = r
    return out


def _notes(results: Results, batch_notes: dict[str, str]) -> str:
    n = results["max_tokens"]
    titles = {_family_of(r).title: _family_of(r) for r in results["models"].values()}
    talker = "; ".join(
        f"{f.title}: {results.get('talker_tokens') or f.talker_tokens} talker {f.code_name} "
        f"({(results.get('talker_tokens') or f.talker_tokens) * f.code_s:.2f} s of speech)"
        for f in titles.values())
    lengths = " ".join(f"{f.title}: {f.lengths}." for f in titles.values())
    batch = " ".join(batch_notes.get(t, "") for t in titles)
    batch += "".join(f" {f.served_note}" for f in titles.values() if f.served_note)
    out = (
        f"Same requests on both sides: {n} thinker tokens (served: ignore_eos), {talker} "
        "(served: talker min_tokens = max_tokens), greedy thinker and talker, the same voice "
        "and system prompt; tokens and audio seconds per request are in the JSON to show "
        f"the lengths match. How transformers is told the lengths: {lengths} transformers "
        "runs one request at a time: at concurrency c the clients' requests queue, and the "
        "latency and first audio a request sees include its wait (transformers returns text "
        "and audio only when generate ends; the served side streams, first audio = its first "
        f"audio chunk). {batch} Real-time factor: audio seconds produced per wall second "
        "(all clients together). "
        + " ".join(f"The `{m}` model ({what}) is not in the quick set: it takes longer than "
                   "the quick budget; its rows come from its own run (`omni-bench transformers "
                   f"--models {m}`), kept when a later run measures other models."
                   for m, what in OWN_RUN.items() if m in results["models"])
        + " Each model's `command` and `measured` say which run it is.")
    if any(r.get("reply_lengths") for r in results["models"].values()):
        out += (" Reply lengths: at concurrency 1, each reply of N tokens spoken as N x "
                "codes-per-token talker codes (the JSON's `talker_tokens` per length); first "
                "audio / full response is the served side's p50s, first audio / transformers "
                "is the served first audio p50 over transformers' end-to-end p50 for the same "
                "requests.")
    return out


# --- report --------------------------------------------------------------------------

def _reply_for_targets(r: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The reply length the first-audio targets are read at: 128 tokens, else the longest."""
    lengths = r.get("reply_lengths") or {}
    if not lengths:
        return None
    key = str(FIRST_AUDIO_LENGTH) if str(FIRST_AUDIO_LENGTH) in lengths else max(lengths, key=int)
    return key, lengths[key]


def ratios(results: Results) -> list[Ratio]:
    out = []
    for model, r in results["models"].items():
        level = r["levels"].get(str(RATIO_LEVEL))
        out.append(Ratio(f"omni-chat / transformers end-to-end requests/s at concurrency "
                         f"{RATIO_LEVEL} ({r['model']})",
                         None if level is None else level.get("ratio"), 10.0,
                         note="" if level is not None else f"concurrency {RATIO_LEVEL} not measured"))
        out += _default_reply_ratios(r, r.get("max_tokens") or results.get("max_tokens"))
        picked = _reply_for_targets(r)
        if picked is None:
            continue
        n, lv = picked
        codes = lv.get("talker_tokens")
        spoken = f", spoken as {codes} {_family_of(r).code_name}" if codes else ""
        out.append(Ratio(f"omni-chat first audio / full response, p50 at concurrency 1 "
                         f"({r['model']}, {n}-token reply{spoken})",
                         lv.get("first_audio_over_total"), FIRST_AUDIO_TARGET, "<="))
        out.append(Ratio(f"omni-chat first audio / transformers end-to-end, p50 at "
                         f"concurrency 1 ({r['model']}, {n}-token reply)",
                         lv.get("first_audio_over_transformers"), VS_TRANSFORMERS_TARGET, "<="))
    return out


def _default_reply_ratios(r: dict[str, Any], reply_tokens: int | None) -> list[Ratio]:
    """omni-chat against transformers on the default reply, at concurrency 1 and 16."""
    one, many = (r["levels"].get(str(c)) or {} for c in (1, RATIO_LEVEL))

    def over_transformers(what: str) -> float | None:  # a served p50 / their end to end p50
        served = (one.get("omni") or {}).get(what)
        theirs = (one.get("transformers") or {}).get("latency_s_p50")
        return served / theirs if served and theirs else None

    rows = [("omni-chat / transformers end to end p50", 1,
             over_transformers("latency_s_p50"), END_TO_END_TARGET, "<="),
            ("omni-chat first audio p50 / transformers end to end p50", 1,
             over_transformers("ttfa_s_p50"), VS_TRANSFORMERS_TARGET, "<="),
            ("omni-chat / transformers one at a time, requests/s", RATIO_LEVEL,
             many.get("ratio"), ONE_AT_A_TIME_TARGET, ">="),
            ("omni-chat / transformers statically batched, requests/s", RATIO_LEVEL,
             many.get("ratio_batched"), BATCHED_TARGET, ">=")]
    reply = f", {reply_tokens}-token reply" if reply_tokens else ""
    return [Ratio(f"{name}, concurrency {c} ({r['model']}{reply})", value, target, op,
                  note="" if value is not None else f"concurrency {c} not measured")
            for name, c, value, target, op in rows]


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _per_round(lv: dict[str, Any], key: str) -> str:
    if lv.get(key) is None:
        return ""
    per = ", ".join(f"{x:.2f}" for x in lv.get(f"{key}_per_round", []))
    return f"**{lv[key]:.2f}** ({per})"


def table(results: Results) -> str:
    rows = ["| model | concurrency | side | requests/s | real-time factor | "
            "latency p50 / p95 / p99 s | first audio p50 / p99 s | tokens, audio s per "
            "request | omni-chat / this (per round) |",
            "|---|---:|---|---:|---:|---|---|---|---|"]
    for model, r in results["models"].items():
        for c, lv in r["levels"].items():
            for side in SIDES:
                m = lv.get(side)
                if m is None:
                    continue
                vs = "" if side == "omni" else _per_round(
                    lv, "ratio" if side == "transformers" else "ratio_batched")
                rows.append(
                    f"| {r['model']} | {c} | {LABELS[side]} | {m['requests_s']:.2f} | "
                    f"{_fmt(m.get('audio_s_per_s'))} | "
                    f"{_fmt(m['latency_s_p50'])} / {_fmt(m['latency_s_p95'])} / "
                    f"{_fmt(m['latency_s_p99'])} | {_fmt(m['ttfa_s_p50'])} / "
                    f"{_fmt(m['ttfa_s_p99'])} | {m['tokens_per_request']:.0f}, "
                    f"{m['audio_s_per_request']:.2f} | {vs} |")
    lengths = reply_table(results)
    if lengths:
        rows += ["", "First audio against reply length (concurrency 1):", "", lengths]
    runs = [f"{r['model']}: `{r['command']}` ({r['measured']}"
            + (f"; {r['note']}" if r.get("note") else "") + ")"
            for r in results["models"].values() if r.get("command")]
    if runs:
        rows.append("\nEach model's rows come from one run: " + "; ".join(runs) + ".")
    return "\n".join(rows)


def reply_table(results: Results) -> str:
    """The reply-length rows of every model that has them ('' when none has)."""
    rows = []
    for r in results["models"].values():
        for n, lv in (r.get("reply_lengths") or {}).items():
            o, t = lv.get("omni") or {}, lv.get("transformers") or {}
            rows.append(
                f"| {r['model']} | {n} | {lv.get('talker_tokens', '–')} | "
                f"{_fmt(o.get('audio_s_per_request'))} | {_fmt(o.get('ttfa_s_p50'))} | "
                f"{_fmt(o.get('latency_s_p50'))} | {_per_round(lv, 'first_audio_over_total')} | "
                f"{_fmt(t.get('latency_s_p50'))} | "
                f"{_per_round(lv, 'first_audio_over_transformers')} | "
                f"{_fmt(o.get('audio_s_per_s'))} / {_fmt(t.get('audio_s_per_s'))} |")
    if not rows:
        return ""
    return "\n".join(["| model | reply tokens | talker codes | audio s | omni-chat first audio "
                      "p50 s | omni-chat full response p50 s | first audio / full response "
                      "(per round) | transformers end-to-end p50 s | first audio / "
                      "transformers (per round) | real-time factor omni-chat / transformers |",
                      "|---|---:|---:|---:|---:|---:|---|---:|---|---|", *rows])


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
        lengths = r.get("reply_lengths") or {}
        if lengths:
            get = [(lv.get("omni") or {}, lv.get("transformers") or {}) for lv in lengths.values()]
            out.append(plots.lines(
                folder / f"transformers_{model}_reply_length.png",
                f"First audio against reply length, concurrency 1 ({r['model']})",
                "reply tokens", "s", [int(n) for n in lengths],
                {"omni-chat: first audio p50": [o.get("ttfa_s_p50") for o, _ in get],
                 "omni-chat: full response p50": [o.get("latency_s_p50") for o, _ in get],
                 "transformers: end-to-end p50": [t.get("latency_s_p50") for _, t in get]}))
    return out


SCENARIO = Scenario(
    name="transformers",
    title="omni-chat (Triton) vs a plain transformers script: speech replies",
    add_arguments=add_arguments, run=run, ratios=ratios, table=table, plots=draw,
    quick=["--models", "tiny", "--rounds", "2", "--requests-per-slot", "1",
           "--concurrency", "1", str(RATIO_LEVEL)])

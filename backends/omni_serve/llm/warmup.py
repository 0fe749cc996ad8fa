"""The LLM stage's warm-up plan: the batches it runs at load, before the model reports ready.

Runs in the omni_llm stub (LLMStage.start, on the engine's event loop); `plan` also in
unit tests. A vLLM engine's
first steps at a new batch size or prompt length pay for first-touch
allocation, kernel selection and caches; the first user request should not.
The plan covers decode batches of every power of two up to `max_num_seqs`
(the talker runs up to parallel_segments x concurrent requests at once) and
prefills of growing length up to one scheduler step's token budget, greedy
and seeded sampling both, so the sampler's paths are warm too.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from omni_serve import env

ENV = env.LLM_WARMUP.name  # "0" skips the warm-up (a faster start while developing)
DECODE_TOKENS = 4
SHORT_PROMPT = 16


@dataclass(frozen=True)
class WarmupRequest:
    prompt_len: int
    max_tokens: int
    seeded: bool  # temperature 1 with a seed, else greedy


def enabled(environ: dict[str, str] | None = None) -> bool:
    raw = (os.environ if environ is None else environ).get(ENV, "1").strip().lower()
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(f"{ENV} must be 0 or 1, got {raw!r}")


def _powers_of_two(limit: int, start: int = 1) -> list[int]:
    out = []
    n = start
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return sorted(set(out))


def plan(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> list[list[WarmupRequest]]:
    """Batches to run one after another; the requests of a batch are sent together."""
    batches: list[list[WarmupRequest]] = []
    short = min(SHORT_PROMPT, max(1, max_model_len - DECODE_TOKENS))
    # decode at every batch size (power of two) up to max_num_seqs, short prompts
    for size in _powers_of_two(max(1, max_num_seqs)):
        batches.append([WarmupRequest(short, DECODE_TOKENS, seeded=bool(i % 2))
                        for i in range(size)])
    # prefills of growing length, up to what one step may schedule
    longest = max(1, min(max_model_len - DECODE_TOKENS, max_num_batched_tokens))
    for length in _powers_of_two(longest, start=64):
        if length <= short:
            continue
        batches.append([WarmupRequest(length, DECODE_TOKENS, seeded=False)])
    return batches


def prompt_ids(length: int, vocab_size: int, salt: int) -> list[int]:
    """Deterministic token ids below `vocab_size`, different per `salt` (no prefix-cache hits)."""
    return [(salt * 7919 + i * 104729 + 13) % vocab_size for i in range(length)]


async def run(engine: Any, max_model_len: int, vocab_size: int,
              render: Callable[[dict], Awaitable[Any]]) -> str:
    """Run the plan's batches through a vLLM AsyncLLM, then reset its prefix cache.

    `render` turns {"prompt_token_ids": [...]} into the engine's input. The first
    user request then meets a warm engine with an empty cache, as after a plain
    start. Returns what was done, for the log.
    """
    from vllm import SamplingParams

    async def one(ids: list[int], req: WarmupRequest, request_id: str) -> None:
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True,
                                temperature=1.0 if req.seeded else 0.0,
                                seed=len(ids) if req.seeded else None)
        async for _ in engine.generate(await render({"prompt_token_ids": ids}), params,
                                       request_id):
            pass

    sched = engine.vllm_config.scheduler_config
    batches = plan(sched.max_num_seqs, max_model_len, sched.max_num_batched_tokens)
    t0 = time.perf_counter()
    salt = 0
    for batch in batches:
        jobs = []
        for req in batch:
            salt += 1
            jobs.append(one(prompt_ids(req.prompt_len, vocab_size, salt), req, f"warmup-{salt}"))
        await asyncio.gather(*jobs)
    await engine.reset_prefix_cache()
    return (f"warmed up in {time.perf_counter() - t0:.2f} s: {len(batches)} batches, decode "
            f"batch sizes up to {max(len(batch) for batch in batches)}, prompts up to "
            f"{max(r.prompt_len for batch in batches for r in batch)} tokens")

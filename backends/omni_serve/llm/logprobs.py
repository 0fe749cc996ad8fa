"""Logprobs as the omni_llm stage returns them: vllm_backend's JSON layout.

Runs in the omni_llm stub: `collect` on the engine loop (one vLLM output's new
positions), `to_json` on the response sender. One list item per generated token,
in order: {token id (a JSON string key): {"logprob", "rank", "decoded_token"}}, the
sampled token plus the sampling parameter `logprobs` best alternatives. `null` when
the request did not ask vLLM for logprobs.
"""
from __future__ import annotations

import json
from typing import Any

Position = dict[int, tuple[float, int | None, str | None]]


def collect(logprobs: Any) -> list[Position] | None:
    """vLLM's sample logprobs of one output (a list of {id: Logprob}, or None) as plain data."""
    if logprobs is None:
        return None
    return [{int(tid): (float(lp.logprob), lp.rank, lp.decoded_token)
             for tid, lp in position.items()} for position in logprobs]


def to_json(positions: list[Position] | None) -> str:
    if positions is None:
        return "null"
    return json.dumps([{str(tid): {"logprob": lp, "rank": rank, "decoded_token": tok}
                        for tid, (lp, rank, tok) in position.items()}
                       for position in positions])

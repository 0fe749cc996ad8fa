"""Task "speech" (read text aloud, no thinker) and the usage counts of the final metrics."""
from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from omni_serve.contract import LLM, OMNI
from omni_serve.errors import RequestError
from omni_serve.orchestrator.pipeline import AudioChunk, Final, OmniPipeline, TextDelta
from omni_serve.orchestrator.request import parse_request
from tests.unit.test_orchestrator import CODEC, ScriptedStages, config, tensors


def fake_tokenize(text: str) -> list[int]:
    return [100 + i for i, _ in enumerate(text.split())]


def run_events(pipeline, cfg, **extra):
    events: list = []
    req = parse_request("r1", tensors(**extra), cfg)
    asyncio.run(pipeline.run(req, events.append))
    return events


def test_speech_voices_the_text_without_the_thinker():
    cfg = config(tokenizer="/some/tokenizer")
    stages = ScriptedStages()
    words = " ".join(f"w{i}" for i in range(15))  # 15 tokens: segments of 4, 6, 5
    events = run_events(OmniPipeline(cfg, stages, tokenize=fake_tokenize), cfg,
                        text=words, **{OMNI.TASK: "speech"})
    models = [m for m, _ in stages.calls]
    assert "llm" not in models
    talker_prompts = [inputs[LLM.PROMPT_TOKEN_IDS].tolist() for m, inputs in stages.calls
                      if m == "talker"]
    # every token of the text is voiced once, in order, segment by segment
    assert [p[:-1] for p in talker_prompts] == [list(range(100, 104)), list(range(104, 110)),
                                               list(range(110, 115))]
    assert all(p[-1] == CODEC["bos"] for p in talker_prompts)
    assert not any(isinstance(e, TextDelta) for e in events)
    assert any(isinstance(e, AudioChunk) for e in events)
    final = events[-1]
    assert isinstance(final, Final) and final.finish_reason == "stop"
    assert final.metrics["usage"] == {"prompt_tokens": 15, "completion_tokens": 0}
    assert final.metrics["audio_seconds"] > 0


@pytest.mark.parametrize("overrides, task, message", [
    ({"tokenizer": "/t"}, "sing", "unknown task 'sing'"),
    ({}, "speech", "no talker (or no thinker tokenizer)"),
    ({"tokenizer": "/t", "stages": {"thinker": "llm"}, "codec": None}, "speech", "no talker"),
])
def test_bad_task_names_the_field(overrides, task, message):
    cfg = config(**overrides)
    with pytest.raises(RequestError, match=re.escape(message)) as info:
        parse_request("r1", tensors(**{OMNI.TASK: task}), cfg)
    assert OMNI.TASK in str(info.value)


def test_chat_reports_the_thinkers_token_counts():
    cfg = config()

    class Counting(ScriptedStages):
        async def stream(self, model, inputs, outputs, *, request_id, timeout_s):
            n = 0
            async for out in super().stream(model, inputs, outputs, request_id=request_id,
                                            timeout_s=timeout_s):
                if model == "llm":
                    n += 1
                    out = {**out, LLM.NUM_INPUT_TOKENS: np.array([42], np.uint32),
                           LLM.NUM_OUTPUT_TOKENS: np.array([n], np.uint32)}
                yield out

    events = run_events(OmniPipeline(cfg, Counting(reply_tokens=7)), cfg)
    assert events[-1].metrics["usage"] == {"prompt_tokens": 42, "completion_tokens": 7}

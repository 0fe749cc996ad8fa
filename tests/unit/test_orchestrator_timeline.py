"""The per-request timeline in the final metrics (orchestrator/events.py Timings, stamped by
the pipeline's stage calls and the speech path), with scripted stages."""
from __future__ import annotations

import asyncio
import time

from omni_serve.contract import OMNI
from omni_serve.orchestrator.pipeline import AudioChunk, Final, OmniPipeline
from omni_serve.orchestrator.request import parse_request
from tests.unit.chat import tiny_chat_prompt
from tests.unit.test_orchestrator import ScriptedStages, config, tensors
from tests.unit.test_orchestrator_speech import CHUNKS, speak


def final_metrics(events: list) -> dict:
    (final,) = [e for e in events if isinstance(e, Final)]
    return final.metrics


def test_the_timeline_is_reported_only_when_asked_for():
    assert "timeline" not in final_metrics(speak()[0])
    events, _ = speak(**{OMNI.RETURN_TIMELINE: False})
    assert "timeline" not in final_metrics(events)


def test_a_speech_request_has_every_stage_call_in_the_order_sent():
    events, _ = speak(**{OMNI.RETURN_TIMELINE: True})
    timeline = final_metrics(events)["timeline"]
    stages = [c["stage"] for c in timeline["calls"]]
    assert stages == ["thinker", "talker"] + ["audio_decoder"] * len(CHUNKS)
    for call in timeline["calls"]:
        assert 0 <= call["sent_s"] <= call["first_s"] <= call["last_s"] <= timeline["end_s"]
    sent = [c["sent_s"] for c in timeline["calls"]]
    assert sent == sorted(sent)
    decoders = [c for c in timeline["calls"] if c["stage"] == "audio_decoder"]
    assert all(c["responses"] == 1 for c in decoders)
    thinker, talker = timeline["calls"][:2]
    assert thinker["responses"] > 1 and talker["responses"] >= 1
    # the talker starts on the thinker's reply and the decoder on the talker's codes
    assert thinker["first_s"] <= talker["sent_s"] and talker["first_s"] <= decoders[0]["sent_s"]


def test_the_orchestrators_steps_are_the_talker_start_and_each_chunk_sent_out():
    events, _ = speak(**{OMNI.RETURN_TIMELINE: True})
    timeline = final_metrics(events)["timeline"]
    steps = [s["step"] for s in timeline["steps"]]
    assert steps == ["talker_ready"] + ["audio_out"] * len(
        [e for e in events if isinstance(e, AudioChunk)])
    at = [s["at_s"] for s in timeline["steps"]]
    assert at == sorted(at) and at[-1] <= timeline["end_s"]
    talker = timeline["calls"][1]
    first_decoder = timeline["calls"][2]
    assert at[0] <= talker["sent_s"] and first_decoder["last_s"] <= at[1]


def test_the_timeline_starts_when_the_request_reached_the_orchestrator():
    cfg = config()
    pipeline = OmniPipeline(cfg, ScriptedStages(), tiny_chat_prompt())
    req = parse_request("r1", tensors(**{OMNI.RETURN_TIMELINE: True}), cfg)
    events: list = []
    received = time.perf_counter() - 0.05  # it waited 50 ms for the event loop
    asyncio.run(pipeline.run(req, events.append, received))
    metrics = final_metrics(events)
    first = metrics["timeline"]["steps"][0]
    assert first["step"] == "task_started" and first["at_s"] >= 0.05
    assert metrics["timeline"]["calls"][0]["sent_s"] >= first["at_s"]
    assert metrics["total_s"] >= 0.05

"""What one omni request sends back, and its timings (orchestrator's event loop).

The pipeline and the speech path emit these events; the adapter
(backends/omni_orchestrator/model.py) turns them into Triton responses and
the final response's `metrics` JSON comes from `Timings.report`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TextDelta:
    text: str


@dataclass
class AudioChunk:
    pcm: np.ndarray
    sample_rate: int


@dataclass
class ImageOut:
    png: bytes


@dataclass
class CodecIds:
    """The talker's next frames of codec ids, [frames][groups] (sent with `return_codec_ids`)."""

    frames: list[list[int]]


@dataclass
class Final:
    finish_reason: str
    metrics: dict[str, Any]


Event = TextDelta | AudioChunk | ImageOut | CodecIds | Final


@dataclass
class StageCall:
    """One call to a stage: when it was sent and its first and last responses came back."""

    role: str
    sent: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    responses: int = 0

    def response(self) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.responses += 1


@dataclass
class Timings:
    """Per-request timings: what the final response's `metrics` JSON reports."""

    start: float = field(default_factory=time.perf_counter)
    first_text: float | None = None
    first_audio: float | None = None
    audio_start: float | None = None
    audio_end: float | None = None
    audio_seconds: float = 0.0
    first_chunk_codes: int | None = None  # talker steps the first streamed decoder chunk voiced
    stage_seconds: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0  # the thinker's (or, reading aloud, the text's) tokens
    completion_tokens: int = 0  # the thinker's reply tokens
    thinker_model: str | None = None  # the thinker engine that served the request
    passed_over: list[str] = field(default_factory=list)  # thinker engines found down
    # the per-request timeline: every stage call and the orchestrator's own steps
    # (always stamped, reported with `return_timeline`)
    timeline: bool = False
    calls: list[StageCall] = field(default_factory=list)
    steps: list[tuple[str, float]] = field(default_factory=list)

    def call(self, role: str) -> StageCall:
        """A stage call sent now (its `response()` stamps each response)."""
        self.calls.append(call := StageCall(role))
        return call

    def step(self, name: str) -> None:
        """One of the orchestrator's own steps, done now."""
        self.steps.append((name, time.perf_counter()))

    def add(self, role: str, seconds: float) -> None:
        self.stage_seconds[role] = self.stage_seconds.get(role, 0.0) + seconds

    def report(self) -> dict[str, Any]:
        now = time.perf_counter()
        out: dict[str, Any] = {
            "total_s": round(now - self.start, 6),
            "time_to_first_token_s": None if self.first_text is None else
            round(self.first_text - self.start, 6),
            "time_to_first_audio_s": None if self.first_audio is None else
            round(self.first_audio - self.start, 6),
            "audio_seconds": round(self.audio_seconds, 6),
            "audio_rtf": None,
            "stage_seconds": {k: round(v, 6) for k, v in self.stage_seconds.items()},
            "usage": {"prompt_tokens": self.prompt_tokens,
                      "completion_tokens": self.completion_tokens},
        }
        if self.first_chunk_codes is not None:
            out["first_chunk_codes"] = self.first_chunk_codes
        if self.thinker_model is not None:
            out["thinker_model"] = self.thinker_model
        if self.passed_over:
            out["thinker_passed_over"] = list(self.passed_over)
        if self.audio_seconds > 0 and self.audio_start is not None and self.audio_end is not None:
            out["audio_rtf"] = round((self.audio_end - self.audio_start) / self.audio_seconds, 6)
        if self.timeline:
            out["timeline"] = self.timeline_report(now)
        return out

    def timeline_report(self, now: float) -> dict[str, Any]:
        """Seconds from the request's start: each stage call (sent, first and last response,
        in the order sent) and each step, then the end (this report)."""
        def rel(at: float | None) -> float | None:
            return None if at is None else round(at - self.start, 6)

        return {"calls": [{"stage": c.role, "sent_s": rel(c.sent), "first_s": rel(c.first),
                           "last_s": rel(c.last), "responses": c.responses} for c in self.calls],
                "steps": [{"step": name, "at_s": rel(at)} for name, at in self.steps],
                "end_s": rel(now)}

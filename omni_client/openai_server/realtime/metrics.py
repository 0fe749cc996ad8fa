"""The realtime families on omni-openai's /metrics (declared in omni_serve.metrics_table).

Runs in the omni-openai process: created once in the frontend's registry, fed
by the sessions (opened / closed), their responses (first audio, how each
ended) and their cancels.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omni_serve.metrics_table import OpenAIMetrics as M


class RealtimeMetrics:
    """Sessions open and time to first audio by model, turns by status, interruptions by
    reason."""

    def __init__(self, registry: CollectorRegistry):
        self.sessions = Gauge(M.REALTIME_SESSIONS.name, M.REALTIME_SESSIONS.help,
                              list(M.REALTIME_SESSIONS.labels), registry=registry)
        # prometheus_client adds the counters' _total itself
        self.turns = Counter(M.REALTIME_TURNS.name.removesuffix("_total"), M.REALTIME_TURNS.help,
                             list(M.REALTIME_TURNS.labels), registry=registry)
        self.interruptions = Counter(M.REALTIME_INTERRUPTIONS.name.removesuffix("_total"),
                                     M.REALTIME_INTERRUPTIONS.help,
                                     list(M.REALTIME_INTERRUPTIONS.labels), registry=registry)
        spec = M.REALTIME_FIRST_AUDIO_SECONDS
        self.first_audio_s = Histogram(spec.name, spec.help, list(spec.labels),
                                       registry=registry, buckets=spec.buckets)

    def of(self, model: str) -> SessionMetrics:
        """What one session of `model` reports."""
        return SessionMetrics(self, model)


@dataclass(frozen=True)
class SessionMetrics:
    """The metrics of one session (a response's Hooks)."""

    families: RealtimeMetrics
    model: str

    def opened(self) -> None:
        self.families.sessions.labels(self.model).inc()

    def closed(self) -> None:
        self.families.sessions.labels(self.model).dec()

    def first_audio(self, seconds: float) -> None:
        self.families.first_audio_s.labels(self.model).observe(seconds)

    def turn(self, status: str) -> None:
        self.families.turns.labels(status).inc()

    def interruption(self, reason: str) -> None:
        self.families.interruptions.labels(reason).inc()

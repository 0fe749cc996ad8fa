"""Per-stream accounting of a soak: what each request's gRPC stream delivered.

Runs in the soak tool's process, on its worker threads. Each request has a
stream of its own; the worker feeds every event of that stream into the
request's `StreamRecord`: a response (the id Triton echoed, whether it is
flagged `triton_final_response`, the output names) or an error. A stream
must end with exactly one terminal event (the final response, or an error),
nothing may follow it, and every response must carry the request's id.
`Ledger` sums the records into the soak's counts. Pure Python: the unit
tests drive it with synthetic event sequences.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Outcome = Literal["completed", "errored", "lost"]


@dataclass
class StreamRecord:
    """Everything one request's stream delivered, in arrival order."""

    request_id: str
    kind: str
    sent_at: float
    responses: int = 0  # responses with this request's id, the final one included
    finals: int = 0  # of them, flagged triton_final_response
    errors: int = 0
    after_terminal: int = 0  # responses or errors after the first final / error
    wrong_id: int = 0  # responses carrying another request's id (never counted as ours)
    error: str | None = None  # the first error's message
    outputs: Counter = field(default_factory=Counter)  # output name -> responses carrying it
    first_at: float | None = None
    ended_at: float | None = None  # the terminal event's arrival
    ended_by: Literal["final", "error"] | None = None  # the first terminal event
    timed_out: bool = False  # no terminal event before the request's deadline
    late: int = 0  # events that came after the deadline (the stream was cancelled)
    close_stuck: bool = False  # the server kept the stream open after its terminal event

    # --- events ----------------------------------------------------------------------

    def response(self, response_id: str, final: bool, outputs: Iterable[str] = (),
                 at: float = 0.0) -> None:
        """One response of the stream (`final`: its `triton_final_response` flag)."""
        if self.timed_out:
            self.late += 1
            return
        if response_id != self.request_id:
            self.wrong_id += 1
            return
        if self.terminal:
            self.after_terminal += 1
        self.responses += 1
        self.finals += bool(final)
        if self.first_at is None:
            self.first_at = at
        if self.ended_by is None:
            self.outputs.update(set(outputs))
            if final:
                self.ended_by, self.ended_at = "final", at

    def failure(self, message: str, at: float = 0.0) -> None:
        """An error on the stream (Triton 2.51 sends a request's error in-band, without id)."""
        if self.timed_out:
            self.late += 1
            return
        if self.terminal:
            self.after_terminal += 1
        self.errors += 1
        if self.error is None:
            self.error = message
        if self.ended_by is None:
            self.ended_by, self.ended_at = "error", at

    def deadline_passed(self) -> None:
        """The request's time is up: what arrives from now on is only counted as late."""
        if not self.terminal:
            self.timed_out = True

    # --- verdict ---------------------------------------------------------------------

    @property
    def terminal(self) -> bool:
        return self.ended_by is not None

    @property
    def outcome(self) -> Outcome:
        return {None: "lost", "final": "completed", "error": "errored"}[self.ended_by]

    @property
    def terminal_events(self) -> int:
        return self.finals + self.errors

    @property
    def latency_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.sent_at

    def problems(self) -> list[str]:
        """What is wrong with this stream, in words (empty when nothing is)."""
        out = []
        if not self.terminal:
            out.append("lost: no final response and no error" +
                       (" before the deadline" if self.timed_out else ""))
        elif self.terminal_events != 1:
            out.append(f"{self.finals} final responses and {self.errors} errors (want exactly one)")
        if self.after_terminal:
            out.append(f"{self.after_terminal} responses after the final one")
        if self.wrong_id:
            out.append(f"{self.wrong_id} responses with another request's id")
        if self.close_stuck:
            out.append("the server kept the stream open after the final response")
        return out


class Ledger:
    """The records of every request of a soak (thread-safe) and their sums."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records: list[StreamRecord] = []

    def add(self, record: StreamRecord) -> None:
        with self._lock:
            self.records.append(record)

    def summary(self, expect: Mapping[str, Iterable[str]] | None = None) -> dict:
        """Counts over every stream: sent, completed, errored, lost, duplicated, ...

        `expect` maps a kind to the outputs its completed replies carry; per kind,
        `missing_outputs` counts the completed replies without one of them.
        """
        expect = expect or {}
        with self._lock:
            records = list(self.records)
        outcomes = Counter(r.outcome for r in records)
        out = {
            "sent": len(records),
            "completed": outcomes["completed"],
            "errored": outcomes["errored"],
            "lost": outcomes["lost"],
            "duplicated": sum(r.after_terminal for r in records),
            "streams_not_one_final": sum(r.terminal_events != 1 for r in records),
            "wrong_id": sum(r.wrong_id for r in records),
            "late": sum(r.late for r in records),
            "close_stuck": sum(r.close_stuck for r in records),
            "responses": sum(r.responses for r in records),
            "errors_by_message": dict(Counter(r.error for r in records if r.error).most_common(10)),
            "by_kind": {},
        }
        for kind in sorted({r.kind for r in records}):
            rows = [r for r in records if r.kind == kind]
            lat = [r.latency_s for r in rows if r.outcome == "completed"]
            out["by_kind"][kind] = {
                "sent": len(rows),
                **{o: sum(r.outcome == o for r in rows) for o in ("completed", "errored", "lost")},
                "latency_p50_s": float(np.percentile(lat, 50)) if lat else None,
                "latency_p99_s": float(np.percentile(lat, 99)) if lat else None,
                "missing_outputs": sum(not set(expect.get(kind, ())) <= set(r.outputs)
                                       for r in rows if r.outcome == "completed"),
                "outputs": dict(sum((r.outputs for r in rows), Counter())),
            }
        return out

    def failures(self, *, max_errors: int = 0, limit: int = 20) -> list[str]:
        """Why the soak failed (empty when it passed): every stream with a problem, then
        errored streams beyond `max_errors`."""
        with self._lock:
            records = list(self.records)
        bad = [f"{r.request_id} ({r.kind}): {'; '.join(r.problems())}"
               for r in records if r.problems()]
        errored = [r for r in records if r.outcome == "errored"]
        out = bad[:limit] + ([f"... and {len(bad) - limit} more"] if len(bad) > limit else [])
        if len(errored) > max_errors:
            out.append(f"{len(errored)} requests errored (allowed {max_errors}); first: "
                       f"{errored[0].request_id}: {errored[0].error}")
        return out

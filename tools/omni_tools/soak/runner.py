"""The soak itself: worker threads keep a server busy while the ledger and sampler record.

Runs in the soak tool's process (or a test's). `run_soak` starts
`concurrency` worker threads; each owns a tritonclient gRPC client and sends
one request at a time, on a stream of its own, the kinds of the mix taken in
turn, until the duration or the request budget is spent. A request carries
the id `soak-<index>-<kind>` and asks for the empty final response, so its
end is the response flagged `triton_final_response` (or an error). After it,
the worker half-closes the stream; every response Triton still sends before
it closes the stream lands on the request's record (a duplicate), and a
stream the server keeps open is flagged. A request without a terminal event
by its deadline is lost; its stream is cancelled. Meanwhile `RssSampler`
reads the RSS of the server and each of its processes.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .ledger import Ledger, StreamRecord
from .memory import RssSampler, Series, growth, plot, windows
from .mix import KINDS, Kind, available

log = logging.getLogger(__name__)

# (lowest, highest) of each bounded setting: a soak never runs unbounded
LIMITS: dict[str, tuple[float, float]] = {
    "concurrency": (1, 64),
    "duration_s": (1, 3600),
    "max_requests": (1, 1_000_000),
    "warmup_s": (0, 3600),
    "window_s": (1, 3600),
    "rss_interval_s": (0.2, 60),
    "request_timeout_s": (1, 3600),
    "close_grace_s": (0.5, 600),
}


@dataclass(frozen=True)
class SoakConfig:
    """What a soak sends and for how long; every number is bounded (see LIMITS)."""

    concurrency: int = 16
    duration_s: float = 600.0
    max_requests: int = 100_000
    warmup_s: float = 60.0  # RSS growth is measured from here
    window_s: float = 60.0  # the RSS medians compared: first window after warm-up, last window
    rss_interval_s: float = 2.0
    request_timeout_s: float = 120.0  # no final response by then: the request is lost
    close_grace_s: float = 15.0  # how long the server may keep a stream open after its final
    kinds: tuple[str, ...] = tuple(KINDS)
    max_errors: int = 0
    max_rss_growth_pct: float | None = 10.0  # None: report only
    rss_min_mib: float = 64.0  # processes smaller than this at baseline are reported, not judged

    def __post_init__(self) -> None:
        for name, (lo, hi) in LIMITS.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"{name}: must be between {lo:g} and {hi:g}, got {value!r}")
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s: must be below duration_s ({self.duration_s:g}), "
                             f"got {self.warmup_s:g}")
        if not self.kinds:
            raise ValueError(f"kinds: give at least one of {', '.join(KINDS)}")
        available(self.kinds, set())  # unknown names raise


@dataclass
class SoakResult:
    """The report (JSON-able), the RSS series behind it and the verdict."""

    report: dict
    series: list[Series] = field(default_factory=list)
    shm: Series | None = None

    @property
    def ok(self) -> bool:
        return not self.report["failures"]

    def write(self, json_path: Path, png_path: Path | None) -> None:
        import json

        json_path.parent.mkdir(parents=True, exist_ok=True)
        if png_path is not None:
            g = self.report["rss"]["growth"]
            s = self.report["summary"]
            title = (f"omni soak: c={self.report['config']['concurrency']}, "
                     f"{self.report['elapsed_s']:.0f} s, {s['sent']} requests "
                     f"({s['completed']} completed, {s['errored']} errored, {s['lost']} lost, "
                     f"{s['duplicated']} duplicated); total RSS growth "
                     f"{_pct(g['total']['growth_pct'])} after warm-up")
            plot(self.series, png_path, warmup_s=self.report["config"]["warmup_s"],
                 windows_s=(tuple(g["baseline_window_s"]), tuple(g["final_window_s"])), title=title,
                 shm=self.shm)
            self.report["plot"] = str(png_path)
        json_path.write_text(json.dumps(self.report, indent=2))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1f}%"


# --- one request ------------------------------------------------------------------------

def _cancelled(error: InferenceServerException) -> bool:
    return "CANCELLED" in str(error.status() or "")


def _feed(rec: StreamRecord, at: float, result, error) -> None:
    if error is not None:
        if (rec.timed_out or rec.close_stuck) and _cancelled(error):
            return  # our own cancellation of the stream
        rec.failure(error.message() or str(error), at)
        return
    res = result.get_response()
    flag = res.parameters.get("triton_final_response")
    rec.response(res.id, bool(flag and flag.bool_param), [o.name for o in res.outputs], at)


def _close(client: grpcclient.InferenceServerClient, grace_s: float) -> bool:
    """Half-close the stream and wait for the server to end it; False (and the stream
    cancelled) when it is still open after `grace_s`."""
    closer = threading.Thread(target=client.stop_stream, name="soak-close", daemon=True)
    closer.start()
    closer.join(grace_s)
    if not closer.is_alive():
        return True
    client.stop_stream(cancel_requests=True)
    closer.join(10)
    return False


def send_one(client: grpcclient.InferenceServerClient, kind: Kind, index: int, *,
             timeout_s: float, close_grace_s: float) -> StreamRecord:
    """One request of `kind` on a stream of its own; every event of the stream recorded."""
    rid = f"soak-{index}-{kind.name}"
    events: queue.Queue = queue.Queue()
    rec = StreamRecord(rid, kind.name, sent_at=time.monotonic())
    try:
        inputs = kind.build(index)
        client.start_stream(callback=lambda result, error: events.put(
            (time.monotonic(), result, error)))
    except Exception as e:  # the server may be gone: that is an errored request
        rec.failure(f"client could not start the stream: {e}", time.monotonic())
        return rec
    try:
        client.async_stream_infer(kind.model, inputs, request_id=rid,
                                  enable_empty_final_response=True)
        deadline = rec.sent_at + timeout_s
        while not rec.terminal:
            try:
                _feed(rec, *events.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
    except Exception as e:
        rec.failure(f"client: {e}", time.monotonic())
    if rec.terminal:
        rec.close_stuck = not _close(client, close_grace_s)
    else:
        rec.deadline_passed()
        client.stop_stream(cancel_requests=True)
    while not events.empty():  # what came after the terminal event, until the stream ended
        _feed(rec, *events.get_nowait())
    return rec


# --- the soak ---------------------------------------------------------------------------

class _Budget:
    """Hands out request indices until the duration or the request count is spent."""

    def __init__(self, duration_s: float, max_requests: int):
        self.end = time.monotonic() + duration_s
        self.max_requests = max_requests
        self.sent = 0
        self._lock = threading.Lock()

    def next(self) -> int | None:
        with self._lock:
            if self.sent >= self.max_requests or time.monotonic() >= self.end:
                return None
            self.sent += 1
            return self.sent - 1


def _ready_models(url: str, models: set[str]) -> set[str]:
    with grpcclient.InferenceServerClient(url) as client:
        ready = set()
        for m in models:
            try:
                if client.is_model_ready(m):
                    ready.add(m)
            except InferenceServerException:
                pass
        return ready


def run_soak(url: str, server_pid: int, config: SoakConfig, *,
             progress_s: float = 30.0) -> SoakResult:
    """Soak the server at `url` (gRPC, host:port) whose tritonserver process is `server_pid`.

    Raises ValueError when none of the configured kinds' models is ready on the server.
    """
    kinds = available(config.kinds, _ready_models(url, {KINDS[k].model for k in config.kinds}))
    if not kinds:
        raise ValueError(f"the server at {url} serves none of the models of kinds "
                         f"{list(config.kinds)}")
    left_out = [k for k in config.kinds if k not in {kind.name for kind in kinds}]
    log.info("soak of %s: kinds %s%s", url, ", ".join(k.name for k in kinds),
             f"; left out (model not ready): {', '.join(left_out)}" if left_out else "")
    ledger = Ledger()
    sampler = RssSampler(server_pid, config.rss_interval_s).start()
    budget = _Budget(config.duration_s, config.max_requests)
    t0 = time.monotonic()

    def worker() -> None:
        client = grpcclient.InferenceServerClient(url)
        try:
            while (i := budget.next()) is not None:
                ledger.add(send_one(client, kinds[i % len(kinds)], i,
                                    timeout_s=config.request_timeout_s,
                                    close_grace_s=config.close_grace_s))
        finally:
            client.close()

    threads = [threading.Thread(target=worker, name=f"soak-worker-{n}", daemon=True)
               for n in range(config.concurrency)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            until = time.monotonic() + progress_s
            for t in threads:
                t.join(max(0.0, until - time.monotonic()))
            _log_progress(ledger, sampler, time.monotonic() - t0)
    finally:
        sampler.stop()
    elapsed = time.monotonic() - t0
    return _result(url, config, kinds, ledger, sampler, elapsed)


def _log_progress(ledger: Ledger, sampler: RssSampler, elapsed: float) -> None:
    s = ledger.summary()
    _, totals = sampler.totals()
    total = f"{totals[-1] / 2**30:.2f} GiB" if totals.size else "?"
    log.info("soak %.0f s: sent %d, completed %d, errored %d, lost %d, duplicated %d; RSS %s",
             elapsed, s["sent"], s["completed"], s["errored"], s["lost"], s["duplicated"], total)


def _result(url: str, config: SoakConfig, kinds: list[Kind], ledger: Ledger,
            sampler: RssSampler, elapsed: float) -> SoakResult:
    series = list(sampler.series.values())
    summary = ledger.summary(expect={k.name: k.expect for k in kinds})
    end_s = max((s.t[-1] for s in series if s.t), default=elapsed)
    span = {"end_s": end_s, "warmup_s": config.warmup_s, "window_s": config.window_s}
    g, anon = growth(series, **span), growth(series, **span, metric="anon")
    shm = growth([sampler.shm], **span)["processes"][sampler.shm.label]
    failures = ledger.failures(max_errors=config.max_errors)
    failures += _process_failures(series, end_s, config.rss_interval_s)
    failures += _growth_failures(g, config, "RSS")
    failures += _growth_failures(anon, config, "anonymous memory")
    failures += _growth_failures({"total": shm, "processes": {}}, config, "the server's /dev/shm files")
    first_round = min((s.t[0] for s in series if s.t), default=0.0)
    report = {
        "url": url,
        "config": dataclasses.asdict(config),
        "kinds": {k.name: {"model": k.model, "doc": k.doc} for k in kinds},
        "elapsed_s": elapsed,
        "requests_per_s": summary["completed"] / elapsed if elapsed else 0.0,
        "summary": summary,
        "rss": {
            "interval_s": config.rss_interval_s,
            "growth": g,
            "anon_growth": anon,
            "windows_s": windows(end_s, config.warmup_s, config.window_s),
            "processes_started_late": sorted(s.label for s in series
                                             if s.t and s.t[0] > first_round + config.rss_interval_s),
            "series": {s.label: {"pid": s.pid, "t": [round(t, 2) for t in s.t],
                                 "rss_mib": [round(r / 2**20, 2) for r in s.rss],
                                 "anon_mib": [round(r / 2**20, 2) for r in s.anon]}
                       for s in series},
        },
        "shm": {
            "growth": shm,
            "files_seen": len(sampler.shm_files),
            "t": [round(t, 2) for t in sampler.shm.t],
            "mib": [round(r / 2**20, 2) for r in sampler.shm.rss],
        },
        "failures": failures,
    }
    return SoakResult(report, series, sampler.shm)


def _process_failures(series: list[Series], end_s: float, interval_s: float) -> list[str]:
    """A server process that went away during the soak (a crashed stub or engine)."""
    return [f"process {s.label} (pid {s.pid}) exited during the soak at {s.t[-1]:.0f} s"
            for s in series if s.t and s.t[-1] < end_s - 2.5 * interval_s]


def _growth_failures(g: dict, config: SoakConfig, what: str) -> list[str]:
    """Growth of `what` past the limit: in total (of any size), and of each process of at
    least `rss_min_mib` at baseline."""
    limit = config.max_rss_growth_pct
    if limit is None:
        return []
    rows = [(f"{what} (total)", g["total"])] + [
        (f"{what} of {label}", row) for label, row in g["processes"].items()
        if row["start_mib"] is not None and row["start_mib"] >= config.rss_min_mib]
    return [f"{name} grew {row['growth_pct']:.1f}% after warm-up "
            f"({row['start_mib']:.0f} -> {row['end_mib']:.0f} MiB; limit {limit:g}%)"
            for name, row in rows if row["growth_pct"] is not None and row["growth_pct"] > limit]



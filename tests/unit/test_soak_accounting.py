"""omni_tools.soak: the accounting of a soak catches every stream that went wrong.

The ledger is driven with synthetic event sequences; `send_one` with a fake
tritonclient that replays scripted gRPC streams made of real
ModelInferResponse protos; RSS growth with synthetic samples. No server.
"""
from __future__ import annotations

import os
import threading

import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import InferenceServerException

from omni_tools.soak.cli import loopback_target
from omni_tools.soak.ledger import Ledger, StreamRecord
from omni_tools.soak.memory import RssSampler, Series, _stub_instance, growth, plot, total_series
from omni_tools.soak.mix import KINDS, available
from omni_tools.soak.runner import SoakConfig, _growth_failures, send_one


def stream(events, rid: str = "r1", kind: str = "chat") -> StreamRecord:
    """A record fed `events`: ("text", id), ("final", id), ("error", msg), ("deadline",)."""
    rec = StreamRecord(rid, kind, sent_at=0.0)
    for at, (what, *arg) in enumerate(events, start=1):
        if what == "text":
            rec.response(arg[0] if arg else rid, final=False, outputs=["text_output"], at=at)
        elif what == "final":
            rec.response(arg[0] if arg else rid, final=True, outputs=["finish_reason"], at=at)
        elif what == "error":
            rec.failure(arg[0], at=at)
        elif what == "deadline":
            rec.deadline_passed()
    return rec


def ledger_of(*records: StreamRecord) -> Ledger:
    ledger = Ledger()
    for r in records:
        ledger.add(r)
    return ledger


# --- the ledger ---------------------------------------------------------------------------

def test_a_stream_that_ends_with_one_final_response_is_completed():
    rec = stream([("text",), ("text",), ("final",)])
    assert rec.outcome == "completed" and rec.problems() == [] and rec.latency_s == 3
    s = ledger_of(rec).summary(expect={"chat": ["text_output"]})
    assert (s["sent"], s["completed"], s["lost"], s["duplicated"], s["streams_not_one_final"]) == (
        1, 1, 0, 0, 0)
    assert s["by_kind"]["chat"]["missing_outputs"] == 0
    assert ledger_of(rec).failures() == []


def test_a_duplicate_final_response_is_detected():
    rec = stream([("text",), ("final",), ("final",)])
    s = ledger_of(rec).summary()
    assert s["duplicated"] == 1 and s["streams_not_one_final"] == 1 and s["completed"] == 1
    assert any("2 final responses" in p for p in rec.problems())
    assert ledger_of(rec).failures()


def test_a_response_after_the_final_one_is_detected():
    rec = stream([("final",), ("text",)])
    assert rec.finals == 1 and rec.after_terminal == 1
    assert ledger_of(rec).summary()["duplicated"] == 1
    assert any("after the final" in f for f in ledger_of(rec).failures())


def test_a_stream_without_a_final_response_is_lost():
    rec = stream([("text",), ("text",), ("deadline",), ("final",)])  # the final came too late
    s = ledger_of(rec).summary()
    assert rec.outcome == "lost" and s["lost"] == 1 and s["completed"] == 0 and s["late"] == 1
    assert s["streams_not_one_final"] == 1 and s["duplicated"] == 0
    assert any("lost" in f for f in ledger_of(rec).failures())


def test_another_requests_response_is_not_taken_for_ours():
    rec = stream([("text",), ("final", "r2")])  # r2's final on r1's stream
    assert rec.wrong_id == 1 and rec.outcome == "lost"
    assert ledger_of(rec).summary()["wrong_id"] == 1
    assert ledger_of(rec).failures()


def test_an_error_ends_a_stream_and_fails_the_soak_beyond_the_allowed_errors():
    rec = stream([("text",), ("error", "stage 'thinker' (model llm) failed: boom")])
    assert rec.outcome == "errored" and rec.problems() == []
    s = ledger_of(rec).summary()
    assert s["errored"] == 1 and s["errors_by_message"] == {rec.error: 1}
    assert ledger_of(rec).failures(max_errors=0)
    assert ledger_of(rec).failures(max_errors=1) == []


def test_a_final_response_after_an_error_is_one_terminal_event_too_many():
    rec = stream([("error", "boom"), ("final",)])
    assert rec.outcome == "errored" and rec.after_terminal == 1
    assert ledger_of(rec).summary()["streams_not_one_final"] == 1


def test_a_completed_reply_without_its_expected_output_is_counted():
    rec = stream([("final",)], kind="chat_speech")
    s = ledger_of(rec).summary(expect={"chat_speech": ["text_output", "audio_chunk"]})
    assert s["by_kind"]["chat_speech"]["missing_outputs"] == 1


# --- one request over a (fake) gRPC stream --------------------------------------------------

def response(rid: str, *, final: bool = False, output: str | None = "text_output") -> InferResult:
    r = service_pb2.ModelInferResponse(id=rid)
    if output:
        r.outputs.add(name=output)
    r.parameters["triton_final_response"].bool_param = final
    return InferResult(r)


class FakeClient:
    """Replays one scripted stream: `script` is what the server sends for a request,
    `after_close` what it still sends once the client half-closes; `hang` keeps the
    stream open after that until the client cancels."""

    def __init__(self, script, after_close=(), hang: bool = False):
        self.script, self.after_close, self.hang = script, after_close, hang
        self.callback = None
        self.cancelled = threading.Event()
        self.sent: list[tuple[str, str]] = []

    def start_stream(self, callback, **_):
        self.callback = callback

    def async_stream_infer(self, model, inputs, *, request_id, enable_empty_final_response):
        assert enable_empty_final_response
        self.sent.append((model, request_id))
        for item in self.script(request_id):
            self._deliver(item)

    def _deliver(self, item):
        if isinstance(item, InferenceServerException):
            self.callback(result=None, error=item)
        else:
            self.callback(result=item, error=None)

    def stop_stream(self, cancel_requests: bool = False):
        if cancel_requests:
            self.cancelled.set()
            self.callback(result=None, error=InferenceServerException(
                "Locally cancelled by application!", status="StatusCode.CANCELLED"))
            return
        for item in self.after_close(self.sent[-1][1]) if self.after_close else ():
            self._deliver(item)
        if self.hang:
            self.cancelled.wait(30)


def run_fake(client: FakeClient, kind: str = "chat", **kw) -> StreamRecord:
    return send_one(client, KINDS[kind], 7, timeout_s=kw.get("timeout_s", 5.0),
                    close_grace_s=kw.get("close_grace_s", 2.0))


def test_send_one_gives_each_request_its_own_id_and_waits_for_the_final():
    client = FakeClient(lambda rid: [response(rid), response(rid, final=True, output="metrics")])
    rec = run_fake(client)
    assert client.sent == [("omni", "soak-7-chat")]
    assert rec.outcome == "completed" and rec.problems() == []
    assert set(rec.outputs) == {"text_output", "metrics"}


def test_send_one_sees_a_response_the_server_sends_after_the_final():
    client = FakeClient(lambda rid: [response(rid, final=True)],
                        after_close=lambda rid: [response(rid, final=True)])
    rec = run_fake(client)
    assert rec.after_terminal == 1 and rec.finals == 2 and rec.problems()


def test_send_one_flags_a_stream_the_server_keeps_open_after_the_final():
    client = FakeClient(lambda rid: [response(rid, final=True)], hang=True)
    rec = run_fake(client, close_grace_s=0.5)
    assert rec.close_stuck and client.cancelled.is_set()
    assert rec.errors == 0  # our own cancellation is not the server's error
    assert any("kept the stream open" in p for p in rec.problems())


def test_send_one_cancels_and_counts_a_request_that_never_ends_as_lost():
    client = FakeClient(lambda rid: [response(rid)])
    rec = run_fake(client, timeout_s=0.5)
    assert rec.outcome == "lost" and rec.timed_out and client.cancelled.is_set()
    assert rec.errors == 0 and rec.late == 0


def test_send_one_records_an_in_band_error_as_the_end_of_the_stream():
    client = FakeClient(lambda rid: [InferenceServerException("sampling_parameters.max_tokens: bad")])
    rec = run_fake(client, "llm")
    assert client.sent == [("llm", "soak-7-llm")]
    assert rec.outcome == "errored" and rec.error == "sampling_parameters.max_tokens: bad"


# --- RSS --------------------------------------------------------------------------------------

def series(label: str, start_mib: float, slope_mib_s: float, n: int = 101, pid: int = 1,
           anon_mib: float = 50.0) -> Series:
    """RSS from `start_mib` growing by `slope_mib_s`; of it a constant `anon_mib` anonymous."""
    s = Series(pid, label)
    for i in range(n):
        s.t.append(float(i))
        s.rss.append(int((start_mib + slope_mib_s * i) * 2**20))
        s.anon.append(int(anon_mib * 2**20))
    return s


def test_growth_compares_the_window_after_warm_up_with_the_last_one():
    flat, leaking = series("stub:omni_0_0", 400, 0.0, pid=1), series("stub:llm_0_0", 500, 2.0, pid=2)
    g = growth([flat, leaking], end_s=100, warmup_s=10, window_s=10)
    assert g["baseline_window_s"] == [10, 20] and g["final_window_s"] == [90, 100]
    assert g["processes"]["stub:omni_0_0"]["growth_pct"] == pytest.approx(0.0)
    # medians 530 -> 690 MiB
    assert g["processes"]["stub:llm_0_0"]["growth_pct"] == pytest.approx(100 * 160 / 530)
    assert g["total"]["growth_mib"] == pytest.approx(160)
    assert g["processes"]["stub:llm_0_0"]["trend_mib_per_min"] == pytest.approx(120)
    assert g["processes"]["stub:omni_0_0"]["trend_mib_per_min"] == pytest.approx(0, abs=1e-6)
    failures = _growth_failures(g, SoakConfig(duration_s=100, warmup_s=10, max_rss_growth_pct=10), "RSS")
    assert [f.split(" grew")[0] for f in failures] == ["RSS (total)", "RSS of stub:llm_0_0"]


def test_anonymous_memory_is_judged_on_its_own():
    """File pages the kernel drops under memory pressure shrink RSS; a leak stays in anon."""
    evicted = series("llm_0_0/EngineCore/Worker", 2000, -5.0, anon_mib=0)
    for i, _ in enumerate(evicted.anon):
        evicted.anon[i] = int((1000 + 2.0 * i) * 2**20)
    span = {"end_s": 100, "warmup_s": 10, "window_s": 10}
    assert growth([evicted], **span)["total"]["growth_pct"] < 0
    anon = growth([evicted], **span, metric="anon")
    assert anon["total"]["growth_pct"] == pytest.approx(100 * 160 / 1030)
    failures = _growth_failures(anon, SoakConfig(duration_s=100, warmup_s=10), "anonymous memory")
    assert failures[0].startswith("anonymous memory (total) grew 15.5%")


def test_a_short_run_shrinks_the_windows_to_fit():
    g = growth([series("x", 100, 0.0, n=31)], end_s=30, warmup_s=15, window_s=60)
    assert g["baseline_window_s"] == [15, 20] and g["final_window_s"] == [25, 30]


def test_totals_add_the_processes_of_each_sampling_round():
    a, b = series("a", 100, 0, n=3, pid=1), series("b", 50, 0, n=2, pid=2)
    a.t.append(2.1)  # the closing sample, just after the last round: a round of its own
    a.rss.append(100 * 2**20)
    t, total = total_series([a, b])
    assert list(t) == [0, 1, 2, 2.1] and list(total // 2**20) == [150, 150, 100, 100]


def test_the_plot_is_a_png(tmp_path):
    path = plot([series("a", 100, 0.5, n=20), series("b", 300, 0, n=20, pid=2)], tmp_path / "p.png",
                warmup_s=5, windows_s=((5, 10), (15, 19)), title="t", shm=series("shm", 10, 0, n=20))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sampler_reads_this_process_and_the_shared_memory_it_maps():
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(create=True, size=4 * 2**20)
    try:
        block.buf[:] = b"\1" * block.size  # touched: tmpfs pages allocated
        sampler = RssSampler(os.getpid(), interval_s=0.2)
        sampler.sample()
        mine = sampler.series[os.getpid()]
        assert mine.rss[0] > mine.anon[0] > 0
        assert f"/dev/shm/{block.name}" in sampler.shm_files
        assert sampler.shm.rss[0] >= block.size
    finally:
        block.close()
        block.unlink()


def test_a_stub_is_named_after_its_model_instance():
    cmd = ["/x/triton_python_backend_stub", "/r/llm/1/model.py", "shm", "1048576", "1048576", "42",
           "/x/python", "336", "llm_0_0", "/x/omni_llm"]
    assert _stub_instance(cmd) == "llm_0_0"
    assert _stub_instance(["/usr/bin/python3", "-c", "..."]) is None


# --- bounds and targets ------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("concurrency", 0), ("concurrency", 65),
                                          ("duration_s", 3601), ("max_requests", 0)])
def test_the_load_is_bounded(field, value):
    with pytest.raises(ValueError, match=field):
        SoakConfig(**{field: value})


def test_unknown_kinds_are_refused_and_absent_models_left_out():
    with pytest.raises(ValueError, match="chatt"):
        SoakConfig(kinds=("chatt",))
    assert [k.name for k in available(["llm", "chat", "text_to_image"], {"llm"})] == ["llm"]


@pytest.mark.parametrize("url", ["127.0.0.1:8001", "localhost:8001", "[::1]:8001"])
def test_loopback_targets_are_accepted(url):
    assert loopback_target(url)[1] == 8001


@pytest.mark.parametrize("url, why", [("10.1.2.3:8001", "loopback"), ("8.8.8.8:8001", "loopback"),
                                      ("grpc://127.0.0.1:8001", "no scheme"),
                                      ("127.0.0.1", "host:port")])
def test_other_targets_are_refused(url, why):
    with pytest.raises(ValueError, match=why):
        loopback_target(url)

"""A short soak of omni-chat (every kind of request at once): nothing lost, duplicated or
misrouted, every stream ends with one final response, and every server process is sampled.

The 10-minute soak with its RSS figures is in docs/reliability.md; this one runs the same
code (omni_tools.soak) for 20 s against the session's omni-chat server.
"""
from __future__ import annotations

import psutil
import pytest

from omni_tools.soak import SoakConfig, run_soak
from omni_tools.soak.mix import KINDS

pytestmark = pytest.mark.integration

CONFIG = SoakConfig(concurrency=8, duration_s=20, warmup_s=4, window_s=4, rss_interval_s=1.0,
                    request_timeout_s=60, max_rss_growth_pct=None)


@pytest.fixture(scope="module")
def soak(omni_chat_server, tmp_path_factory):
    result = run_soak(omni_chat_server.grpc_url, omni_chat_server.proc.pid, CONFIG)
    out = tmp_path_factory.mktemp("soak")
    result.write(out / "soak.json", out / "soak_rss.png")
    print(f"\nsoak report: {out / 'soak.json'}")
    return result, omni_chat_server


def test_every_request_of_every_kind_completes_with_exactly_one_final_response(soak):
    result, _ = soak
    s = result.report["summary"]
    assert s["sent"] > 0 and s["completed"] == s["sent"], result.report["failures"]
    assert (s["errored"], s["lost"], s["duplicated"]) == (0, 0, 0), result.report["failures"]
    assert (s["streams_not_one_final"], s["wrong_id"], s["close_stuck"], s["late"]) == (0, 0, 0, 0)
    assert set(s["by_kind"]) == set(KINDS)
    for kind, row in s["by_kind"].items():
        assert row["completed"] > 0 and row["missing_outputs"] == 0, (kind, row)
    assert result.ok, result.report["failures"]


def test_the_rss_of_every_server_process_is_sampled_throughout(soak):
    result, server = soak
    series = {s.pid: s for s in result.series}
    now = [server.proc.pid, *(p.pid for p in psutil.Process(server.proc.pid).children(recursive=True))]
    missing = [pid for pid in now if pid not in series]
    assert not missing, f"processes never sampled: {missing}"
    rounds = CONFIG.duration_s / CONFIG.rss_interval_s
    for pid in now:
        assert len(series[pid].rss) >= rounds / 2 and min(series[pid].rss) > 0, series[pid].label
    labels = {s.label for s in result.series}
    models = {"omni", "llm", "talker", "image_encoder", "audio_encoder", "audio_decoder",
              "text_to_image"}
    assert {f"stub:{m}_0_0" for m in models} <= labels
    assert {"tritonserver", "llm_0_0/EngineCore", "talker_0_0/EngineCore"} <= labels
    growth = result.report["rss"]["growth"]
    assert growth["total"]["growth_pct"] is not None
    assert result.report["rss"]["processes_started_late"] == []

"""A disaggregated omni pipeline: the thinker on one tritonserver, the rest on another."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import yaml

from omni_tools.server import TritonServer, free_port
from omni_tools.spec import load_preset

from .llm_io import metric
from .omni_io import OmniStream, omni_inputs, run_omni

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "max_tokens": 16}


def _split_spec(engine_grpc_port: int) -> dict:
    data = load_preset("omni-chat").model_dump(mode="json", exclude_none=True)
    keep = ("llm", "talker", "audio_decoder", "omni")
    data["stages"] = {name: data["stages"][name] for name in keep}
    data["stages"]["omni"]["engine_args"]["stages"] = {
        "thinker": "llm", "talker": "talker", "audio_decoder": "audio_decoder"}
    data["servers"] = {"front": {}, "engine": {"grpc_url": f"127.0.0.1:{engine_grpc_port}"}}
    data["stages"]["llm"]["server"] = "engine"
    for name in ("talker", "audio_decoder", "omni"):
        data["stages"][name]["server"] = "front"
    data["pipeline"] = "omni-split"
    return data


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-servers")
    engine_grpc = free_port()
    (root / "spec.yaml").write_text(yaml.safe_dump(_split_spec(engine_grpc), sort_keys=False))
    cli = Path(sys.prefix) / "bin" / "omni-gen-repo"
    subprocess.run([str(cli), str(root / "spec.yaml"), "-o", str(root / "repo")], check=True,
                   timeout=600)
    engine = TritonServer(root / "repo" / "engine", grpc_port=engine_grpc,
                          log_path=root / "engine.log")
    engine.start()
    try:
        # ports are picked once the engine server holds its own
        front = TritonServer(root / "repo" / "front", log_path=root / "front.log")
        front.start()
        try:
            yield front, engine
        finally:
            front.stop()
    finally:
        engine.stop()
        print(f"\nlogs: {root}")


def test_the_generator_wrote_one_repository_per_server(servers):
    front, engine = servers
    assert sorted(p.name for p in engine.repository.iterdir() if p.is_dir()) == ["llm"]
    assert sorted(p.name for p in front.repository.iterdir() if p.is_dir()) == [
        "audio_decoder", "omni", "talker"]


def test_one_request_streams_through_both_servers(servers):
    front, engine = servers
    before = metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm")
    result = run_omni(front.grpc_url, text="hello from the front", modalities=["text", "audio"],
                      sampling=GREEDY, seed=1)
    assert result.error is None, result.error
    assert result.text and result.chunks and result.sample_rate == 24000
    # the thinker ran on the engine server, which the front server does not have
    assert metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm") - before == 16
    assert not grpcclient.InferenceServerClient(front.grpc_url).is_model_ready("llm")


def test_a_cancel_crosses_the_hop(servers):
    front, engine = servers
    before = metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm")
    stream = OmniStream(front.grpc_url)
    stream.send(omni_inputs("go on and on", modalities=["audio"],
                            sampling={"temperature": 0, "max_tokens": 1500, "ignore_eos": True}))
    response, error = stream.next(timeout=60)
    assert error is None, error
    stream.close(cancel=True)
    deadline = time.monotonic() + 15
    while metric(engine.metrics(), "omni_llm_engine_running_requests", "llm") != 0 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    generated = metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm") - before
    assert 0 < generated < 1500 / 2  # started on the engine server, aborted there


def test_losing_the_engine_server_is_a_quick_unavailable_error(servers):
    front, engine = servers
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait(timeout=30)
    t0 = time.monotonic()
    result = run_omni(front.grpc_url, text="anyone there?", sampling=GREEDY)
    elapsed = time.monotonic() - t0
    assert result.error is not None
    assert result.error.status() == "StatusCode.UNAVAILABLE", result.error
    assert "stage 'thinker' (model llm) failed" in result.error.message()
    assert elapsed < 10

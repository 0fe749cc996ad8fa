"""A disaggregated omni pipeline: the thinker on one tritonserver, the rest on another.

Its own two servers: what it tests is the hop between two tritonservers (shared memory
registered with the engine server, the front's reconnect once the engine server is
SIGKILLed and started again), which one shared server cannot show.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import yaml

from omni_serve.orchestrator.shm import SHM_PREFIX
from omni_tools.server import TritonServer, free_port
from omni_tools.spec import load_preset

from .llm_io import cancel_limit, metric, wait_idle
from .omni_io import OmniResult, OmniStream, error_code, omni_inputs, png, run_omni

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "max_tokens": 16}
NO_SHM = "omni_grpc"  # a second entry model on the front server, without shared memory
# The tiny preprocessor scales an image to at most 25088 px: ~30 rows of the tiny
# thinker's 128 floats, ~15 KiB of mm_embeds (a real Qwen2.5-Omni image: MiBs). So the
# engine server here takes shared memory from 4 KiB on (the default is 1 MiB).
BIG_IMAGE = png(448, 336, seed=3)
SHM_MIN_BYTES = 4096


def _split_spec(engine_grpc_port: int) -> dict:
    data = load_preset("omni-chat").model_dump(mode="json", exclude_none=True)
    keep = ("llm", "talker", "image_encoder", "audio_decoder", "omni")
    data["stages"] = {name: data["stages"][name] for name in keep}
    data["stages"]["omni"]["engine_args"]["stages"] = {
        "thinker": "llm", "talker": "talker", "image_encoder": "image_encoder",
        "audio_decoder": "audio_decoder"}
    # the engine server is on this host: `omni` sends mm_embeds through system
    # shared memory ("auto"); `omni_grpc` is told not to (the run-time override)
    data["stages"][NO_SHM] = json.loads(json.dumps(data["stages"]["omni"]))
    data["stages"][NO_SHM]["env"] = {"OMNI_SERVER_ENGINE_SHM": "none"}
    data["servers"] = {"front": {}, "engine": {"grpc_url": f"127.0.0.1:{engine_grpc_port}",
                                               "shared_memory_min_bytes": SHM_MIN_BYTES}}
    data["stages"]["llm"]["server"] = "engine"
    for name in ("talker", "image_encoder", "audio_decoder", "omni", NO_SHM):
        data["stages"][name]["server"] = "front"
    # what is tested is the hop between servers, not compiled graphs: eager engines load
    # ~22 s sooner each on 2 cores (and again when the engine server is restarted)
    for name in ("llm", "talker"):
        data["stages"][name]["engine_args"]["enforce_eager"] = True
    data["pipeline"] = "omni-split"
    return data


def _engine_regions(engine) -> list[str]:
    """The orchestrators' system shared-memory regions registered with the engine server."""
    status = grpcclient.InferenceServerClient(engine.grpc_url).get_system_shared_memory_status(
        as_json=True)
    return sorted(name for name in status.get("regions", {}) if name.startswith(SHM_PREFIX))


def _dev_shm() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}*"))


def _wait_for_no_regions(engine, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _engine_regions(engine)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


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
    front = None
    try:
        # Both start at once: the front reaches the engine only when a request comes. A
        # start retried on fresh ports moves the engine (the env wins over the spec's URL),
        # and then the front starts again, told where.
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(engine.start)
            front = _front(root, engine.grpc_url)
            started.result()
        if front.env["OMNI_SERVER_ENGINE_URL"] != engine.grpc_url:
            front.stop()
            front = _front(root, engine.grpc_url)
        yield front, engine
    finally:
        if front is not None:
            front.stop()
        engine.stop()
        print(f"\nlogs: {root}")


def _front(root: Path, engine_url: str) -> TritonServer:
    return TritonServer(root / "repo" / "front", log_path=root / "front.log",
                        env={"OMNI_SERVER_ENGINE_URL": engine_url}).start()


def test_the_generator_wrote_one_repository_per_server(servers):
    front, engine = servers
    assert sorted(p.name for p in engine.repository.iterdir() if p.is_dir()) == ["llm"]
    assert sorted(p.name for p in front.repository.iterdir() if p.is_dir()) == [
        "audio_decoder", "image_encoder", "omni", NO_SHM, "talker"]
    engine_json = json.loads((front.repository / "omni" / "engine.json").read_text())
    spec = yaml.safe_load((front.repository.parents[1] / "spec.yaml").read_text())
    assert engine_json["remote"] == {"llm": {"server": "engine",
                                             "url": spec["servers"]["engine"]["grpc_url"],
                                             "shared_memory_min_bytes": SHM_MIN_BYTES}}


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


def _engine_busy(engine, before: float, timeout: float = 30.0) -> bool:
    """Wait until the remote thinker runs the request: True; False when it already ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = engine.metrics()
        if metric(text, "omni_llm_generation_tokens_total", "llm") > before:
            return False
        if metric(text, "omni_llm_engine_running_requests", "llm") >= 1:
            return True
        time.sleep(0.05)
    raise AssertionError("the remote thinker never ran the request")


def test_a_cancel_crosses_the_hop(servers):
    front, engine = servers
    max_tokens = 1500
    before = metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm")
    stream = OmniStream(front.grpc_url)
    stream.send(omni_inputs("go on and on", modalities=["audio"], sampling={
        "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}))
    assert _engine_busy(engine, before), "the remote thinker finished before it was seen running"
    sent = len(stream.received().deltas)
    stream.close(cancel=True)
    idle = wait_idle(front, llm_models=(), orchestrators=("omni",))  # no call will start
    idle.update(wait_idle(engine))  # and the thinker's has ended
    assert not any(idle.values()), idle
    generated = metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm") - before
    # started on the engine server and aborted there: of what it had left when the client
    # cancelled, it generated less than half
    assert 0 < generated < cancel_limit(sent, max_tokens), sent


def _image_request(url: str, model: str, engine=None, sampling=None) -> tuple[OmniResult, list]:
    """One image + text request; with `engine`, its regions while the reply streams."""
    stream = OmniStream(url)
    stream.client.async_stream_infer(
        model, omni_inputs("what do you see?", image=BIG_IMAGE, modalities=["text"],
                           sampling=sampling or GREEDY),
        enable_empty_final_response=True)
    result = OmniResult()
    during: list[str] = []
    try:
        if engine is not None:  # while the thinker call runs, its region is registered
            before = metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm")
            deadline = time.monotonic() + 30
            while not during and time.monotonic() < deadline and metric(
                    engine.metrics(), "omni_llm_generation_tokens_total", "llm") == before:
                during = _engine_regions(engine)
                time.sleep(0.02)
        stream.collect(result)
    finally:
        stream.close()
    return result, during


def test_an_image_reaches_the_remote_thinker_through_shared_memory(servers):
    front, engine = servers
    assert _engine_regions(engine) == []
    long_reply = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    shm, during = _image_request(front.grpc_url, "omni", engine, long_reply)
    assert shm.error is None, shm.error
    assert len(during) == 1, during  # mm_embeds went in a region of its own
    assert _wait_for_no_regions(engine) == []  # unregistered once the request ended
    grpc, during = _image_request(front.grpc_url, NO_SHM, engine, long_reply)
    assert grpc.error is None, grpc.error
    assert during == []  # OMNI_SERVER_ENGINE_SHM=none: inline in the gRPC message
    assert shm.text and shm.text == grpc.text  # the same rows reached the thinker
    assert _dev_shm() == []  # nothing left behind on this host


def test_a_cancelled_image_request_releases_its_region(servers):
    front, engine = servers
    before = metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm")
    stream = OmniStream(front.grpc_url)
    stream.send(omni_inputs("go on and on", image=BIG_IMAGE, modalities=["text"], sampling={
        "temperature": 0, "max_tokens": 1500, "ignore_eos": True}))
    assert _engine_busy(engine, before), "the remote thinker finished before it was seen running"
    regions = _engine_regions(engine)
    sent = len(stream.received().deltas)
    stream.close(cancel=True)
    assert len(regions) == 1  # the running request's mm_embeds
    assert _wait_for_no_regions(engine) == []  # released once Triton let go of the request
    assert _dev_shm() == []
    idle = wait_idle(front, llm_models=(), orchestrators=("omni",))
    idle.update(wait_idle(engine))
    assert not any(idle.values()), idle
    generated = metric(engine.metrics(), "omni_llm_generation_tokens_total", "llm") - before
    # aborted on the engine server: less than half of what it had left when the client cancelled
    assert generated < cancel_limit(sent, 1500), sent


@pytest.fixture
def lost_engine(servers):
    """The engine server killed (SIGKILL), and started again afterwards on its ports (the
    front's URL names them), so the module's other tests find it in any order."""
    front, engine = servers
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait(timeout=30)
    try:
        yield front, engine
    finally:
        if engine.proc.poll() is not None:
            engine.start(attempts=1)


def test_losing_the_engine_server_is_a_quick_unavailable_error_until_it_is_back(lost_engine):
    front, engine = lost_engine
    t0 = time.monotonic()
    result = run_omni(front.grpc_url, text="anyone there?", sampling=GREEDY)
    elapsed = time.monotonic() - t0
    assert result.error is not None
    assert error_code(result.error) == "UNAVAILABLE", result.error
    assert "stage 'thinker' (model llm) failed" in result.error.message()
    assert elapsed < 10
    # An operator starts the engine server again: the front, not restarted, serves through
    # it within seconds (its channel's reconnect back-off is capped at 1 s; gRPC's own grows
    # to 120 s, and each call meanwhile fails at once).
    engine.start(attempts=1)
    ready_at = time.monotonic()
    while (result := run_omni(front.grpc_url, text="anyone there?", sampling=GREEDY)).error \
            and time.monotonic() - ready_at < 5:
        time.sleep(0.1)
    assert result.error is None, result.error
    assert result.text

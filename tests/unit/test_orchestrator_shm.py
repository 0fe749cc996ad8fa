"""System shared memory for a co-located remote stage: the decision and the regions' lifecycle.

No tritonserver: a fake aio client stands in for the remote server; it reads
each region through its /dev/shm name at registration, the way tritonserver
maps it, and records what was registered and unregistered.
"""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from multiprocessing import resource_tracker
from multiprocessing import shared_memory as mpshm
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from omni_serve.contract import LLM
from omni_serve.orchestrator.config import OrchestratorConfig, RemoteStage
from omni_serve.orchestrator.grpc_client import GrpcStageClient
from omni_serve.orchestrator.locality import (
    RemoteEndpoint,
    is_local_host,
    remote_endpoints,
    url_host,
    use_shared_memory,
)
from omni_serve.orchestrator.pipeline import StageCallError
from omni_serve.orchestrator.shm import SHM_PREFIX, ShmRegions, shm_layout
from omni_serve.orchestrator.stage_clients import RoutingStageClient, stage_client

KIB = 1024
EMBEDS = np.arange(200 * 128, dtype=np.float32).reshape(200, 128)  # 100 KiB
IDS = np.arange(10, dtype=np.int64)


def leftovers() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}*"))


@pytest.fixture(autouse=True)
def no_leaks():
    before = leftovers()
    yield
    assert leftovers() == before


# --- the decision -------------------------------------------------------------------

@pytest.mark.parametrize("url,host", [
    ("127.0.0.1:8001", "127.0.0.1"), ("gpu-host:8001", "gpu-host"), ("[::1]:8001", "::1"),
    ("grpc://engine.svc:8001", "engine.svc"), ("localhost", "localhost"), ("::1", "::1"),
])
def test_the_host_of_a_grpc_url(url, host):
    assert url_host(url) == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "localhost", "LOCALHOST",
                                  "x.localhost", socket.gethostname()])
def test_loopback_and_this_hosts_name_are_local(host):
    assert is_local_host(host)


@pytest.mark.parametrize("host", ["gpu-host.example.com", "192.0.2.7", "", "2001:db8::1"])
def test_other_hosts_are_not_local(host):
    assert not is_local_host(host)


@pytest.mark.parametrize("mode,url,expected", [
    ("auto", "127.0.0.1:8001", True), ("auto", "gpu-host.example.com:8001", False),
    ("system", "gpu-host.example.com:8001", True), ("none", "127.0.0.1:8001", False),
])
def test_shared_memory_is_used_per_mode(mode, url, expected):
    assert use_shared_memory(mode, url) is expected
    assert (GrpcStageClient(url, mode).shm is not None) is expected


def test_the_mode_comes_from_the_remote_entry_and_the_environment_overrides_it(monkeypatch):
    cfg = OrchestratorConfig.model_validate({
        "stages": {"thinker": "llm"},
        "remote": {"llm": {"server": "gpu-a", "url": "127.0.0.1:9", "shared_memory": "system",
                           "shared_memory_min_bytes": 4096}}})
    assert remote_endpoints(cfg) == {"llm": RemoteEndpoint("127.0.0.1:9", "system", 4096)}
    monkeypatch.setenv("OMNI_SERVER_GPU_A_SHM", "None")
    assert remote_endpoints(cfg)["llm"].shared_memory == "none"
    monkeypatch.setenv("OMNI_SERVER_GPU_A_SHM", "posix")
    with pytest.raises(ValueError, match="OMNI_SERVER_GPU_A_SHM='posix': use auto, system or none"):
        remote_endpoints(cfg)
    assert RemoteStage(server="s").shared_memory == "auto"
    assert RemoteStage(server="s").shared_memory_min_bytes == 1024 * KIB


def test_one_client_per_server_and_shared_memory_only_for_the_remote_one():
    client = stage_client("127.0.0.1:1", {
        "llm": RemoteEndpoint("127.0.0.1:2", "auto"), "talker": RemoteEndpoint("127.0.0.1:2", "auto"),
        "dec": "127.0.0.1:3"})
    assert isinstance(client, RoutingStageClient)
    assert client.remote["llm"] is client.remote["talker"]
    assert client.remote["llm"].shm is not None
    assert client.local.shm is None and client.remote["dec"].shm is None


def test_only_large_numeric_inputs_go_to_shared_memory():
    inputs = {LLM.TEXT_INPUT: np.array([b"x" * 100 * KIB], dtype=np.object_),
              LLM.IMAGE_EMBEDS: EMBEDS, LLM.PROMPT_TOKEN_IDS: IDS,
              "odd": np.zeros(64 * KIB + 1, np.uint8)}
    offsets, size = shm_layout(inputs, 64 * KIB)
    assert offsets == {LLM.IMAGE_EMBEDS: 0, "odd": EMBEDS.nbytes}
    assert size == EMBEDS.nbytes + 64 * KIB + 64  # each tensor starts 64-byte aligned
    assert shm_layout(inputs, 1)[0].keys() == {LLM.IMAGE_EMBEDS, LLM.PROMPT_TOKEN_IDS, "odd"}


# --- the regions --------------------------------------------------------------------

class FakeServer:
    """The parts of tritonclient.grpc.aio.InferenceServerClient the stage client uses, and of
    its StreamChannel (whose `stub` has ModelStreamInfer)."""

    def __init__(self, *, register_error: InferenceServerException | None = None,
                 busy: int = 0, stream=None):
        self.register_error = register_error
        self.busy = busy  # unregister answers "in use" this many times
        self.regions: dict[str, bytes] = {}  # registered: name -> content read at registration
        self.register_calls: list[str] = []
        self.unregister_calls: list[str] = []
        self.infers: list[list] = []
        self.stream = stream
        self.closed = False
        self.ready = True  # what is_model_ready answers
        self.ready_asked: list[str] = []
        self.version = "2.51.0"  # what get_server_metadata answers
        self.stream_metadata: list = []  # the metadata each stream was opened with
        self.stub = self

    async def get_server_metadata(self, headers=None, as_json=False, client_timeout=None):
        return {"name": "triton", "version": self.version, "extensions": []}

    async def is_model_ready(self, model_name, model_version=""):
        self.ready_asked.append(model_name)
        return self.ready

    async def register_system_shared_memory(self, name, key, byte_size, offset=0):
        self.register_calls.append(name)
        if self.register_error is not None:
            raise self.register_error
        region = mpshm.SharedMemory(key.lstrip("/"))  # what tritonserver maps
        resource_tracker.unregister(region._name, "shared_memory")  # attached, not ours to unlink
        try:
            self.regions[name] = bytes(region.buf[:byte_size])
        finally:
            region.close()
        await asyncio.sleep(0)

    async def unregister_system_shared_memory(self, name=""):
        self.unregister_calls.append(name)
        if self.busy:
            self.busy -= 1
            raise InferenceServerException(
                f"Cannot unregister shared memory region '{name}', it is currently in use.",
                status="StatusCode.INTERNAL")
        self.regions.pop(name, None)

    async def infer(self, model, inputs, outputs=None, client_timeout=None):
        self.infers.append(inputs)
        return None

    def ModelStreamInfer(self, requests, metadata=None):
        self.stream_metadata.append(metadata)
        return self.stream(requests)

    async def close(self):
        self.closed = True


def client_for(server: FakeServer, mode: str = "auto", min_bytes: int = 64 * KIB,
               abort_grace_s: float = 0.2) -> GrpcStageClient:
    client = GrpcStageClient("127.0.0.1:8001", mode, min_bytes, abort_grace_s=abort_grace_s)
    client._client = server
    client._stream_channel = server
    return client


def read(content: bytes, inp, arr: np.ndarray) -> np.ndarray:
    params = inp._get_tensor().parameters
    offset = params["shared_memory_offset"].int64_param
    size = params["shared_memory_byte_size"].int64_param
    assert size == arr.nbytes
    return np.frombuffer(content[offset:offset + size], dtype=arr.dtype).reshape(arr.shape)


def test_a_call_places_large_inputs_in_one_region_and_releases_it():
    server = FakeServer()
    client = client_for(server)

    async def go():
        client._outputs = staticmethod(lambda result, outputs: {})
        await client.infer("llm", {LLM.IMAGE_EMBEDS: EMBEDS, LLM.PROMPT_TOKEN_IDS: IDS}, [])
        [inputs] = server.infers
        embeds, ids = inputs
        region = embeds._get_tensor().parameters["shared_memory_region"].string_param
        assert region.startswith(SHM_PREFIX) and region in server.register_calls
        assert ids._get_content() == IDS.tobytes()  # under the threshold: inline
        assert embeds._get_content() is None
        await client.shm.drain()
        return region

    region = asyncio.run(go())
    assert server.unregister_calls == [region]
    assert server.regions == {} and client.shm.registered == set()


def test_the_server_reads_the_exact_rows_and_the_name_is_gone_from_dev_shm_at_once():
    server = FakeServer()
    client = client_for(server, min_bytes=1)

    async def go():
        inputs, region = await client._place({LLM.IMAGE_EMBEDS: EMBEDS, LLM.PROMPT_TOKEN_IDS: IDS})
        assert leftovers() == []  # unlinked once registered: nothing to leak if we die
        content = server.regions[region]
        assert np.array_equal(read(content, inputs[0], EMBEDS), EMBEDS)
        assert np.array_equal(read(content, inputs[1], IDS), IDS)
        client._release(region)
        await client.shm.drain()

    asyncio.run(go())
    assert server.regions == {}


def test_a_region_still_in_use_is_unregistered_when_the_server_lets_go():
    server = FakeServer(busy=3)
    client = client_for(server)

    async def go():
        _, region = await client._place({LLM.IMAGE_EMBEDS: EMBEDS})
        client._release(region)
        await client.shm.drain()
        return region

    region = asyncio.run(go())
    assert server.unregister_calls == [region] * 4
    assert server.regions == {}


def test_what_is_left_registered_is_unregistered_at_close():
    server = FakeServer(busy=10**6)
    client = client_for(server)
    client.shm.retry_s = 0.05

    async def go():
        _, region = await client._place({LLM.IMAGE_EMBEDS: EMBEDS})
        client._release(region)
        await client.shm.drain()  # gave up: the server still holds it
        assert client.shm.registered == {region}
        server.busy = 0
        await client.close()

    asyncio.run(go())
    assert server.regions == {} and server.closed


def _stream_of(responses, hang: asyncio.Event | None = None):
    class Call:
        def __init__(self, requests):
            self.requests = requests
            self.cancelled = False
            self.left = list(responses)

        async def read(self):
            if not self.left:
                await asyncio.Event().wait()  # never answers
            return self.left.pop(0)

        def cancel(self):
            self.cancelled = True

    return Call


def _response(final: bool, error: str = "") -> service_pb2.ModelStreamInferResponse:
    r = service_pb2.ModelStreamInferResponse(error_message=error)
    r.infer_response.model_name = "llm"
    r.infer_response.parameters["triton_final_response"].bool_param = final
    return r


@pytest.mark.parametrize("how", ["final", "error", "cancel", "timeout"])
def test_a_streamed_call_releases_its_region_however_it_ends(how):
    responses = {"final": [_response(False), _response(True)], "error": [_response(False, "boom")],
                 "cancel": [], "timeout": []}[how]
    server = FakeServer(stream=_stream_of(responses))
    client = client_for(server)

    async def consume():
        async for _ in client.stream("llm", {LLM.IMAGE_EMBEDS: EMBEDS}, [LLM.TEXT_OUTPUT],
                                     request_id="r", timeout_s=0.2 if how == "timeout" else 30):
            pass

    async def go():
        task = asyncio.create_task(consume())
        while not server.register_calls:
            await asyncio.sleep(0.01)
        if how == "cancel":
            await asyncio.sleep(0.05)
            task.cancel()
        try:
            await task
        except (asyncio.CancelledError, StageCallError):
            pass
        await client.drain_stops()  # a cancelled stream is released once it has ended
        await client.shm.drain()

    asyncio.run(go())
    assert len(server.unregister_calls) == 1 and server.regions == {}


def test_auto_falls_back_to_grpc_when_the_server_cannot_open_the_region():
    server = FakeServer(register_error=InferenceServerException(
        "Unable to open shared memory region: '/omni_shm_x'", status="StatusCode.INTERNAL"))
    client = client_for(server, "auto")

    async def go():
        inputs, region = await client._place({LLM.IMAGE_EMBEDS: EMBEDS})
        assert region is None and inputs[0]._get_content() == EMBEDS.tobytes()
        assert client.shm is None  # for good: no second try per call
        await asyncio.sleep(0.05)

    asyncio.run(go())
    assert server.regions == {}


@pytest.mark.parametrize("mode,status,code", [
    ("system", "StatusCode.INTERNAL", "INTERNAL"),
    ("auto", "StatusCode.UNAVAILABLE", "UNAVAILABLE"),  # the server is down, not the memory
])
def test_a_failed_registration_is_an_error_when_shared_memory_was_asked_for(mode, status, code):
    server = FakeServer(register_error=InferenceServerException("no", status=status))
    client = client_for(server, mode)

    async def go():
        with pytest.raises(StageCallError) as err:
            await client._place({LLM.IMAGE_EMBEDS: EMBEDS})
        assert err.value.code == code and "registering system shared memory" in err.value.message
        await client.shm.drain()

    asyncio.run(go())
    assert client.shm is not None


def test_region_names_are_unique_per_process_and_call():
    a, b = ShmRegions(), ShmRegions()
    assert a.prefix != b.prefix and a.prefix.startswith(SHM_PREFIX)


def test_a_region_this_host_cannot_create_sends_that_call_inline(monkeypatch):
    import tritonclient.utils.shared_memory as shm

    def full(*args, **kwargs):
        raise shm.SharedMemoryException("unable to create the shared memory region")

    server = FakeServer()
    client = client_for(server, "auto")
    monkeypatch.setattr(shm, "create_shared_memory_region", full)

    async def go():
        inputs, region = await client._place({LLM.IMAGE_EMBEDS: EMBEDS})
        assert region is None and inputs[0]._get_content() == EMBEDS.tobytes()
        assert client.shm is not None  # only this call: the next one tries again
        client.shm_mode = "system"
        with pytest.raises(StageCallError, match="system shared memory for 127.0.0.1:8001"):
            await client._place({LLM.IMAGE_EMBEDS: EMBEDS})

    asyncio.run(go())
    assert server.register_calls == []


def test_a_cancel_that_lands_as_a_response_arrives_is_not_lost():
    """The consuming task is cancelled in the same loop turn the next read completes.

    Python 3.11's asyncio.wait_for returned the response then and dropped the
    cancel: the orchestrator kept streaming a cancelled thinker to its end.
    """
    from omni_serve.grpc_stream import stream_request

    reads: list[asyncio.Future] = []
    cancelled: list[bool] = []

    class Call:
        def __init__(self, requests):
            self.requests = requests

        def read(self):
            reads.append(asyncio.get_running_loop().create_future())
            return reads[-1]

        def cancel(self):
            cancelled.append(True)

    server = FakeServer(stream=Call)
    got = []

    async def consume():
        async for result in stream_request(server, "llm", {}, [], request_id="r", timeout_s=30):
            got.append(result)

    async def go():
        task = asyncio.create_task(consume())
        for _ in range(3):
            await asyncio.sleep(0)
        reads[-1].set_result(_response(False))  # a response is ready...
        task.cancel()  # ...as the caller cancels
        for _ in range(5):
            await asyncio.sleep(0)
            if len(reads) > 1 and not reads[-1].done():
                reads[-1].set_result(_response(True))  # what a lost cancel would read next
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert cancelled == [True]  # the gRPC call was cancelled, so Triton cancels the request


@pytest.mark.parametrize("responses, ready, code, asked", [
    # Triton 2.51 sends "unknown model" in-band on a stream: a model that is not there
    ([_response(True, "Request for unknown model: 'llm' is not found")], False, "UNAVAILABLE", True),
    # the same in-band error from a model that is there: the request's trouble
    ([_response(True, "boom")], True, "INTERNAL", True),
    # after the model answered: not a question of the model being there
    ([_response(False), _response(True, "boom")], False, "INTERNAL", False),
])
def test_an_in_band_stream_error_is_unavailable_only_when_the_model_is_not_there(
        responses, ready, code, asked):
    server = FakeServer(stream=_stream_of(responses))
    server.ready = ready
    client = client_for(server, "none")

    async def consume():
        async for _ in client.stream("llm", {LLM.TEXT_INPUT: np.array([b"x"], dtype=np.object_)},
                                     [LLM.TEXT_OUTPUT], request_id="r", timeout_s=30):
            pass

    with pytest.raises(StageCallError) as e:
        asyncio.run(consume())
    assert e.value.code == code
    assert server.ready_asked == (["llm"] if asked else [])


@pytest.mark.parametrize("version, metadata", [
    ("2.51.0", None), ("2.53.0", (("triton_grpc_error", "true"),)),
])
def test_stage_streams_carry_the_strict_errors_header_only_where_triton_survives_it(
        version, metadata):
    server = FakeServer(stream=_stream_of([_response(True)]))
    server.version = version
    client = client_for(server, "none")

    async def consume():
        for _ in range(2):
            async for _ in client.stream("llm", {LLM.TEXT_INPUT: np.array([b"x"], np.object_)},
                                         [LLM.TEXT_OUTPUT], request_id="r", timeout_s=30):
                pass

    asyncio.run(consume())
    assert server.stream_metadata == [metadata, metadata]


def test_a_bad_request_answered_in_band_keeps_its_code():
    server = FakeServer(stream=_stream_of(
        [_response(True, "sampling_parameters.max_tokenz: unknown sampling parameter")]))
    client = client_for(server, "none")

    async def consume():
        async for _ in client.stream("llm", {LLM.TEXT_INPUT: np.array([b"x"], np.object_)},
                                     [LLM.TEXT_OUTPUT], request_id="r", timeout_s=30):
            pass

    with pytest.raises(StageCallError) as e:
        asyncio.run(consume())
    assert e.value.code == "INVALID_ARG"


def test_the_orchestrator_never_imports_the_client_sdk():
    code = ("import sys, omni_serve.orchestrator.grpc_client, omni_serve.orchestrator.pipeline, "
            "omni_serve.grpc_stream, omni_serve.tritonio; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'omni_client'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""A stage stub that dies: the registry tells, and the orchestrator's client fails its calls.

Real processes for the registry (a child killed with SIGKILL, left a zombie or
reaped); the gRPC client's watch against a fake registry and a fake Triton client.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from omni_serve import stubs
from omni_serve.orchestrator.grpc_client import GrpcStageClient
from omni_serve.orchestrator.pipeline import StageCallError


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _entry(directory, model, instance, pid):
    path = directory / model / instance
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid} {stubs._start_time(pid)}")
    return path


def test_a_registered_stub_is_alive_until_killed(tmp_path):
    child = _child()
    try:
        _entry(tmp_path, "llm", "llm_0_0", child.pid)
        watch = stubs.StubWatch(tmp_path, ttl_s=0)
        assert watch.dead("llm") == []
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not watch.dead("llm") and time.monotonic() < deadline:  # a zombie until reaped
            time.sleep(0.01)
        assert watch.dead("llm") == [("llm_0_0", child.pid)]
        child.wait()  # reaped: the pid is gone altogether
        assert watch.dead("llm") == [("llm_0_0", child.pid)]
        assert watch.dead("talker") == []  # other models are not affected
    finally:
        child.kill()
        child.wait()


def test_a_reused_pid_is_not_taken_for_the_stub(tmp_path):
    child = _child()
    try:
        entry = _entry(tmp_path, "llm", "llm_0_0", child.pid)
        entry.write_text(f"{child.pid} 1")  # the stub that had this pid started at tick 1
        assert stubs.StubWatch(tmp_path, ttl_s=0).dead("llm") == [("llm_0_0", child.pid)]
    finally:
        child.kill()
        child.wait()


def test_register_names_the_instance_and_a_normal_end_removes_it(tmp_path):
    entry = stubs.register({"model_name": "dit", "model_instance_name": "dit_0_1"}, tmp_path / "s")
    assert entry == tmp_path / "s" / "dit" / "dit_0_1"
    assert entry.read_text().split()[0] == str(os.getpid())
    assert stubs.StubWatch(tmp_path / "s", ttl_s=0).dead("dit") == []
    stubs.unregister(entry)
    assert not entry.exists()


def test_a_reloaded_instance_keeps_its_entry_when_the_old_one_ends(tmp_path):
    entry = _entry(tmp_path, "llm", "llm_0_0", 1)  # the new stub (pid 1) owns it now
    stubs.unregister(entry)  # the old stub, this process, ends
    assert entry.exists()


def test_forget_drops_only_dead_entries(tmp_path):
    child = _child()
    try:
        _entry(tmp_path, "llm", "llm_0_0", child.pid)
        dead = _entry(tmp_path, "llm", "llm_0_1", child.pid)
        dead.write_text(f"{child.pid} 1")
        watch = stubs.StubWatch(tmp_path, ttl_s=0)
        watch.forget("llm")
        assert not dead.exists() and (tmp_path / "llm" / "llm_0_0").exists()
    finally:
        child.kill()
        child.wait()


def test_registries_of_servers_that_are_gone_are_removed(tmp_path):
    child = _child()
    child.kill()
    child.wait()
    gone = tmp_path / f"{stubs.PREFIX}{child.pid}"
    (gone / "llm").mkdir(parents=True)
    mine = tmp_path / f"{stubs.PREFIX}{os.getpid()}"
    stubs.register({"model_name": "llm", "model_instance_name": "llm_0_0"}, mine)
    assert not gone.exists() and mine.exists()


# --- the orchestrator's client ------------------------------------------------------

class FakeWatch:
    def __init__(self):
        self.dead_stubs: list[tuple[str, int]] = []
        self.forgotten: list[str] = []

    def dead(self, model):
        return list(self.dead_stubs) if model == "talker" else []

    def forget(self, model):
        self.forgotten.append(model)
        self.dead_stubs.clear()


class FakeTriton:
    def __init__(self, unload_error=None):
        self.unloaded: list[str] = []
        self.unload_error = unload_error

    async def unload_model(self, model):
        if self.unload_error:
            raise self.unload_error
        self.unloaded.append(model)


def _client(watch) -> GrpcStageClient:
    client = GrpcStageClient("127.0.0.1:1", stubs=watch)
    client._client = FakeTriton()
    return client


def test_a_call_waiting_on_a_stage_whose_stub_died_fails_unavailable():
    async def main():
        watch = FakeWatch()
        client = _client(watch)
        never = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(client.stub_guard.watched("talker", never))
        await asyncio.sleep(0)
        assert not waiting.done()
        watch.dead_stubs.append(("talker_0_0", 4242))
        with pytest.raises(StageCallError) as e:
            await asyncio.wait_for(waiting, 5)
        assert e.value.code == "UNAVAILABLE"
        assert "stage talker is unavailable: its Python stub talker_0_0 (pid 4242) died" in str(e.value)
        deadline = time.monotonic() + 5
        while "talker" in client.stub_guard.taken_down and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert client._client.unloaded == ["talker"] and watch.forgotten == ["talker"]
        assert "talker" not in client.stub_guard.taken_down  # unloaded, then forgotten
    asyncio.run(main())


def test_a_new_call_to_a_dead_stage_fails_before_it_is_sent_and_others_go_on():
    async def main():
        watch = FakeWatch()
        watch.dead_stubs.append(("talker_0_0", 4242))
        client = _client(watch)
        with pytest.raises(StageCallError, match="UNAVAILABLE|unavailable"):
            async for _ in client.stream("talker", {}, [], request_id="r", timeout_s=5):
                pass
        done = asyncio.get_running_loop().create_future()
        done.set_result("ok")
        assert await client.stub_guard.watched("llm", done) == "ok"
        await asyncio.gather(*client.stub_guard.taken_down.values())
    asyncio.run(main())


def test_a_server_without_model_control_keeps_the_dead_stage_down():
    from tritonclient.utils import InferenceServerException

    async def main():
        watch = FakeWatch()
        watch.dead_stubs.append(("talker_0_0", 4242))
        client = _client(watch)
        client._client.unload_error = InferenceServerException("explicit model load / unload "
                                                               "is not allowed")
        with pytest.raises(StageCallError):
            client.stub_guard.check("talker")
        await asyncio.sleep(0.05)
        assert not client.stub_guard.taken_down["talker"].done()  # waits for an operator's restart
        assert watch.forgotten == []
        client.stub_guard.taken_down["talker"].cancel()
    asyncio.run(main())

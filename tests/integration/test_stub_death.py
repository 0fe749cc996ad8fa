"""A stage's Python stub SIGKILLed mid-stream: its requests fail fast, the rest serves on.

Real tritonserver (omni-chat, --model-control-mode=explicit), the talker's stub killed
while it streams a reply's speech, as the OOM killer would. Triton 2.51 never answers
the requests such a stub held and keeps the model ready; the orchestrator reads the
stub registry (omni_serve.stubs), fails them UNAVAILABLE naming the stage, unloads
the model (readiness says so) and serves everything else; a model-control load brings
it back without a server restart.

It runs on the session's omni-chat server and leaves the talker serving again
(servers.restoring), whether it passes or not.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import tritonclient.grpc as grpcclient

from .omni_io import OmniStream, error_code, omni_inputs, run_omni
from .servers import outliving, restoring, stub_of

pytestmark = pytest.mark.integration

VICTIM = "talker"
SPEECH = {"modalities": ["text", "audio"], "seed": 3, "return_codec_ids": True,
          "sampling": {"max_tokens": 200, "temperature": 0, "ignore_eos": True},
          "talker_sampling": {"temperature": 0, "min_tokens": 300, "max_tokens": 300}}
TEXT = {"modalities": ["text"], "sampling": {"max_tokens": 8, "temperature": 0}}


@pytest.fixture
def server(omni_chat_server):
    """The session's omni-chat server, the talker serving again after the test."""
    with restoring(omni_chat_server, VICTIM):
        yield omni_chat_server


def _image(url: str) -> bytes:
    """One image straight from the DiT entry model (another model than the victim)."""
    import numpy as np

    with grpcclient.InferenceServerClient(url) as client:
        x = grpcclient.InferInput("prompt", [1, 1], "BYTES")
        x.set_data_from_numpy(np.array([[b"a red square"]], dtype=object))
        steps = grpcclient.InferInput("num_inference_steps", [1, 1], "INT32")
        steps.set_data_from_numpy(np.array([[2]], dtype=np.int32))
        return bytes(client.infer("text_to_image", [x, steps]).as_numpy("image")[0][0])


def test_a_killed_stub_fails_its_requests_fast_and_a_load_brings_it_back(server):
    url = server.grpc_url
    before = run_omni(url, **SPEECH)
    assert before.error is None, before.error
    # greedy on this checkpoint: the talker speaks long enough for the kill to land mid-speech
    assert len(before.codec_ids) == 300 and len(before.chunks) >= 3, len(before.codec_ids)
    text_before = run_omni(url, **TEXT)

    stream = OmniStream(url)
    try:
        stream.send(omni_inputs(**SPEECH))
        result = stream.collect_until(lambda r: r.codec_ids)  # the talker is speaking
        victim = stub_of(server, VICTIM)
        stub_program = victim.exe()
        engine = victim.children(recursive=True)  # its vLLM engine core (and any worker)
        programs = {p.pid: p.exe() for p in engine
                    if "resource_tracker" not in " ".join(p.cmdline())}
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        result = stream.collect(result, timeout=30)
        failed_after = time.monotonic() - killed_at
    finally:
        stream.close()
    assert result.error is not None, "the request went on after its talker died"
    assert error_code(result.error) == "UNAVAILABLE", result.error
    assert f"stage {VICTIM} is unavailable: its Python stub" in result.error.message()
    assert "'talker'" in result.error.message()  # the orchestrator names the stage
    print(f"the in-flight request failed {failed_after:.2f} s after the kill")
    assert failed_after < 5.0, f"the in-flight request failed {failed_after:.1f} s after the kill"

    # the dead stub's engine processes go with it (they held the talker and its KV cache)
    assert engine, "expected the talker's stub to run vLLM's engine processes"
    # forked from the stub, not spawned (omni_serve/llm/engine_fork.py): the same program
    assert set(programs.values()) == {stub_program}, (programs, stub_program)
    left = outliving(engine)
    assert not left, f"the dead stub's engine processes outlived it: {left}"

    with grpcclient.InferenceServerClient(url) as client:
        deadline = time.monotonic() + 30  # the orchestrator unloads it: readiness says so
        while client.is_model_ready(VICTIM) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not client.is_model_ready(VICTIM), server.log_tail()
        assert client.is_server_live()

        # everything else serves meanwhile: text replies, images, the thinker directly
        text = run_omni(url, **TEXT)
        assert text.error is None and text.text == text_before.text != ""
        assert _image(url)[:8] == b"\x89PNG\r\n\x1a\n"
        speech = run_omni(url, **SPEECH)
        assert error_code(speech.error) == "UNAVAILABLE" and VICTIM in speech.error.message()

        logged = server.log_path.stat().st_size
        client.load_model(VICTIM)  # the operator's way back, no server restart
        assert client.is_model_ready(VICTIM)
    # whose engine loads the model the server's start compiled (omni_serve/llm/aot_cache.py)
    with open(server.log_path, "rb") as log:
        log.seek(logged)
        reload_log = log.read().decode(errors="replace")
    assert "Directly load AOT compilation" in reload_log, reload_log[-4000:]
    assert "Compiling model again" not in reload_log, reload_log[-4000:]
    after = run_omni(url, **SPEECH)
    assert after.error is None, after.error
    assert after.codec_ids == before.codec_ids and after.text == before.text

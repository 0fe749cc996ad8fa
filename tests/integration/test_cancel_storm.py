"""A cancellation storm against the omni-chat server: it lives, and keeps nothing.

Many stock-tritonclient clients at once, each sending one request of a kind the preset
serves (long text, text + speech, text + a generated image, image and audio in, the
`llm` model directly) and cancelling its gRPC stream at a point drawn from a fixed seed:
right after sending (before any response), after the first response, mid-stream, or as
a short reply ends (the cancel races the final response). After the storm the server
process lives, every model is READY, no request is left in the orchestrator or in any
engine, the thinker's hidden-state capture files are all gone, and greedy answers are
the same as before the storm. A reply cancelled before its text ends never reaches the
image generator: its diffusion work is not computed.
"""
from __future__ import annotations

import contextlib
import os
import queue
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import pytest
import tritonclient.grpc as grpcclient

from omni_serve.llm.hidden_states import ENV_DIR

from .llm_io import llm_inputs, metric, wait_idle
from .omni_io import OmniStream, omni_inputs, png, stream_headers, tone, wav

pytestmark = pytest.mark.integration

SEED = 20261202
CLIENTS = 128
AT_ONCE = 12
LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
SHORT = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
GREEDY = {"temperature": 0, "max_tokens": 12}
KINDS = ("text", "speech", "image", "media", "llm")
CANCEL_POINTS = ("at_once", "first", "mid", "racing_the_end")


@dataclass
class Client:
    n: int
    kind: str
    point: str
    wait_for: int  # responses to receive before cancelling


def plan(rng: random.Random) -> list[Client]:
    """Every kind with every cancel point, then random ones, in a shuffled order."""
    clients = [(k, p) for k in KINDS for p in CANCEL_POINTS]
    clients += [(rng.choice(KINDS), rng.choice(CANCEL_POINTS))
                for _ in range(CLIENTS - len(clients))]
    rng.shuffle(clients)
    wait = {"at_once": lambda: 0, "first": lambda: 1, "mid": lambda: rng.randint(2, 30),
            "racing_the_end": lambda: 1}
    return [Client(i, k, p, wait[p]()) for i, (k, p) in enumerate(clients)]


def _inputs(client: Client):
    sampling = SHORT if client.point == "racing_the_end" else LONG
    if client.kind == "llm":
        return "llm", llm_inputs(f"storm {client.n}", stream=True, sampling=sampling)
    kw: dict = {"sampling": sampling}
    if client.kind == "speech":
        kw["modalities"] = ["text", "audio"]
    elif client.kind == "image":
        kw["modalities"] = ["text", "image"]
    elif client.kind == "media":
        kw.update(image=png(seed=client.n), audio=wav(tone(0.5, freq=200 + client.n)))
    return "omni", omni_inputs(f"storm {client.n}: tell me a story", **kw)


def storm_one(url: str, client: Client) -> int:
    """Send, receive `client.wait_for` responses (or fewer if it ends first), cancel.
    Returns how many responses came before the cancel."""
    model, inputs = _inputs(client)
    q: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    got = 0
    try:
        c.start_stream(callback=lambda result, error: q.put((result, error)),
                       headers=stream_headers(c))
        c.async_stream_infer(model, inputs, request_id=f"storm-{client.n}",
                             enable_empty_final_response=True)
        deadline = time.monotonic() + 120
        while got < client.wait_for:
            result, error = q.get(timeout=max(0.1, deadline - time.monotonic()))
            assert error is None, f"{client}: {error}"
            got += 1
            final = result.get_response().parameters.get("triton_final_response")
            if final and final.bool_param:
                break
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    return got


def _capture_dirs(server) -> set[str]:
    """The hidden-state capture directories of the server's LLM stages (named in the
    environment their engine processes start with)."""
    dirs = set()
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if d := p.environ().get(ENV_DIR):
                dirs.add(d)
    assert dirs, "no LLM engine with a capture directory under the server"
    return dirs


def _reference(url: str) -> tuple[str, str, list[int]]:
    from .llm_io import run as run_llm
    from .omni_io import run_omni

    text = run_omni(url, text="what is a storm?", sampling=GREEDY)
    speech = run_omni(url, text="say hello", modalities=["text", "audio"], sampling=GREEDY,
                      return_codec_ids=True, seed=7)  # the talker samples: seeded
    llm = run_llm(url, "the weather today", stream=True, sampling=GREEDY)
    for r in (text, speech, llm):
        assert r.error is None, r.error
    assert speech.codec_ids and llm.text
    return text.text, llm.text, speech.codec_ids


def _wait_empty(directory: str, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := os.listdir(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_a_cancellation_storm_leaves_the_server_serving_and_holding_nothing(omni_chat_server):
    server = omni_chat_server
    url = server.grpc_url
    before = _reference(url)
    clients = plan(random.Random(SEED))
    with ThreadPoolExecutor(AT_ONCE) as pool:
        received = list(pool.map(lambda c: storm_one(url, c), clients))
    assert sum(received) > 0  # the storm did reach the engines

    assert server.proc.poll() is None, f"tritonserver died: {server.log_tail()}"
    with grpcclient.InferenceServerClient(url) as c:
        index = c.get_model_repository_index(as_json=True)["models"]
    assert {m["name"]: m.get("state") for m in index} == {m["name"]: "READY" for m in index}
    idle = wait_idle(server, ("llm", "talker"), ("omni",), timeout=60)
    assert not any(idle.values()), idle
    for directory in _capture_dirs(server):
        left = _wait_empty(directory)
        assert not left, f"capture files left in {directory} after the storm: {left}"
    assert _reference(url) == before


def _inferences(server, model: str) -> float:
    return metric(server.metrics(), "nv_inference_count", model)


def test_an_image_reply_cancelled_mid_text_never_runs_the_image_generator(omni_chat_server):
    server = omni_chat_server
    images_before = _inferences(server, "text_to_image")
    thinker_before = metric(server.metrics(), "omni_llm_generation_tokens_total", "llm")
    stream = OmniStream(server.grpc_url)
    try:
        stream.send(omni_inputs("draw a long story", modalities=["text", "image"],
                                sampling={"temperature": 0, "max_tokens": 1500,
                                          "ignore_eos": True}))
        sent = stream.collect_until(lambda r: len(r.deltas) >= 3)
    finally:
        stream.close(cancel=True)
    idle = wait_idle(server, ("llm",), ("omni",), timeout=30)
    assert not any(idle.values()), idle
    thinker = metric(server.metrics(), "omni_llm_generation_tokens_total", "llm") - thinker_before
    assert thinker < 1500 / 2, f"the thinker was not stopped: {thinker} tokens"
    assert not sent.images
    assert _inferences(server, "text_to_image") == images_before
    # and the same request, not cancelled, does reach it
    result = OmniStream(server.grpc_url)
    try:
        result.send(omni_inputs("draw", modalities=["text", "image"], sampling=GREEDY))
        done = result.collect()
    finally:
        result.close()
    assert done.error is None and done.images and done.images[0][:4] == b"\x89PNG"
    assert _inferences(server, "text_to_image") == images_before + 1


"""Overload: a full stage queue rejects at once, UNAVAILABLE, instead of queueing without bound.

Real tritonserver with a spec of two bounded stages:
- `llm` (omni_llm, max_num_seqs 2, `queue: {max_queue_size: 2}`): the stage takes at
  most 4 requests in flight; the next is rejected "overloaded" naming the bound;
- `dit` (omni_dit, max_batch_size 1, `queue: {max_queue_size: 1}`): Triton's own
  dynamic-batcher queue policy, written into config.pbtxt, rejects the rest.
Each is flooded with concurrent requests; every admitted one completes whole, and a
request after the flood is served.

A server of its own in Triton's default model-control mode as the README starts one
(the session servers run under explicit model control), conftest.default_mode_server:
test_server_lifecycle SIGKILLs it after these tests.
"""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from omni_serve.contract import LLM

from .bounded import LLM_QUEUED, LLM_RUNNING
from .llm_io import llm_inputs
from .omni_io import error_code

pytestmark = pytest.mark.integration

TOKENS = 200


@pytest.fixture(scope="module")
def server(default_mode_server):
    return default_mode_server.get()


def _flood_llm(url: str, n: int) -> tuple[dict[str, int], list[InferenceServerException]]:
    """n streamed requests at once on one stream: (tokens of each request that ended with
    its final response, by id; the errors). Triton 2.51 returns in-band errors without the
    request id, so errors are counted, not placed."""
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    tokens: dict[str, int] = {}
    ended: dict[str, int] = {}
    errors: list[InferenceServerException] = []
    sampling = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        for i in range(n):
            client.async_stream_infer("llm", llm_inputs(f"flood {i}", stream=True,
                                                        sampling=sampling),
                                      request_id=str(i), enable_empty_final_response=True)
        deadline = time.monotonic() + 300
        while len(ended) + len(errors) < n:
            result, error = q.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                errors.append(error)
                continue
            response = result.get_response()
            counted = result.as_numpy(LLM.NUM_OUTPUT_TOKENS)
            if counted is not None:
                tokens[response.id] = tokens.get(response.id, 0) + int(counted[0])
            if response.parameters["triton_final_response"].bool_param:
                assert response.id not in ended, f"request {response.id} ended twice"
                ended[response.id] = tokens.get(response.id, 0)
    finally:
        client.stop_stream()
        client.close()
    return ended, errors


def test_a_flooded_llm_stage_rejects_past_its_queue_bound_and_serves_the_admitted(server):
    n = 16
    admitted, rejected = _flood_llm(server.grpc_url, n)
    assert rejected, f"{n} requests at once all admitted by a stage that takes 4"
    assert len(admitted) + len(rejected) == n
    for error in rejected:
        assert error_code(error) == "UNAVAILABLE", error
        assert ("stage llm is overloaded" in error.message()
                and f"({LLM_RUNNING} running + {LLM_QUEUED} waiting, queue.max_queue_size)"
                in error.message()), error.message()
    assert len(admitted) >= LLM_RUNNING + LLM_QUEUED  # the first four always get in
    # each admitted request is served whole
    assert set(admitted.values()) == {TOKENS}, admitted
    after, errors = _flood_llm(server.grpc_url, 1)
    assert not errors and after == {"0": TOKENS}, (after, errors)


def test_a_flooded_dit_stage_rejects_with_triton_s_queue_policy(server):
    results: queue.Queue = queue.Queue()
    n = 8
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for i in range(n):
            prompt = grpcclient.InferInput("prompt", [1, 1], "BYTES")
            prompt.set_data_from_numpy(np.array([[f"image {i}".encode()]], dtype=object))
            steps = grpcclient.InferInput("num_inference_steps", [1, 1], "INT32")
            steps.set_data_from_numpy(np.array([[40]], dtype=np.int32))
            client.async_infer("dit", [prompt, steps],
                               callback=lambda result, error: results.put((result, error)))
        outcomes = [results.get(timeout=300) for _ in range(n)]
        rejected = [e for _, e in outcomes if e is not None]
        images = [r.as_numpy("image") for r, e in outcomes if e is None]
        assert rejected, f"{n} requests at once all queued by a stage whose queue holds 1"
        for error in rejected:
            assert error_code(error) == "UNAVAILABLE", error
            assert "exceeds maximum queue size" in error.message().lower(), error.message()
        assert images and all(bytes(i[0][0])[:4] == b"\x89PNG" for i in images)
        prompt = grpcclient.InferInput("prompt", [1, 1], "BYTES")
        prompt.set_data_from_numpy(np.array([[b"after"]], dtype=object))
        assert bytes(client.infer("dit", [prompt]).as_numpy("image")[0][0])[:4] == b"\x89PNG"

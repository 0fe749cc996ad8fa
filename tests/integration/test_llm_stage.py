"""The omni_llm stage in a real tritonserver, called with stock tritonclient gRPC/HTTP."""
from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest
from transformers import AutoTokenizer

from omni_tools.tiny_models import ensure_model

from .llm_io import Stream, llm_inputs, metric, run, wait_idle

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def url(text_chat_server):
    return text_chat_server.grpc_url


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_model("qwen2-tiny"))


def test_streaming_deltas_concatenate_to_the_non_streaming_text(url):
    streamed = run(url, PROMPT, stream=True, sampling=GREEDY)
    whole = run(url, PROMPT, stream=False, sampling=GREEDY)
    assert streamed.error is None and whole.error is None
    assert len(streamed.deltas) > 1, "streaming must send several deltas"
    assert len(whole.deltas) == 1, "non-streaming must send one response"
    assert streamed.text == whole.text
    assert len(set(streamed.deltas)) > 1, "greedy output of the tiny model varies"


def test_finish_reason_and_token_counts(url, tokenizer):
    res = run(url, PROMPT, stream=True, sampling=GREEDY)
    assert res.finish_reason == "length"
    assert res.num_output_tokens == GREEDY["max_tokens"]
    assert res.num_input_tokens == len(tokenizer(PROMPT).input_ids)


def test_stop_string_finishes_with_stop(url):
    full = run(url, PROMPT, stream=False, sampling=GREEDY).text
    stop = full.split()[2]
    res = run(url, PROMPT, stream=False, sampling={**GREEDY, "stop": [stop]})
    assert res.finish_reason == "stop"
    assert stop not in res.text
    assert full.startswith(res.text)


def test_non_streaming_includes_the_prompt_unless_excluded(url):
    # vllm_backend semantics: exclude_input_in_output defaults to false.
    with_prompt = run(url, PROMPT, stream=False, sampling=GREEDY, exclude_input=None)
    without = run(url, PROMPT, stream=False, sampling=GREEDY, exclude_input=True)
    assert with_prompt.text == PROMPT + without.text


def test_request_parameters_are_an_alternative_to_the_tensor(url):
    via_tensor = run(url, PROMPT, stream=False, sampling={**GREEDY, "max_tokens": 6})
    via_params = run(url, PROMPT, stream=False, sampling=None,
                     parameters={"temperature": 0, "max_tokens": "6", "ignore_eos": True})
    assert via_params.error is None, via_params.error
    assert via_params.num_output_tokens == 6
    assert via_params.text == via_tensor.text
    # the tensor wins over a request parameter
    both = run(url, PROMPT, stream=False, sampling={**GREEDY, "max_tokens": 3},
               parameters={"max_tokens": 9})
    assert both.num_output_tokens == 3


def test_stream_flag_as_request_parameter(url):
    s = Stream(url)
    try:
        ins = [i for i in llm_inputs(PROMPT, stream=False, sampling=GREEDY) if i.name() != "stream"]
        s.send(ins, parameters={"stream": True})
        assert len(s.collect().deltas) > 1
    finally:
        s.close()


def _running(server) -> float:
    return metric(server.metrics(), "omni_llm_engine_running_requests")


def test_cancellation_mid_stream_aborts_in_the_engine(url, text_chat_server):
    long = {"temperature": 0, "max_tokens": 1800, "ignore_eos": True}
    before = metric(text_chat_server.metrics(), "omni_llm_generation_tokens_total")
    s = Stream(url)
    s.send(llm_inputs("cancel me", stream=True, sampling=long))
    for _ in range(5):
        result, error = s.next(timeout=60)
        assert error is None
    # Usually the gauge shows the request running by now; the gauge is a
    # scrape of vLLM's scheduler stats, so it is not asserted here: what
    # proves the abort is the token count below.
    deadline = time.monotonic() + 10
    while _running(text_chat_server) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    s.close(cancel=True)
    idle = wait_idle(text_chat_server)
    assert not any(idle.values()), idle
    # the engine stopped early: far fewer than max_tokens were generated
    generated = metric(text_chat_server.metrics(), "omni_llm_generation_tokens_total") - before
    assert generated < long["max_tokens"] / 2
    # and the stage still serves
    assert run(url, PROMPT, stream=False, sampling=GREEDY).num_output_tokens == 24


BAD_REQUESTS = {
    "invalid JSON": (dict(sampling='{"max_tokens": 5'), "sampling_parameters: invalid JSON"),
    "not an object": (dict(sampling='[1, 2]'), "sampling_parameters: must be a JSON object"),
    "unknown field": (dict(sampling={"max_tokenz": 5}),
                      "sampling_parameters.max_tokenz: unknown sampling parameter "
                      "(did you mean max_tokens"),
    "wrong type": (dict(sampling={"temperature": "hot"}), "sampling_parameters.temperature:"),
    "negative max_tokens": (dict(sampling={"max_tokens": -1}),
                            "sampling_parameters.max_tokens: max_tokens must be at least 1, got -1"),
    "n too large": (dict(sampling={"n": 5000}), "sampling_parameters.n: must be between 1 and"),
    "prompt too long": (dict(prompt="hello " * 3000),
                        "text_input: This model's maximum context length is 2048 tokens"),
    "empty prompt": (dict(prompt=""), "text_input: must not be empty"),
    "bad flag parameter": (dict(parameters={"stream": "maybe"}), "stream: must be a boolean"),
    "unknown parameter": (dict(parameters={"bogus": 1}), "parameters.bogus: unknown sampling"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_gets_a_clear_error_and_the_next_request_succeeds(url, case):
    kw, expected = BAD_REQUESTS[case]
    res = run(url, kw.get("prompt", PROMPT), stream=None, sampling=kw.get("sampling"),
              parameters=kw.get("parameters"))
    assert res.error is not None, f"{case}: expected an error"
    assert expected in res.error.message(), res.error.message()
    ok = run(url, PROMPT, stream=True, sampling=GREEDY)
    assert ok.error is None and ok.num_output_tokens == 24


def test_wrong_tensor_type_is_rejected_by_name(url):
    res = run(url, np.array([7], dtype=np.int32), stream=False, sampling=GREEDY)
    assert res.error is not None
    assert "input 'text_input' data-type is 'INT32', but model 'llm' expects 'BYTES'" in (
        res.error.message())
    assert run(url, PROMPT, stream=False, sampling=GREEDY).error is None


def test_bad_request_among_concurrent_good_ones(url):
    streams = [Stream(url) for _ in range(4)]
    try:
        for i, s in enumerate(streams):
            sampling = {"max_tokens": -5} if i == 1 else GREEDY
            s.send(llm_inputs(PROMPT, stream=True, sampling=sampling))
        results = [s.collect() for s in streams]
    finally:
        for s in streams:
            s.close()
    assert results[1].error is not None
    good = [r for i, r in enumerate(results) if i != 1]
    assert all(r.error is None and r.num_output_tokens == 24 for r in good)
    assert len({r.text for r in good}) == 1


def test_http_generate_endpoint(text_chat_server):
    body = json.dumps({"text_input": PROMPT, "exclude_input_in_output": True,
                       "parameters": {"temperature": 0, "max_tokens": 24, "ignore_eos": True}})
    req = urllib.request.Request(
        f"http://{text_chat_server.http_url}/v2/models/llm/generate", data=body.encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    assert out["text_output"] == run(text_chat_server.grpc_url, PROMPT, stream=False,
                                     sampling=GREEDY).text


def test_metrics_endpoint_shows_the_stage_metrics(url, text_chat_server):
    m0 = text_chat_server.metrics()
    res = run(url, PROMPT, stream=True, sampling=GREEDY)
    m1 = text_chat_server.metrics()
    delta = lambda name: metric(m1, name) - metric(m0, name)  # noqa: E731
    assert delta("omni_llm_generation_tokens_total") == res.num_output_tokens
    assert delta("omni_llm_prompt_tokens_total") == res.num_input_tokens
    assert delta("omni_llm_time_to_first_token_seconds_count") == 1
    assert delta("omni_llm_time_per_output_token_seconds_count") == 1
    assert 0 < delta("omni_llm_time_to_first_token_seconds_sum") < 5
    # vLLM's stat logger records the queue time just after the request's last step
    queued = lambda m: metric(m, "omni_llm_queue_time_seconds_count")  # noqa: E731
    deadline = time.monotonic() + 5
    while queued(text_chat_server.metrics()) == queued(m0) and time.monotonic() < deadline:
        time.sleep(0.05)
    m2 = text_chat_server.metrics()
    assert queued(m2) - queued(m0) == 1
    waited = metric(m2, "omni_llm_queue_time_seconds_sum") - metric(m0, "omni_llm_queue_time_seconds_sum")
    assert 0 < waited < 5

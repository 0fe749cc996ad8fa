"""omni_client against the text-chat preset in a real tritonserver."""
from __future__ import annotations

import asyncio

import pytest

from omni_client import AsyncOmniClient, BadRequestError, OmniClient, UnavailableError

from .llm_io import run

pytestmark = pytest.mark.integration

PROMPT = "Tell me about the sea"
GREEDY = {"temperature": 0, "ignore_eos": True}


def test_stream_yields_deltas_that_match_the_raw_protocol(text_chat_server):
    url = text_chat_server.grpc_url
    with OmniClient(url) as client:
        deltas = list(client.generate_stream(PROMPT, sampling_parameters=GREEDY, max_tokens=12))
        whole = client.generate(PROMPT, sampling_parameters=GREEDY, max_tokens=12)
    assert len(deltas) > 1
    assert deltas[-1].finish_reason == "length"
    assert sum(d.num_output_tokens for d in deltas) == 12  # each counts the tokens it adds
    assert "".join(d.text for d in deltas) == whole.text
    raw = run(url, PROMPT, stream=False, sampling={**GREEDY, "max_tokens": 12})
    assert whole.text == raw.text
    assert whole.num_output_tokens == 12

    async def with_asyncio():
        async with AsyncOmniClient(url) as client:
            streamed = [d async for d in client.generate_stream(
                PROMPT, sampling_parameters=GREEDY, max_tokens=12)]
            return streamed, await client.generate(PROMPT, sampling_parameters=GREEDY,
                                                   max_tokens=12)

    async_deltas, async_whole = asyncio.run(with_asyncio())
    assert async_whole == whole  # the asyncio client's calls are the same calls
    # (how tokens group into responses depends on timing; the text and the end do not)
    assert "".join(d.text for d in async_deltas) == whole.text
    assert async_deltas[-1].finish_reason == "length"
    assert sum(d.num_output_tokens for d in async_deltas) == 12


def test_bad_request_raises_a_typed_error_and_the_server_keeps_serving(text_chat_server):
    with OmniClient(text_chat_server.grpc_url) as client:
        with pytest.raises(BadRequestError, match="max_tokens must be at least 1"):
            client.generate(PROMPT, max_tokens=-3)
        with pytest.raises(BadRequestError, match="sampling_parameters.temprature"):
            list(client.generate_stream(PROMPT, sampling_parameters={"temprature": 0}))
        assert client.generate(PROMPT, max_tokens=4, sampling_parameters=GREEDY).text
        assert client.is_ready()


def test_breaking_out_of_a_stream_cancels_it(text_chat_server):
    from .llm_io import metric

    with OmniClient(text_chat_server.grpc_url) as client:
        stream = client.generate_stream(PROMPT, max_tokens=1800, sampling_parameters=GREEDY)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        import time

        deadline = time.monotonic() + 15
        while (metric(text_chat_server.metrics(), "omni_llm_engine_running_requests") != 0
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert metric(text_chat_server.metrics(), "omni_llm_engine_running_requests") == 0


def test_unreachable_server_raises_unavailable():
    from omni_tools.server import free_port

    with OmniClient(f"127.0.0.1:{free_port()}", timeout=5) as client:
        assert not client.is_ready()
        with pytest.raises(UnavailableError):
            client.generate(PROMPT, max_tokens=2)

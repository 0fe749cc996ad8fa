"""Session-scoped real tritonserver for the integration tests.

One server per preset per test session (a vLLM engine takes ~20 s to
start); free ports; always stopped, logs kept under the pytest tmp dir.
Each runs under explicit model control with every model loaded at start
(`--load-model=*` serves what Triton's default mode serves), so the tests
that need model control share them instead of starting their own: a test
that breaks a model loads it again before the next one runs
(servers.restoring), a module that brings its own models loads them for
its tests and unloads them after (servers.loaded).
"""
from __future__ import annotations

import os

import pytest

from omni_tools.server import TritonServer

from .servers import gen_repo

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


EXPLICIT = ("--model-control-mode=explicit", "--load-model=*")


@pytest.fixture(scope="session")
def _stopped_together():
    """The session servers, stopped at once: each is sent SIGTERM at its own teardown
    and waited for here, torn down after all of them (each takes seconds to unload)."""
    servers: list[TritonServer] = []
    yield servers
    for server in servers:
        server.stop()
        print(f"\ntritonserver log: {server.log_path}")


def _session_server(preset: str, tmp_path_factory, stopped_together: list[TritonServer]):
    root = tmp_path_factory.mktemp(preset)
    # The user's path: the venv's console script, then the venv's tritonserver.
    repo = gen_repo(["--preset", preset], root / "repo")
    server = TritonServer(repo, log_path=root / "tritonserver.log", extra_args=list(EXPLICIT))
    stopped_together.append(server)
    server.start(timeout=300.0)
    yield server
    server.terminate()


@pytest.fixture(scope="session")
def text_chat_server(tmp_path_factory, _stopped_together):
    yield from _session_server("text-chat", tmp_path_factory, _stopped_together)


@pytest.fixture(scope="session")
def text_to_image_server(tmp_path_factory, _stopped_together):
    yield from _session_server("text-to-image", tmp_path_factory, _stopped_together)


@pytest.fixture(scope="session")
def omni_chat_server(tmp_path_factory, _stopped_together):
    yield from _session_server("omni-chat", tmp_path_factory, _stopped_together)


@pytest.fixture(scope="session")
def openai_frontend(omni_chat_server, tmp_path_factory):
    """`omni-openai` in front of the omni-chat server; yields its base URL."""
    from omni_tools.server import OpenAIFrontend

    log = tmp_path_factory.mktemp("omni-openai") / "omni-openai.log"
    with OpenAIFrontend(omni_chat_server.grpc_url, log_path=log) as frontend:
        yield frontend.base_url

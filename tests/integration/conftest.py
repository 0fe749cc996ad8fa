"""Session-scoped real tritonserver for the integration tests.

One server per preset per test session (a vLLM engine takes ~20 s to
start); free ports; always stopped, logs kept under the pytest tmp dir.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_tools.server import TritonServer

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _serve(preset: str, tmp_path_factory) -> TritonServer:
    root = tmp_path_factory.mktemp(preset)
    repo = root / "repo"
    # The user's path: the venv's console script, then the venv's tritonserver.
    cli = Path(sys.prefix) / "bin" / "omni-gen-repo"
    subprocess.run([str(cli), "--preset", preset, "-o", str(repo)], check=True, timeout=600)
    return TritonServer(repo, log_path=root / "tritonserver.log")


def _session_server(preset: str, tmp_path_factory):
    server = _serve(preset, tmp_path_factory)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        print(f"\ntritonserver log: {server.log_path}")


@pytest.fixture(scope="session")
def text_chat_server(tmp_path_factory):
    yield from _session_server("text-chat", tmp_path_factory)


@pytest.fixture(scope="session")
def text_to_image_server(tmp_path_factory):
    yield from _session_server("text-to-image", tmp_path_factory)


@pytest.fixture(scope="session")
def omni_chat_server(tmp_path_factory):
    yield from _session_server("omni-chat", tmp_path_factory)


@pytest.fixture(scope="session")
def openai_frontend(omni_chat_server, tmp_path_factory):
    """`omni-openai` in front of the omni-chat server; yields its base URL."""
    from omni_tools.server import OpenAIFrontend

    log = tmp_path_factory.mktemp("omni-openai") / "omni-openai.log"
    with OpenAIFrontend(omni_chat_server.grpc_url, log_path=log) as frontend:
        yield frontend.base_url

"""Session-scoped real tritonserver for the integration tests.

One server per preset per test session (a vLLM engine takes ~20 s to
start), those the run's tests use all started at once when the first is
needed; free ports; always stopped, logs kept under the pytest tmp dir.
Each runs under explicit model control with every model loaded at start
(`--load-model=*` serves what Triton's default mode serves), so the tests
that need model control share them instead of starting their own: a test
that breaks a model loads it again before the next one runs
(servers.restoring), a module that brings its own models loads them for
its tests and unloads them after (servers.loaded).
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from omni_tools.server import TritonServer

from .servers import gen_repo

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


EXPLICIT = ("--model-control-mode=explicit", "--load-model=*")


# the session servers started so far (any that is running gets SIGTERM when the
# integration tests are done, so they stop while the unit tests run)
_STARTED: list[TritonServer] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # after the item's own teardown (its module's fixtures may still use a server)
    if nextitem is None or nextitem.path.parent != item.path.parent:
        for server in _STARTED:
            server.terminate()  # waited for when the session ends (_session_servers)


# the session servers: fixture -> the preset it serves
SESSION_SERVERS = {"text_chat_server": "text-chat", "text_to_image_server": "text-to-image",
                   "omni_chat_server": "omni-chat"}


@pytest.fixture(scope="session")
def _session_servers(request, tmp_path_factory):
    """Starts of the session servers by preset: those this run's tests name all begin at
    once when the first is needed, one asked for otherwise (getfixturevalue) when it is;
    all are stopped at once at the end. A start is mostly one process at a time importing
    vLLM and torch: the three side by side took 66-70 s on the 2-core machine, one after
    another 85 s; stopping is seconds of unloading per server."""
    servers: dict[str, TritonServer] = {}
    started: dict[str, Future] = {}

    def start(preset: str, root) -> TritonServer:
        # The user's path: the venv's console script, then the venv's tritonserver.
        repo = gen_repo(["--preset", preset], root / "repo")
        servers[preset] = TritonServer(repo, log_path=root / "tritonserver.log",
                                       extra_args=list(EXPLICIT))
        _STARTED.append(servers[preset])
        return servers[preset].start(timeout=300.0)

    def submit(preset: str) -> None:
        # the folder here, not in the thread: tmp_path_factory is not thread-safe (two
        # threads making the session's first folder make two base folders, and each
        # new one deletes all but the newest three)
        started[preset] = pool.submit(start, preset, tmp_path_factory.mktemp(preset))

    def get(preset: str) -> TritonServer:
        if preset not in started:
            submit(preset)
        return started[preset].result()

    with ThreadPoolExecutor(len(SESSION_SERVERS)) as pool:
        for fixture, preset in SESSION_SERVERS.items():
            if any(fixture in item.fixturenames for item in request.session.items):
                submit(preset)
        try:
            yield get
        finally:
            for future in started.values():  # those still starting end first
                future.exception()
            for server in servers.values():
                server.terminate()
            for server in servers.values():
                server.stop()
                print(f"\ntritonserver log: {server.log_path}")


@pytest.fixture(scope="session")
def text_chat_server(_session_servers):
    return _session_servers("text-chat")


@pytest.fixture(scope="session")
def text_to_image_server(_session_servers):
    return _session_servers("text-to-image")


@pytest.fixture(scope="session")
def omni_chat_server(_session_servers):
    return _session_servers("omni-chat")


class DefaultModeServer:
    """The overload spec's server in Triton's default model-control mode, as the README
    starts one (a vLLM engine, a DiT): test_overload floods it, then test_server_lifecycle
    SIGKILLs it; `get()` starts it again for whoever comes after a kill."""

    def __init__(self, root):
        self.root, self.server = root, None

    def get(self) -> TritonServer:
        if self.server is None or self.server.proc.poll() is not None:
            import yaml

            from .bounded import SPEC

            run = self.root / f"run{len(list(self.root.glob('run*')))}"
            run.mkdir()
            (run / "bounded.yaml").write_text(yaml.safe_dump(SPEC))
            self.server = TritonServer(gen_repo([run / "bounded.yaml"], run / "repo"),
                                       log_path=run / "tritonserver.log").start()
        return self.server


@pytest.fixture(scope="session")
def default_mode_server(tmp_path_factory):
    holder = DefaultModeServer(tmp_path_factory.mktemp("default-mode"))
    try:
        yield holder
    finally:
        if holder.server is not None:
            holder.server.stop()
            print(f"\ntritonserver log: {holder.server.log_path}")


@pytest.fixture(scope="session")
def openai_frontend(omni_chat_server, tmp_path_factory):
    """`omni-openai` in front of the omni-chat server; yields its base URL."""
    from omni_tools.server import OpenAIFrontend

    log = tmp_path_factory.mktemp("omni-openai") / "omni-openai.log"
    with OpenAIFrontend(omni_chat_server.grpc_url, log_path=log) as frontend:
        yield frontend.base_url

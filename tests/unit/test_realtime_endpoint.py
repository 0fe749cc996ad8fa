"""The /v1/realtime socket (no Triton): a stand-in frontend behind a real FastAPI WebSocket,
driven by Starlette's test client: the session limit, an unknown model, the idle and session
time limits, a response over the socket and a socket closed mid-answer."""
from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from starlette.websockets import WebSocketDisconnect

from omni_client import ModelInfo
from omni_client.openai_server import protocol as p
from omni_client.openai_server.realtime import RealtimeHub, RealtimeMetrics, RealtimeSettings, serve

from .test_realtime_session import SERVER_EVENT, Pipeline, user_text


class Front:
    def __init__(self, pipeline: Pipeline):
        self.client = type("Client", (), {"stream": pipeline})()

    async def model(self, name, kinds, param="model"):
        if name != "omni":
            raise p.OpenAIError(404, f"the model {name!r} does not exist; available: ['omni']",
                                param=param, code="model_not_found")
        return ModelInfo("omni", "omni", "omni_orchestrator")


def app(pipeline: Pipeline | None = None, **settings) -> tuple[TestClient, CollectorRegistry]:
    registry = CollectorRegistry()
    hub = RealtimeHub(RealtimeSettings(**settings), RealtimeMetrics(registry))
    front = Front(pipeline or Pipeline())
    api = FastAPI()

    @api.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket, model: str | None = None):
        await serve(websocket, hub, front, model)

    return TestClient(api), registry


def recv(ws) -> dict:
    event = ws.receive_json()
    SERVER_EVENT.validate_python(event)
    return event


def closed_code(ws) -> int:
    with pytest.raises(WebSocketDisconnect) as closed:
        ws.receive_json()
    return closed.value.code


def test_a_response_over_the_socket_and_the_session_gauge():
    client, registry = app()
    with client.websocket_connect("/v1/realtime?model=omni") as ws:
        assert recv(ws)["type"] == "session.created"
        assert registry.get_sample_value("omni_openai_realtime_sessions", {"model": "omni"}) == 1
        ws.send_text(json.dumps(user_text("hi")))
        ws.send_text(json.dumps({"type": "response.create"}))
        kinds = []
        while not kinds or kinds[-1] != "response.done":
            kinds.append(recv(ws)["type"])
        assert kinds.count("response.output_audio.delta") == 2
    assert registry.get_sample_value("omni_openai_realtime_sessions", {"model": "omni"}) == 0


def test_a_session_over_the_limit_is_refused_and_closed():
    client, _ = app(max_sessions=1)
    with client.websocket_connect("/v1/realtime?model=omni") as first:
        assert recv(first)["type"] == "session.created"
        with client.websocket_connect("/v1/realtime?model=omni") as second:
            error = recv(second)
            assert error["error"]["code"] == "session_limit_reached"
            assert closed_code(second) == 1013
    with client.websocket_connect("/v1/realtime?model=omni") as third:  # the slot is free again
        assert recv(third)["type"] == "session.created"


def test_an_unknown_model_is_an_error_then_the_socket_closes():
    client, _ = app()
    with client.websocket_connect("/v1/realtime?model=nope") as ws:
        error = recv(ws)["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        assert closed_code(ws) == 1008


@pytest.mark.parametrize("limit, code", [({"idle_timeout_s": 0.2}, "idle_timeout"),
                                         ({"max_session_s": 0.2}, "session_expired")])
def test_a_session_past_its_time_is_told_and_closed(limit, code):
    client, _ = app(**limit)
    with client.websocket_connect("/v1/realtime?model=omni") as ws:
        assert recv(ws)["type"] == "session.created"
        assert recv(ws)["error"]["code"] == code
        assert closed_code(ws) == 1000


def test_a_running_response_is_not_idleness():
    pipeline = Pipeline(["hang"])
    client, registry = app(pipeline, idle_timeout_s=0.3, max_session_s=1.5)
    with client.websocket_connect("/v1/realtime?model=omni") as ws:
        recv(ws)
        ws.send_text(json.dumps(user_text("hi")))
        ws.send_text(json.dumps({"type": "response.create"}))
        events = []
        while not events or events[-1]["type"] != "error":
            events.append(recv(ws))
        # the idle limit never fired while the answer ran; the session limit ended it
        assert events[-1]["error"]["code"] == "session_expired"
        done = [e for e in events if e["type"] == "response.done"]
        assert done == []
    assert pipeline.closed == 1  # the session's end cancelled the answer
    assert registry.get_sample_value("omni_openai_realtime_interruptions_total",
                                     {"reason": "disconnected"}) == 1

"""Replicas of a stage server behind one name: the URL forms, balancing, affinity, failover,
re-resolution (omni_serve.orchestrator.replicas, locality.parse_target), without a server."""
from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.grpc_client import GrpcStageClient
from omni_serve.orchestrator.locality import (
    RemoteEndpoint,
    ReplicaTarget,
    parse_target,
    remote_endpoints,
    resolve,
)
from omni_serve.orchestrator.pipeline import StageCallError
from omni_serve.orchestrator.replicas import REFRESH_AFTER_FAILURE_S, ReplicatedStageClient
from omni_serve.orchestrator.routing import SESSION_ID, EngineRouter, pick
from omni_serve.orchestrator.stage_clients import RoutingStageClient, stage_client

A, B, C = "10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"


# --- the URL forms ----------------------------------------------------------------------

@pytest.mark.parametrize("url, expected", [
    ("127.0.0.1:8001", None),
    ("engine:8001", None),
    ("dns:///engine.ns.svc:8001", ReplicaTarget("dns:///engine.ns.svc:8001",
                                                 dns=("engine.ns.svc", 8001))),
    ("dns:engine:8001", ReplicaTarget("dns:engine:8001", dns=("engine", 8001))),
    ("ipv4:127.0.0.2:5,127.0.0.3:6", ReplicaTarget("ipv4:127.0.0.2:5,127.0.0.3:6",
                                                   addresses=("127.0.0.2:5", "127.0.0.3:6"))),
    ("ipv6:[::1]:5,[::2]:5", ReplicaTarget("ipv6:[::1]:5,[::2]:5",
                                           addresses=("[::1]:5", "[::2]:5"))),
    ("a:1, b:2", ReplicaTarget("a:1, b:2", addresses=("a:1", "b:2"))),
])
def test_a_url_names_one_server_or_its_replicas(url, expected):
    assert parse_target(url) == expected


@pytest.mark.parametrize("url, message", [
    ("dns://8.8.8.8/engine:8001", "a DNS server of its own"),
    ("dns:///engine", "write host:port"),
    ("ipv4:engine:1,127.0.0.1:2", "not an IP address"),
    ("ipv4:[::1]:1", "not IPv4"),
    ("a:1,b", "list entry 'b': write host:port"),
    ("a:1,a:1", "listed twice"),
    ("::1:5,a:1", "IPv6 address in brackets"),
])
def test_a_malformed_url_says_what_to_write(url, message):
    with pytest.raises(ValueError, match=message):
        parse_target(url)


def test_a_bad_url_is_refused_at_load_naming_its_variable(monkeypatch):
    cfg = OrchestratorConfig(stages={"thinker": "llm"},
                             remote={"llm": {"server": "engine", "url": "engine:8001"}})
    monkeypatch.setenv("OMNI_SERVER_ENGINE_URL", "dns:///engine")
    with pytest.raises(ValueError, match=r"OMNI_SERVER_ENGINE_URL='dns:///engine': dns: name"):
        remote_endpoints(cfg)
    monkeypatch.delenv("OMNI_SERVER_ENGINE_URL")
    cfg = OrchestratorConfig(stages={"thinker": "llm"},
                             remote={"llm": {"server": "engine", "url": "a:1,a:1"}})
    with pytest.raises(ValueError, match=r"servers.engine.grpc_url='a:1,a:1'"):
        remote_endpoints(cfg)


def test_a_dns_name_resolves_through_the_systems_resolver():
    port = 8001
    expected = sorted({f"{i[4][0]}:{port}" if ":" not in i[4][0] else f"[{i[4][0]}]:{port}"
                       for i in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)})
    found = asyncio.run(resolve(parse_target("dns:///localhost:8001")))
    assert list(found) == expected and "127.0.0.1:8001" in found
    with pytest.raises(OSError):
        asyncio.run(resolve(parse_target("dns:///no-such-host.invalid:8001")))


def test_stage_client_makes_a_replicated_client_per_server_url():
    client = stage_client("127.0.0.1:1", {
        "llm": RemoteEndpoint("127.0.0.2:7,127.0.0.3:7", "auto"),
        "talker": RemoteEndpoint("127.0.0.2:7,127.0.0.3:7", "auto"),
        "dec": "dns:///engine:8001", "enc": "127.0.0.4:9"})
    assert isinstance(client, RoutingStageClient)
    assert isinstance(client.remote["llm"], ReplicatedStageClient)
    assert client.remote["llm"] is client.remote["talker"]
    assert client.remote["llm"].target.addresses == ("127.0.0.2:7", "127.0.0.3:7")
    assert client.remote["dec"].target.dns == ("engine", 8001)
    assert isinstance(client.remote["enc"], GrpcStageClient)
    # each replica's own client decides shared memory by its own address
    replica = client.remote["llm"]._make("127.0.0.2:7")
    assert replica.url == "127.0.0.2:7" and replica.shm is not None


# --- the router's replica set ------------------------------------------------------------

def test_the_router_takes_a_new_replica_set_and_counts_calls_on_one_gone():
    router = EngineRouter((A, B))
    router.mark_down(B)
    with router.route(None) as first:
        assert first == A
        router.replace((B, C))
        assert router.in_flight == {A: 1, B: 0, C: 0}  # A's call still counts
        assert router.is_down(B)  # still listed: still passed over
        assert router.pick(None) == C
        router.mark_down(C)
        router.replace((A, B))  # C gone and back: it comes back without its mark
        router.replace((A, B, C))
        assert not router.is_down(C)
    assert router.in_flight == {A: 0, B: 0, C: 0}


# --- a fake replica set ---------------------------------------------------------------------

class Replica:
    """One replica's stand-in GrpcStageClient: streams `tokens` responses, each when `step`
    lets it; `down` fails calls before answering, `die_after` after that many responses."""

    def __init__(self, address: str):
        self.address = address
        self.url = address
        self.down = False
        self.full = False
        self.die_after: int | None = None
        self.error_code: str | None = None  # a request's own error, e.g. INVALID_ARG
        self.tokens = 3
        self.step: asyncio.Event | None = None
        self.calls: list[str] = []
        self.closed = False

    def _check(self):
        if self.down:
            raise StageCallError("UNAVAILABLE", "failed to connect to all addresses")
        if self.full:
            raise StageCallError("UNAVAILABLE", "llm is overloaded: 8 requests waiting")
        if self.error_code:
            raise StageCallError(self.error_code, "sampling_parameters: max_tokens must be >= 1")

    async def stream(self, model, inputs, outputs, *, request_id, timeout_s, unread=None):
        self.calls.append(request_id)
        self._check()
        for i in range(self.tokens):
            if self.step is not None:
                await self.step.wait()
            if self.die_after is not None and i >= self.die_after:
                raise StageCallError("UNAVAILABLE", "Socket closed")
            yield {"i": np.array([i]), "replica": self.address}

    async def infer(self, model, inputs, outputs):
        self.calls.append(model)
        self._check()
        return {"replica": self.address}

    async def unready(self, model):
        return f"{self.address} did not answer within 5 s" if self.down else None

    async def close(self):
        self.closed = True


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _client(addresses=(A, B), *, resolver=None, **kwargs):
    made: dict[str, Replica] = {}

    def make(address: str) -> Replica:
        made[address] = Replica(address)
        return made[address]

    clock = Clock()
    target = ReplicaTarget(",".join(addresses), addresses=tuple(addresses))
    client = ReplicatedStageClient(target, make, clock=clock, retry_after_s=10.0,
                                   **({"resolver": resolver} if resolver else {}), **kwargs)
    return client, made, clock


async def _collect(client, request_id="r", session=None) -> list[dict]:
    SESSION_ID.set(session)
    return [out async for out in client.stream("llm", {}, ["i"], request_id=request_id,
                                               timeout_s=5)]


# --- balancing and affinity ---------------------------------------------------------------

def test_concurrent_streams_spread_over_the_replicas_by_calls_in_flight():
    async def main():
        client, made, _ = _client((A, B, C))
        await client.replicas()
        gate = asyncio.Event()
        for r in made.values():
            r.step = gate
        tasks = [asyncio.create_task(_collect(client, f"r{i}")) for i in range(6)]
        while sum(len(r.calls) for r in made.values()) < 6:
            await asyncio.sleep(0)
        in_flight = dict(client.router.in_flight)
        gate.set()
        results = await asyncio.gather(*tasks)
        return made, in_flight, results, client.router.in_flight

    made, in_flight, results, after = asyncio.run(main())
    assert in_flight == {A: 2, B: 2, C: 2}
    assert {len(r.calls) for r in made.values()} == {2}
    assert all([o["i"][0] for o in out] == [0, 1, 2] for out in results)
    assert after == {A: 0, B: 0, C: 0}


def test_a_session_stays_on_the_replica_rendezvous_hashing_picks():
    async def main():
        client, made, _ = _client((A, B, C))
        seen = {}
        for session in (f"conversation-{i}" for i in range(12)):
            for turn in range(3):
                out = await _collect(client, f"{session}-{turn}", session)
                seen.setdefault(session, set()).add(out[0]["replica"])
        return seen

    seen = asyncio.run(main())
    assert all(replicas == {pick(s, (A, B, C))} for s, replicas in seen.items())
    assert len({r for rs in seen.values() for r in rs}) > 1  # the sessions spread too


def test_unary_calls_go_to_the_least_busy_replica():
    async def main():
        client, made, _ = _client((A, B))
        return [(await client.infer("enc", {}, ["x"]))["replica"] for _ in range(4)]

    assert sorted(asyncio.run(main())) == [A, A, B, B]


# --- failures -------------------------------------------------------------------------------

def test_a_replica_that_does_not_answer_is_passed_over_and_tried_again_later():
    async def main():
        client, made, clock = _client((A, B))
        await client.replicas()
        session = next(f"s{i}" for i in range(100) if pick(f"s{i}", (A, B)) == A)
        made[A].down = True
        first = await _collect(client, "r1", session)  # A fails before answering: B serves
        assert [o["replica"] for o in first] == [B] * 3
        assert made[A].calls == ["r1"] and client.router.is_down(A)
        second = await _collect(client, "r2", session)  # A is passed over, not asked
        assert made[A].calls == ["r1"] and second[0]["replica"] == B
        made[A].down = False
        clock.now += 10.0  # retry_after_s
        third = await _collect(client, "r3", session)  # back on its own replica
        return third[0]["replica"], client.router.is_down(A)

    assert asyncio.run(main()) == (A, False)


def test_a_full_replica_is_skipped_without_being_marked_down():
    async def main():
        client, made, _ = _client((A, B))
        await client.replicas()
        made[A].full = True
        outs = [await _collect(client, f"r{i}") for i in range(2)]
        return outs, client.router.is_down(A), made[A].calls

    outs, down, calls = asyncio.run(main())
    assert all(out[0]["replica"] == B for out in outs)
    assert not down and len(calls) >= 1


def test_a_replica_lost_mid_stream_fails_the_call_unavailable_naming_it():
    async def main():
        client, made, _ = _client((A, B))
        await client.replicas()
        made[A].die_after = made[B].die_after = 1
        got = []
        with pytest.raises(StageCallError) as info:
            async for out in client.stream("llm", {}, ["i"], request_id="r", timeout_s=5):
                got.append(out)
        return got, info.value, made

    got, error, made = asyncio.run(main())
    assert len(got) == 1  # it had answered: not sent again elsewhere
    address = got[0]["replica"]
    assert error.code == "UNAVAILABLE"
    assert error.message == f"replica {address} of {A},{B} is unavailable: Socket closed"
    assert sum(len(r.calls) for r in made.values()) == 1


def test_every_replica_down_is_unavailable_naming_the_last_one_tried():
    async def main():
        client, made, _ = _client((A, B))
        await client.replicas()
        made[A].down = made[B].down = True
        with pytest.raises(StageCallError) as info:
            await client.infer("enc", {}, ["x"])
        return info.value, made

    error, made = asyncio.run(main())
    assert error.code == "UNAVAILABLE"
    assert error.message.startswith("replica ") and "failed to connect" in error.message
    assert made[A].calls == ["enc"] and made[B].calls == ["enc"]


def test_a_requests_own_error_is_not_retried_and_keeps_its_message():
    async def main():
        client, made, _ = _client((A, B))
        await client.replicas()
        for r in made.values():
            r.error_code = "INVALID_ARG"
        with pytest.raises(StageCallError) as info:
            await _collect(client)
        return info.value, made

    error, made = asyncio.run(main())
    assert error.code == "INVALID_ARG"
    assert error.message == "sampling_parameters: max_tokens must be >= 1"
    assert sum(len(r.calls) for r in made.values()) == 1


# --- resolving a name anew ----------------------------------------------------------------

def test_a_dns_name_is_resolved_again_and_replicas_come_and_go():
    answers = [(A, B), (B, C)]
    asked = []

    async def resolver(target):
        asked.append(target.dns)
        return answers[min(len(asked), len(answers)) - 1]

    async def main():
        made: dict[str, Replica] = {}

        def make(address):
            made[address] = Replica(address)
            return made[address]

        clock = Clock()
        client = ReplicatedStageClient(parse_target("dns:///engine:8001"), make, clock=clock,
                                       refresh_s=30.0, resolver=resolver)
        first = await client.replicas()
        clock.now += 29.0
        await client.replicas()
        assert len(asked) == 1  # not yet
        clock.now += 1.0
        await client.replicas()  # due: resolved in the background, the call goes on
        await client._resolving
        await asyncio.sleep(0)  # A's client closes in a task of its own
        await asyncio.gather(*client._closing)
        return first, client.router.engines, made, asked

    first, now, made, asked = asyncio.run(main())
    assert first == (A, B) and now == (B, C)
    assert asked == [("engine", 8001)] * 2
    assert made[A].closed and not made[B].closed and not made[C].closed


def test_a_failure_asks_for_a_resolution_soon_and_a_failed_one_keeps_the_replicas():
    calls = []

    async def resolver(target):
        calls.append(1)
        if len(calls) > 1:
            raise socket.gaierror(-2, "Name or service not known")
        return (A, B)

    async def main():
        made: dict[str, Replica] = {}

        def make(address):
            made[address] = Replica(address)
            return made[address]

        clock = Clock()
        client = ReplicatedStageClient(parse_target("dns:///engine:8001"), make, clock=clock,
                                       resolver=resolver)
        await client.replicas()
        made[A].down = True
        SESSION_ID.set(next(f"s{i}" for i in range(100) if pick(f"s{i}", (A, B)) == A))
        await _collect(client, "r1", SESSION_ID.get())
        clock.now += REFRESH_AFTER_FAILURE_S
        await client.replicas()
        await client._resolving
        return len(calls), client.router.engines

    assert asyncio.run(main()) == (2, (A, B))


def test_a_name_that_never_resolved_is_unavailable():
    async def resolver(target):
        raise socket.gaierror(-2, "Name or service not known")

    async def main():
        client = ReplicatedStageClient(parse_target("dns:///engine:8001"), Replica,
                                       resolver=resolver)
        with pytest.raises(StageCallError) as info:
            await _collect(client)
        return info.value, await client.unready("llm")

    error, unready = asyncio.run(main())
    assert error.code == "UNAVAILABLE"
    assert "dns:///engine:8001 is unavailable: its name does not resolve" in error.message
    assert "does not resolve" in unready


def test_readiness_needs_one_ready_replica_per_remote_stage():
    async def main():
        client, made, _ = _client((A, B))
        router = RoutingStageClient(local=None, remote={"llm": client})
        ready = await router.remote_unready()
        made[A].down = True
        one_down = await router.remote_unready()
        made[B].down = True
        return ready, one_down, await router.remote_unready()

    ready, one_down, none = asyncio.run(main())
    assert ready == {} and one_down == {}
    assert list(none) == ["llm"] and A in none["llm"] and B in none["llm"]


# --- the spec ---------------------------------------------------------------------------------

def test_a_spec_names_replicas_in_grpc_url_and_a_malformed_one_is_refused(tmp_path):
    from omni_tools.spec import SpecError, parse_spec

    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text("{}")

    def spec(url: str) -> dict:
        return {"pipeline": "replicas", "entry": "omni",
                "servers": {"front": {}, "engine": {"grpc_url": url}},
                "stages": {"llm": {"backend": "omni_llm", "model": str(lm), "server": "engine"},
                           "omni": {"backend": "omni_orchestrator", "server": "front",
                                    "engine_args": {"stages": {"thinker": "llm"}}}}}

    for url in ("dns:///engine:8001", "ipv4:10.0.0.1:8001,10.0.0.2:8001", "a:1,b:1"):
        assert parse_spec(spec(url), base_dir=tmp_path).servers["engine"].grpc_url == url
    with pytest.raises(SpecError, match=r"servers.engine.grpc_url: dns: name 'engine': write "
                                        r"host:port"):
        parse_spec(spec("dns:///engine"), base_dir=tmp_path)

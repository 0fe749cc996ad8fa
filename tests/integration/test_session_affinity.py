"""Two thinker engines behind one orchestrator: session affinity, prefix-cache locality, failover.

One tritonserver, the session's text-chat one (explicit model control), into
which this module loads `llm_a` and `llm_b` (the tiny thinker LM on vLLM, one
core each) and an orchestrator `omni` whose thinker role is [llm_a, llm_b],
and from which it unloads them after its tests (servers.loaded). A multi-turn
session (each turn carries the earlier turns in `history`) stays on the
engine rendezvous hashing picks for its session id, and that engine's
prefix-cache hit rate (omni_llm_prefix_cache_hits_total /
omni_llm_prefix_cache_queries_total) rises turn over turn. When an engine is
gone, its sessions move to the other one, and come back once it is loaded
again.
"""
from __future__ import annotations

import threading
import time

import pytest
import tritonclient.grpc as grpcclient
import yaml

from omni_serve.orchestrator.routing import pick

from .llm_io import metric
from .omni_io import OmniStream, error_code, omni_inputs, run_omni
from .servers import gen_repo, loaded

pytestmark = pytest.mark.integration

ENGINES = ("llm_a", "llm_b")
REPLY_TOKENS = 8
SAMPLING = {"temperature": 0, "max_tokens": REPLY_TOKENS, "ignore_eos": True}
# vLLM caches whole KV blocks only; the CPU default is 128 tokens, which at these tiny
# prompt lengths would hide the hits. 32 shows them turn by turn (16 fails on CPU).
BLOCK_SIZE = 32
QUERIES = "omni_llm_prefix_cache_queries_total"
HITS = "omni_llm_prefix_cache_hits_total"
GENERATED = "omni_llm_generation_tokens_total"
FAILOVERS = "omni_thinker_failovers_total"
RETRY_AFTER_S = 3.0  # how long the orchestrator passes over an engine found down
# a long first message, then short follow-ups: the history outgrows each new turn
TURNS = [
    "Tell me a story about a lighthouse keeper who finds a message in a bottle on the shore "
    "one stormy night, reads it by the light of the lamp, and decides to find its writer.",
    "Who wrote the message?",
    "Did the keeper answer it?",
    "Give the story a title.",
]


def _spec() -> dict:
    # enforce_eager: what is tested is routing and the prefix cache, not compiled graphs,
    # and each engine would spend ~22 s on 2 cores in torch.compile at every load
    engine = {"backend": "omni_llm", "model": "tiny:qwen2.5-omni-tiny",
              "engine_args": {"max_model_len": 2048, "max_num_seqs": 8, "dtype": "float32",
                              "block_size": BLOCK_SIZE, "enforce_eager": True,
                              "limit_mm_per_prompt": {"image": 0, "audio": 0, "video": 0}}}
    return {
        "pipeline": "session-affinity",
        "stages": {
            # each engine its own core (two vLLM CPU engines would both bind core 0)
            "llm_a": {**engine, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0",
                                        "VLLM_CPU_KVCACHE_SPACE": "1"}},
            "llm_b": {**engine, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1",
                                        "VLLM_CPU_KVCACHE_SPACE": "1"}},
            "omni": {"backend": "omni_orchestrator",
                     "engine_args": {"stages": {"thinker": list(ENGINES)},
                                     "engine_retry_after_s": RETRY_AFTER_S}},
        },
        "entry": "omni",
    }


@pytest.fixture(scope="module")
def server(text_chat_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("session-affinity")
    (root / "spec.yaml").write_text(yaml.safe_dump(_spec(), sort_keys=False))
    repo = gen_repo([root / "spec.yaml"], root / "repo")
    # explicit model control: the last test unloads an engine and loads it again
    with loaded(text_chat_server, repo, [(*ENGINES, "omni")]) as s:  # side by side
        yield s


def _counters(server) -> dict[str, dict[str, float]]:
    text = server.metrics()
    return {engine: {name: metric(text, name, engine) for name in (QUERIES, HITS, GENERATED)}
            for engine in ENGINES}


def _settled(server, before: dict, generated: int) -> dict:
    """Counters once `generated` more tokens are counted (the engine counts after the reply)."""
    deadline = time.monotonic() + 10
    while True:
        now = _counters(server)
        done = sum(now[e][GENERATED] - before[e][GENERATED] for e in ENGINES)
        if done >= generated or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def _session_id(engine: str, prefix: str) -> str:
    """A session id that rendezvous hashing sends to `engine`."""
    return next(f"{prefix}-{i}" for i in range(1000) if pick(f"{prefix}-{i}", ENGINES) == engine)


def _converse(server, session: str) -> list[dict]:
    """The 4 turns of one session; per turn: the engine(s) it ran on and their deltas."""
    history: list[dict] = []
    turns = []
    for text in TURNS:
        before = _counters(server)
        result = run_omni(server.grpc_url, text=text, sampling=SAMPLING, session_id=session,
                          history=history)
        assert result.error is None, result.error
        after = _settled(server, before, REPLY_TOKENS)
        delta = {e: {k: after[e][k] - before[e][k] for k in after[e]} for e in ENGINES}
        used = [e for e in ENGINES if delta[e][GENERATED] or delta[e][QUERIES]]
        served = used[0] if len(used) == 1 else None
        rate = delta[served][HITS] / delta[served][QUERIES] if served else None
        turns.append({"engines": used, "reported": result.metrics.get("thinker_model"),
                      "queries": delta[served][QUERIES] if served else None,
                      "hits": delta[served][HITS] if served else None, "rate": rate})
        history += [{"role": "user", "content": text},
                    {"role": "assistant", "content": result.text}]
    total_q = total_h = 0.0
    for t in turns:  # the engine's hit rate over the session so far (the counters' ratio)
        total_q, total_h = total_q + (t["queries"] or 0), total_h + (t["hits"] or 0)
        t["session_rate"] = total_h / total_q if total_q else None
    print(f"\nsession {session}: " + "; ".join(
        f"turn {i + 1}: {t['engines']} hits {t['hits']:.0f}/{t['queries']:.0f} = {t['rate']:.2f}"
        f" (session {t['session_rate']:.2f})" for i, t in enumerate(turns) if t["rate"] is not None))
    return turns


def _check_locality(turns: list[dict], engine: str) -> None:
    assert all(t["engines"] == [engine] for t in turns), turns
    assert all(t["reported"] == engine for t in turns), turns
    assert turns[0]["rate"] < 0.1, turns  # nothing of this conversation was cached yet
    for previous, turn in zip(turns, turns[1:]):
        # at least every full KV block of the previous turn's prompt is found again
        # (the reply's tokens may not be: its text is tokenized anew in `history`)
        assert turn["hits"] >= previous["queries"] // BLOCK_SIZE * BLOCK_SIZE, turns
        assert turn["rate"] > 0.5, turns
    session = [t["session_rate"] for t in turns]
    assert all(later > earlier for earlier, later in zip(session, session[1:])), session


def test_a_session_stays_on_its_engine_and_its_prefix_cache_hits_rise(server):
    session = _session_id("llm_a", "conversation")
    _check_locality(_converse(server, session), "llm_a")


def test_another_session_goes_where_rendezvous_hashing_sends_it(server):
    session = _session_id("llm_b", "other")
    assert pick(session, ENGINES) == "llm_b"
    _check_locality(_converse(server, session), "llm_b")


def test_requests_without_a_session_go_to_the_least_busy_engine(server):
    before = _counters(server)
    long = {"temperature": 0, "max_tokens": 64, "ignore_eos": True}
    results = [None, None]

    def ask(i: int) -> None:
        results[i] = run_omni(server.grpc_url, text=f"question {i}", sampling=long)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None and r.error is None for r in results), results
    assert sorted(r.metrics["thinker_model"] for r in results) == list(ENGINES)
    after = _settled(server, before, 2 * 64)
    assert all(after[e][GENERATED] - before[e][GENERATED] == 64 for e in ENGINES)


def test_a_bad_history_is_an_invalid_argument_naming_it(server):
    stream = OmniStream(server.grpc_url)
    try:
        stream.send(omni_inputs("hi", session_id="s", history='[{"role": "system", "content": 1}]'))
        result = stream.collect(timeout=60)
    finally:
        stream.close()
    assert result.error is not None
    assert error_code(result.error) == "INVALID_ARG", result.error
    assert result.error.message().startswith("history[0].role: must be one of"), result.error
    stream = OmniStream(server.grpc_url)
    try:
        stream.send(omni_inputs("hi", history="not json"))
        result = stream.collect(timeout=60)
    finally:
        stream.close()
    assert result.error is not None and "history: invalid JSON" in result.error.message()
    # and the server keeps serving
    ok = run_omni(server.grpc_url, text="still there?", sampling=SAMPLING, session_id="s")
    assert ok.error is None and ok.metrics["thinker_model"] == pick("s", ENGINES)


def _ready(server, model: str) -> bool:
    return grpcclient.InferenceServerClient(server.grpc_url).is_model_ready(model)


def test_an_unloaded_engines_session_moves_to_the_other_and_comes_back(server):
    """It unloads llm_b and loads it again, also when it fails."""
    session = _session_id("llm_b", "failover")
    text = "Where does the lighthouse keeper live?"
    ask = dict(text=text, sampling=SAMPLING)
    # what the same model answers on llm_a (greedy; both engines load the same checkpoint)
    reference = run_omni(server.grpc_url, **ask, session_id=_session_id("llm_a", "reference"))
    assert reference.error is None and reference.metrics["thinker_model"] == "llm_a"

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.unload_model("llm_b")
    try:
        _moves_and_comes_back(server, client, ask, session, reference)
    finally:  # loaded again however the test ends, so the module's server is as it was
        if not _ready(server, "llm_b"):
            client.load_model("llm_b")


def _moves_and_comes_back(server, client, ask: dict, session: str, reference) -> None:
    deadline = time.monotonic() + 60
    while _ready(server, "llm_b") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ready(server, "llm_b")
    before = _counters(server)
    failovers = metric(server.metrics(), FAILOVERS, "omni", engine="llm_b")
    moved = [run_omni(server.grpc_url, **ask, session_id=session) for _ in range(2)]
    for result in moved:  # served, by llm_a, with the same answer
        assert result.error is None, result.error
        assert result.metrics["thinker_model"] == "llm_a"
        assert result.text == reference.text
    # the first found llm_b down; the second went straight to llm_a
    assert moved[0].metrics["thinker_passed_over"] == ["llm_b"]
    assert "thinker_passed_over" not in moved[1].metrics
    assert metric(server.metrics(), FAILOVERS, "omni", engine="llm_b") == failovers + 1
    assert metric(server.metrics(), FAILOVERS, "omni", engine="llm_a") == 0
    after = _settled(server, before, 2 * REPLY_TOKENS)
    assert after["llm_a"][GENERATED] - before["llm_a"][GENERATED] == 2 * REPLY_TOKENS
    log = server.log_path.read_text(errors="replace")
    assert "(model llm_b) failed" in log and "passing it over" in log

    client.load_model("llm_b")
    assert _ready(server, "llm_b")
    time.sleep(RETRY_AFTER_S)
    back = run_omni(server.grpc_url, **ask, session_id=session)
    assert back.error is None, back.error
    assert back.metrics["thinker_model"] == "llm_b" and back.text == reference.text

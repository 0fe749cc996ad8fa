"""Several thinker engines: session affinity, least-busy routing, and `history` in the prompt."""
from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from omni_serve.contract import LLM, OMNI
from omni_serve.errors import RequestError, StageFailedError
from omni_serve.orchestrator.pipeline import (
    Final,
    OmniPipeline,
    StageCallError,
    TextDelta,
)
from omni_serve.orchestrator.request import Turn, parse_request
from omni_serve.orchestrator.routing import pick
from tests.unit.chat import tiny_chat_prompt
from tests.unit.test_orchestrator import ScriptedStages, config, tensors

ENGINES = ("llm_a", "llm_b")


class TwoThinkers(ScriptedStages):
    """ScriptedStages whose thinker is served by several engines `llm_*` (same answers)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.thinker_calls: list[tuple[str, str]] = []  # (engine, prompt)

    def stream(self, model, inputs, outputs, *, request_id, timeout_s, unread=None):
        if model.startswith("llm_"):
            self.thinker_calls.append((model, inputs[LLM.TEXT_INPUT][0].decode()))
            if model == self.fail:
                return super().stream(model, inputs, outputs, request_id=request_id,
                                      timeout_s=timeout_s)
            model = "llm"
        return super().stream(model, inputs, outputs, request_id=request_id, timeout_s=timeout_s)


def engines_config(**overrides):
    return config(stages={"thinker": list(ENGINES)}, **overrides)


def run_all(pipeline: OmniPipeline, cfg, requests: list[dict]) -> list[list]:
    """Run requests concurrently; one event list each."""
    async def main():
        results = [[] for _ in requests]
        await asyncio.gather(*(pipeline.run(parse_request(f"r{i}", t, cfg), results[i].append)
                               for i, t in enumerate(requests)))
        return results
    return asyncio.run(main())


def history_json(*turns: tuple[str, str]) -> str:
    return json.dumps([{"role": role, "content": content} for role, content in turns])


# --- the prompt ----------------------------------------------------------------------

def test_history_is_rendered_before_the_new_turn():
    chat = tiny_chat_prompt()
    prompt = chat.render("SYS", "how are you?", (), [Turn("user", "hi"), Turn("assistant", "hello!")])
    assert prompt == ("<|im_start|>system\nSYS<|im_end|>\n"
                      "<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\nhello!<|im_end|>\n"
                      "<|im_start|>user\nhow are you?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.render("SYS", "x", (), []) == chat.render("SYS", "x")


def test_each_turn_extends_the_previous_prompt_and_reply():
    # what lets the thinker engine's prefix cache hit: turn N starts with turn N-1 + its reply
    history: list[Turn] = []
    previous = None
    for user, reply in (("one", "A"), ("two", "B B"), ("three", "C")):
        prompt = tiny_chat_prompt().render("SYS", user, (), history)
        if previous is not None:
            assert prompt.startswith(previous)
        previous = prompt + reply
        history += [Turn("user", user), Turn("assistant", reply)]


# --- request parsing -------------------------------------------------------------------

@pytest.mark.parametrize("raw,field,message", [
    ("[{", "history", "invalid JSON"),
    ('{"role": "user", "content": "x"}', "history", "must be a JSON array"),
    ('["hi"]', "history[0]", "must be an object"),
    ('[{"role": "system", "content": "x"}]', "history[0].role",
     "must be one of ['user', 'assistant'], got 'system'"),
    ('[{"role": "user", "content": "x"}, {"role": "assistant"}]', "history[1].content",
     "must be a string or a non-empty list of"),
    ('[{"role": "user", "content": "x", "name": "bob"}]', "history[0]", "unknown key 'name'"),
])
def test_a_bad_history_names_the_field(raw, field, message):
    with pytest.raises(RequestError) as err:
        parse_request("r", tensors(**{OMNI.HISTORY: raw.encode()}), engines_config())
    assert err.value.field == field
    assert message in err.value.message
    assert str(err.value).startswith("history")


def test_history_and_session_id_are_read():
    req = parse_request("r", tensors(**{
        OMNI.HISTORY: history_json(("user", "hi"), ("assistant", "hey")).encode(),
        OMNI.SESSION_ID: b"conv-1"}), engines_config())
    assert req.history == (Turn("user", "hi"), Turn("assistant", "hey"))
    assert req.session_id == "conv-1"
    assert parse_request("r", tensors(**{OMNI.HISTORY: b"[]", OMNI.SESSION_ID: b" "}),
                         engines_config()).session_id is None  # empty: no session


def test_a_too_long_session_id_is_refused():
    with pytest.raises(RequestError, match="session_id: is 300 characters"):
        parse_request("r", tensors(**{OMNI.SESSION_ID: b"x" * 300}), engines_config())


# --- config --------------------------------------------------------------------------

def test_the_thinker_role_takes_one_name_or_a_list():
    assert config(stages={"thinker": "llm"}).stages.thinkers == ("llm",)
    assert engines_config().stages.thinkers == ENGINES


@pytest.mark.parametrize("thinker,message", [
    ([], "thinker: an empty list; name at least one omni_llm stage"),
    (["llm_a", "llm_a"], "thinker.1: stage 'llm_a' is named twice"),
    (["llm_a", ""], "must not be empty"),
])
def test_a_bad_thinker_list_is_refused(thinker, message):
    """The same rules and words as omni-gen-repo's spec check (config.role_problems)."""
    with pytest.raises(ValidationError, match=message):
        config(stages={"thinker": thinker})


# --- routing in the pipeline -----------------------------------------------------------

def test_every_turn_of_a_session_reaches_the_same_engine_with_its_history():
    cfg = engines_config()
    stages = TwoThinkers(reply_tokens=3, token_delay=0)
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    for session, turns in (("alice", 3), ("bob", 2)):
        history: list[tuple[str, str]] = []
        for i in range(turns):
            (events,) = run_all(pipeline, cfg, [tensors(
                f"turn {i}", **{OMNI.SESSION_ID: session.encode(),
                                OMNI.HISTORY: history_json(*history).encode()})])
            final = events[-1]
            assert isinstance(final, Final)
            assert final.metrics["thinker_model"] == pick(session, ENGINES)
            reply = "".join(e.text for e in events if isinstance(e, TextDelta))
            history += [("user", f"turn {i}"), ("assistant", reply)]
    assert [engine for engine, _ in stages.thinker_calls] == (
        [pick("alice", ENGINES)] * 3 + [pick("bob", ENGINES)] * 2)
    prompts = [prompt for _, prompt in stages.thinker_calls]
    # alice's third prompt = her second prompt + its reply + the new turn
    assert prompts[2].startswith(prompts[1] + "w0 w1 w2 <|im_end|>\n<|im_start|>user\nturn 2")


def test_requests_without_a_session_spread_over_the_engines():
    cfg = engines_config()
    stages = TwoThinkers(reply_tokens=5, token_delay=0.01)
    results = run_all(OmniPipeline(cfg, stages, tiny_chat_prompt()), cfg,
                      [tensors(f"q{i}") for i in range(4)])
    assert sorted(r[-1].metrics["thinker_model"] for r in results) == [
        "llm_a", "llm_a", "llm_b", "llm_b"]


def test_a_failing_engine_is_named():
    cfg = engines_config()
    session = next(f"s{i}" for i in range(100) if pick(f"s{i}", ENGINES) == "llm_b")
    stages = TwoThinkers(fail="llm_b")
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    with pytest.raises(StageFailedError, match=r"stage 'thinker' \(model llm_b\) failed"):
        run_all(pipeline, cfg, [tensors("x", **{OMNI.SESSION_ID: session.encode()})])
    assert pipeline.thinkers.in_flight == {"llm_a": 0, "llm_b": 0}


def test_one_thinker_name_still_works():
    cfg = config(stages={"thinker": "llm"})
    stages = ScriptedStages(reply_tokens=2, token_delay=0)
    (events,) = run_all(OmniPipeline(cfg, stages, tiny_chat_prompt()), cfg,
                        [tensors("hi", **{OMNI.SESSION_ID: b"any"})])
    assert events[-1].metrics["thinker_model"] == "llm"
    assert [m for m, _ in stages.calls] == ["llm"]


# --- an engine that is down ----------------------------------------------------------

class FlakyThinkers(TwoThinkers):
    """Engines in `down` refuse every call UNAVAILABLE (a server that is gone); an engine in
    `break_after` fails UNAVAILABLE after that many responses (one that dies mid-reply)."""

    def __init__(self, down=(), break_after=None, **kw):
        super().__init__(**kw)
        self.down = set(down)
        self.break_after = break_after or {}

    async def stream(self, model, inputs, outputs, *, request_id, timeout_s, unread=None):
        if model in self.down:
            self.thinker_calls.append((model, ""))
            raise StageCallError("UNAVAILABLE", "failed to connect to all addresses")
        n = 0
        async for out in super().stream(model, inputs, outputs, request_id=request_id,
                                         timeout_s=timeout_s):
            if n == self.break_after.get(model):
                raise StageCallError("UNAVAILABLE", "Socket closed")
            n += 1
            yield out


def _session_on(engine: str) -> bytes:
    return next(f"s{i}" for i in range(100) if pick(f"s{i}", ENGINES) == engine).encode()


def test_a_session_whose_engine_is_down_is_served_by_the_next_one():
    cfg = engines_config()
    stages = FlakyThinkers(down={"llm_b"}, reply_tokens=3, token_delay=0)
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    session = {OMNI.SESSION_ID: _session_on("llm_b")}
    (events,) = run_all(pipeline, cfg, [tensors("hi", **session)])
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "w0 w1 w2 "
    assert events[-1].metrics["thinker_model"] == "llm_a"
    assert events[-1].metrics["thinker_passed_over"] == ["llm_b"]
    assert [m for m, _ in stages.thinker_calls] == ["llm_b", "llm_a"]
    # the next turn goes straight to llm_a while llm_b is passed over
    (events,) = run_all(pipeline, cfg, [tensors("again", **session)])
    assert events[-1].metrics["thinker_model"] == "llm_a"
    assert "thinker_passed_over" not in events[-1].metrics
    assert [m for m, _ in stages.thinker_calls] == ["llm_b", "llm_a", "llm_a"]
    assert pipeline.thinkers.in_flight == {"llm_a": 0, "llm_b": 0}


def test_the_engine_gets_its_sessions_back_once_it_answers_again():
    cfg = engines_config(engine_retry_after_s=0.05)
    stages = FlakyThinkers(down={"llm_b"}, reply_tokens=2, token_delay=0)
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    session = {OMNI.SESSION_ID: _session_on("llm_b")}
    run_all(pipeline, cfg, [tensors("hi", **session)])
    stages.down.clear()  # it is back
    asyncio.run(asyncio.sleep(0.06))  # past its retry time
    (events,) = run_all(pipeline, cfg, [tensors("again", **session)])
    assert events[-1].metrics["thinker_model"] == "llm_b"
    assert not pipeline.thinkers.is_down("llm_b")


def test_an_engine_that_fails_mid_reply_is_not_retried():
    # text already went to the client: starting over elsewhere would repeat it
    cfg = engines_config()
    stages = FlakyThinkers(break_after={"llm_b": 2}, reply_tokens=5, token_delay=0)
    events: list = []
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    req = parse_request("r", tensors("hi", **{OMNI.SESSION_ID: _session_on("llm_b")}), cfg)
    with pytest.raises(StageFailedError, match=r"\(model llm_b\) failed: Socket closed") as e:
        asyncio.run(pipeline.run(req, events.append))
    assert e.value.code == "UNAVAILABLE"
    assert [e.text for e in events] == ["w0 ", "w1 "]
    assert [m for m, _ in stages.thinker_calls] == ["llm_b"]
    assert not pipeline.thinkers.is_down("llm_b")  # it had answered


def test_every_engine_down_is_an_unavailable_error_after_trying_each_once():
    cfg = engines_config()
    stages = FlakyThinkers(down=set(ENGINES))
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    session = _session_on("llm_a")
    with pytest.raises(StageFailedError, match=r"\(model llm_b\) failed: failed to connect") as e:
        run_all(pipeline, cfg, [tensors("hi", **{OMNI.SESSION_ID: session})])
    assert e.value.code == "UNAVAILABLE"
    assert [m for m, _ in stages.thinker_calls] == ["llm_a", "llm_b"]
    assert pipeline.thinkers.in_flight == {"llm_a": 0, "llm_b": 0}


def test_a_rejected_request_is_not_sent_to_another_engine():
    cfg = engines_config()
    stages = TwoThinkers(fail="llm_b")  # INVALID_ARG: the request's fault, not the engine's
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())
    with pytest.raises(StageFailedError, match="llm_b refuses"):
        run_all(pipeline, cfg, [tensors("x", **{OMNI.SESSION_ID: _session_on("llm_b")})])
    assert [m for m, _ in stages.thinker_calls] == ["llm_b"]
    assert not pipeline.thinkers.is_down("llm_b")


def test_a_consumer_that_fails_closes_the_engines_stream_at_once():
    cfg = engines_config()
    stages = TwoThinkers(reply_tokens=50, token_delay=0.001)
    pipeline = OmniPipeline(cfg, stages, tiny_chat_prompt())

    def emit(event):
        if isinstance(event, TextDelta):
            raise RuntimeError("the client is gone")

    async def main():
        with pytest.raises(RuntimeError, match="the client is gone"):
            await pipeline.run(parse_request("r", tensors("hi"), cfg), emit)
        # before the loop runs anything else: the engine's stream is closed already
        return set(stages.open_streams), list(stages.closed_early)

    assert asyncio.run(main()) == (set(), ["llm"])
    assert pipeline.thinkers.in_flight == {"llm_a": 0, "llm_b": 0}

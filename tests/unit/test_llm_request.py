"""Request parsing and sampling-parameter coercion of the omni_llm stage (no server)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from omni_serve.contract import LLM
from omni_serve.errors import RequestError
from omni_serve.llm import sampling
from omni_serve.llm.request import LLMOutput, merge_outputs, parse_request


def tensors(prompt="hi", **extra):
    out = {LLM.TEXT_INPUT: np.array([prompt.encode()], dtype=object)}
    for k, v in extra.items():
        out[k] = np.array([v.encode() if isinstance(v, str) else v],
                          dtype=object if isinstance(v, str) else None)
    return out


# --- coercion ------------------------------------------------------------------
@pytest.mark.parametrize("field,raw,expected", [
    ("temperature", "0.7", 0.7),
    ("temperature", 1, 1.0),
    ("max_tokens", "5", 5),
    ("max_tokens", 5.0, 5),
    ("top_k", "40", 40),
    ("ignore_eos", "true", True),
    ("ignore_eos", 0, False),
    ("stop", "END", "END"),
    ("stop", ["a", "b"], ["a", "b"]),
    ("stop_token_ids", ["1", 2], [1, 2]),
    ("logit_bias", {"50": -100}, {50: -100.0}),
    ("seed", "123", 123),
    ("seed", None, None),
])
def test_values_are_coerced_to_the_sampling_params_type(field, raw, expected):
    out = sampling.coerce({field: raw})
    assert out == {field: expected}
    assert type(out[field]) is type(expected)


@pytest.mark.parametrize("field,raw", [
    ("max_tokens", "many"), ("max_tokens", 2.5), ("temperature", "hot"),
    ("ignore_eos", "perhaps"), ("stop_token_ids", ["x"]),
])
def test_uncoercible_values_name_the_field_and_the_value(field, raw):
    with pytest.raises(RequestError) as e:
        sampling.coerce({field: raw})
    assert e.value.field == f"sampling_parameters.{field}"
    assert repr(raw) in str(e.value)


@pytest.mark.parametrize("field,raw", [
    ("max_tokens", 10**23), ("seed", -(2**63) - 1), ("seed", 2**64), ("stop_token_ids", [1, 2**70]),
    ("logit_bias", {str(2**65): 1.0}), ("extra_args", {"a": [{"b": 10**40}]}),
])
def test_integers_the_engine_cannot_carry_name_the_field(field, raw):
    """msgspec serializes ints in [-2**63, 2**64 - 1] only: beyond, vLLM failed with an
    anonymous EngineGenerateError (INTERNAL) after validation."""
    with pytest.raises(RequestError, match="integers must be between -2\\*\\*63 and 2\\*\\*64 - 1") as e:
        sampling.coerce({field: raw})
    assert e.value.field == f"sampling_parameters.{field}"


def test_integers_the_engine_carries_pass():
    assert sampling.coerce({"seed": 2**64 - 1, "max_tokens": 2**63 - 1}) == {
        "seed": 2**64 - 1, "max_tokens": 2**63 - 1}


@pytest.mark.parametrize("raw", ['{"max_tokens": ' + "1" * 5000 + "}", "[" * 100000])
def test_json_python_refuses_to_parse_is_invalid_json(raw):
    """Over 4300 digits (ValueError) or nesting past the recursion limit: not an INTERNAL."""
    with pytest.raises(RequestError, match="invalid JSON") as e:
        sampling.parse_json(raw)
    assert e.value.field == "sampling_parameters"


def test_unknown_field_suggests_the_close_match_and_lists_the_allowed():
    with pytest.raises(RequestError) as e:
        sampling.coerce({"temprature": 0.5})
    msg = str(e.value)
    assert msg.startswith("sampling_parameters.temprature: unknown sampling parameter")
    assert "did you mean temperature" in msg
    assert "allowed: " in msg and "max_tokens" in msg


@pytest.mark.parametrize("field", ["output_kind", "detokenize", "prompt_logprobs",
                                   "_all_stop_token_ids"])
def test_fields_the_stage_owns_are_not_settable(field):
    assert field not in sampling.settable_fields()
    with pytest.raises(RequestError, match="unknown sampling parameter"):
        sampling.coerce({field: 1})


def test_vllm_range_checks_become_request_errors_naming_the_parameter():
    with pytest.raises(RequestError) as e:
        sampling.build({"max_tokens": -1}, stream=True)
    assert e.value.field == "sampling_parameters.max_tokens"
    assert "at least 1, got -1" in str(e.value)
    with pytest.raises(RequestError, match="sampling_parameters.temperature"):
        sampling.build({"temperature": -0.5}, stream=False)


def test_n_other_than_one_is_refused_unless_the_caller_serves_it():
    with pytest.raises(RequestError, match=r"n: must be 1 \(this stage generates one sequence"):
        sampling.build({"n": 3}, stream=False)
    with pytest.raises(RequestError, match=r"n: must be between 1 and 4 \(why\), got 5"):
        sampling.build({"n": 5}, stream=False, max_n=(4, "why"))
    assert sampling.build({"n": 3}, stream=False, max_n=(4, "why")).n == 3
    for bad in (True, "3", 2.0, 0, -1):
        with pytest.raises(RequestError, match="n: must be a positive integer"):
            sampling.build({"n": bad}, stream=False, max_n=(4, "why"))


def test_stream_chooses_delta_or_final_only_output():
    from vllm.sampling_params import RequestOutputKind

    assert sampling.build({}, stream=True).output_kind == RequestOutputKind.DELTA
    assert sampling.build({}, stream=False).output_kind == RequestOutputKind.FINAL_ONLY


@pytest.mark.parametrize("raw,msg", [
    ('{"max_tokens": 5', "invalid JSON"), ("[1]", "must be a JSON object"),
    (b"\xff\xfe", "not valid UTF-8"),
])
def test_bad_json(raw, msg):
    with pytest.raises(RequestError, match=msg):
        sampling.parse_json(raw)


def test_empty_json_is_no_parameters():
    assert sampling.parse_json(b"") == {} and sampling.parse_json(None) == {}


# --- request parsing -------------------------------------------------------------
def test_parse_request_reads_tensors_and_flags():
    req = parse_request("r1", tensors("hello", **{
        LLM.STREAM: True, LLM.SAMPLING_PARAMETERS: json.dumps({"max_tokens": "7"}),
        LLM.RETURN_FINISH_REASON: True}))
    assert req.prompt == "hello" and req.stream is True
    assert req.sampling == {"max_tokens": 7}
    assert req.return_finish_reason and not req.return_num_input_tokens
    assert req.exclude_input_in_output is False  # vllm_backend default


def test_request_parameters_supply_flags_and_sampling_and_the_tensor_wins():
    req = parse_request("r", tensors(**{LLM.SAMPLING_PARAMETERS: '{"max_tokens": 3}'}),
                        {"stream": "true", "max_tokens": 9, "temperature": "0"})
    assert req.stream is True
    assert req.sampling == {"max_tokens": 3, "temperature": 0.0}


def test_a_flag_tensor_wins_over_the_parameter():
    req = parse_request("r", tensors(**{LLM.STREAM: False}), {"stream": True})
    assert req.stream is False


@pytest.mark.parametrize("inputs,params,field", [
    ({LLM.TEXT_INPUT: None}, None, "text_input"),
    ({LLM.TEXT_INPUT: np.array([b""], dtype=object)}, None, "text_input"),
    ({LLM.TEXT_INPUT: np.array([b"a", b"b"], dtype=object)}, None, "text_input"),
    ({LLM.TEXT_INPUT: np.array([b"\xff"], dtype=object)}, None, "text_input"),
    (tensors(), {"stream": "maybe"}, "stream"),
    (tensors(), {"bogus": 1}, "parameters.bogus"),
])
def test_bad_requests_name_their_field(inputs, params, field):
    with pytest.raises(RequestError) as e:
        parse_request("r", inputs, params)
    assert e.value.field == field


def chat(value) -> dict:
    raw = value if isinstance(value, str) else json.dumps(value)
    return {LLM.MESSAGES: np.array([raw.encode()], dtype=object)}


def test_a_chat_is_parsed_instead_of_text():
    turns = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    req = parse_request("r", chat(turns))
    assert req.messages == turns and req.prompt is None and req.prompt_token_ids is None


@pytest.mark.parametrize("inputs,field,fragment", [
    (chat("[{"), "messages", "invalid JSON"),
    (chat([]), "messages", "non-empty JSON array"),
    (chat({"role": "user"}), "messages", "non-empty JSON array"),
    (chat(["hi"]), "messages[0]", '"role"'),
    (chat([{"role": "user", "content": 3}]), "messages[0].content", "string or a list"),
    (chat([{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content",
     "string or a list"),
    ({**tensors(), **chat([{"role": "user", "content": "x"}])}, "messages", "not both"),
])
def test_bad_chats_name_the_message(inputs, field, fragment):
    with pytest.raises(RequestError, match=re.escape(fragment)) as e:
        parse_request("r", inputs)
    assert e.value.field == field


def test_merge_outputs_joins_text_and_logprobs_and_adds_the_output_counts():
    outs = [LLMOutput("a", None, 3, 1, False, cumulative_logprob=-1.0, logprobs=[{5: (-1.0, 1, "a")}]),
            LLMOutput("b", None, 3, 2, False, cumulative_logprob=-2.5,
                      logprobs=[{6: (-0.5, 1, "b")}, {7: (-1.0, 1, "")}]),
            LLMOutput("c", "length", 3, 0, True, cumulative_logprob=-2.5, logprobs=[])]
    merged = merge_outputs(outs)
    assert merged == LLMOutput("abc", "length", 3, 3, True, cumulative_logprob=-2.5,
                               logprobs=[{5: (-1.0, 1, "a")}, {6: (-0.5, 1, "b")},
                                         {7: (-1.0, 1, "")}])
    assert merge_outputs(outs[:1]) is outs[0]


def test_merge_outputs_merges_n_sequences_each_by_its_index():
    def step(a: str, b: str, final: bool = False) -> LLMOutput:
        seqs = tuple(LLMOutput(t, "length" if final else None, 3, len(t), final, logprobs=[])
                     for t in (a, b))
        return LLMOutput("", None, 3, len(a) + len(b), final, sequences=seqs)

    merged = merge_outputs([step("x", ""), step("", "yz"), step("w", "", final=True)])
    assert [s.text for s in merged.sequences] == ["xw", "yz"]
    assert [s.num_output_tokens for s in merged.sequences] == [2, 2]
    assert merged.num_output_tokens == 4 and merged.final
    assert [s.finish_reason for s in merged.sequences] == ["length", "length"]

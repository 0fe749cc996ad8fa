"""omni_llm as a drop-in for Triton's vllm_backend, called as that backend's clients call it.

On the session's text-chat server: its `llm` model walks the matrix vllm_backend's
additional-outputs test walks (stream x each return flag x sampling logprobs), checked
against that backend's semantics. The module then loads one model of its own into that
server (servers.loaded): a vllm_backend model repository, written here as a vllm_backend
user writes it (a config.pbtxt that says only `backend: "omni_llm"` and the parameters
REPORT_CUSTOM_METRICS and ENABLE_VLLM_HEALTH_CHECK, 1/model.json with enable_lora,
1/multi_lora.json naming a tiny LoRA adapter built here), for its LoRA, metrics and
health-check tests, and beside it the same checkpoint as a pooling model (model.json with
runner "pooling") for embedding_request; the last test kills the first model's engine.
"""
from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import tritonclient.grpc as grpcclient
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from omni_serve.contract import LLM_CONTRACT
from omni_tools.tiny_models import ensure_model

from .omni_io import error_code
from .servers import loaded, processes_of

pytestmark = pytest.mark.integration

PROMPT = "In this example,"
MAX_TOKENS = 8
GREEDY = {"temperature": "0", "top_p": "1", "max_tokens": str(MAX_TOKENS), "ignore_eos": "true"}
FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
         "return_num_input_tokens", "return_num_output_tokens")
COMPAT = "vllm_model"  # the vllm_backend-style model this module loads
EMBED = "vllm_embed"  # the same checkpoint as a pooling model, loaded beside it
UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"


# --- a vllm_backend client ----------------------------------------------------------------
def _inputs(prompt: str, *, stream: bool, sampling: dict | None, **flags: bool | None):
    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool))
        return t

    ins = [tensor("text_input", prompt.encode(), "BYTES"), tensor("stream", stream, "BOOL")]
    if sampling is not None:
        ins.append(tensor("sampling_parameters", json.dumps(sampling).encode(), "BYTES"))
    ins += [tensor(name, value, "BOOL") for name, value in flags.items() if value is not None]
    return ins


def infer(url: str, model: str, inputs, parameters=None, timeout: float = 60.0):
    """Every response of one request over a gRPC stream: [(result, error)], final last."""
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, parameters=parameters,
                                  enable_empty_final_response=True)
        responses = []
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                return responses + [(None, error)]
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.get_response().outputs:
                responses.append((result, None))
            if final:
                return responses
    finally:
        client.stop_stream()
        client.close()


def text_of(responses) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r, _ in responses)


@pytest.fixture(scope="module")
def url(text_chat_server):
    return text_chat_server.grpc_url


@pytest.fixture(scope="module")
def prompt_tokens() -> int:
    return len(AutoTokenizer.from_pretrained(ensure_model("qwen2-tiny"))(PROMPT).input_ids)


# --- the additional-outputs matrix ------------------------------------------------------------
# each flag unset, false or true alone, all of them false, all true
FLAG_SETS = [{}, dict.fromkeys(FLAGS, False), dict.fromkeys(FLAGS, True),
             *({flag: True} for flag in FLAGS), *({flag: False} for flag in FLAGS)]


@pytest.mark.parametrize("logprobs", [None, 0, 2])
@pytest.mark.parametrize("stream", [True, False])
def test_additional_outputs_have_vllm_backends_semantics(url, prompt_tokens, stream, logprobs):
    sampling = GREEDY if logprobs is None else {**GREEDY, "logprobs": logprobs}
    for flags in FLAG_SETS:
        responses = infer(url, "llm", _inputs(PROMPT, stream=stream, sampling=sampling, **flags),
                          parameters=sampling)
        assert all(e is None for _, e in responses), (flags, responses)
        assert len(responses) >= 1 and (stream or len(responses) == 1)
        text = text_of(responses)
        # without exclude_input_in_output the prompt leads a non-streamed text only
        assert text.startswith(PROMPT) != stream, text
        _check(responses, flags, logprobs, stream, prompt_tokens)


def _check(responses, flags, logprobs, stream, prompt_tokens):
    def out(result, name):
        return result.as_numpy(name)

    counts = []
    previous_cumulative = None
    for i, (result, _) in enumerate(responses):
        last = i == len(responses) - 1
        for flag in FLAGS:
            name = flag.removeprefix("return_")
            assert (out(result, name) is not None) == bool(flags.get(flag)), (flag, flags)
        if flags.get("return_finish_reason"):
            reason = out(result, "finish_reason")[0].decode()
            assert reason == ("length" if last else "None")
        if flags.get("return_num_input_tokens"):
            assert int(out(result, "num_input_tokens")[0]) == prompt_tokens
        if flags.get("return_num_output_tokens"):
            counts.append(int(out(result, "num_output_tokens")[0]))
            assert counts[-1] > 0
        if flags.get("return_cumulative_logprob"):
            value = float(out(result, "cumulative_logprob")[0])
            if logprobs is None:  # vLLM computes it only with logprobs
                assert math.isnan(value)
            else:
                assert value <= 0 and (previous_cumulative is None or value < previous_cumulative)
                previous_cumulative = value
        if flags.get("return_logprobs"):
            _check_logprobs(result, logprobs, stream, counts[-1] if counts else None)
    if counts:
        assert sum(counts) == MAX_TOKENS


def _check_logprobs(result, logprobs, stream, count):
    doc = json.loads(result.as_numpy("logprobs")[0].decode())
    if logprobs is None:
        assert doc is None
        return
    assert isinstance(doc, list) and doc
    if count is not None:
        assert len(doc) == count
    sampled = ""
    for position in doc:
        assert 1 <= len(position) <= logprobs + 1
        ranked_first = [lp for lp in position.values() if lp["rank"] == 1]
        assert len(ranked_first) == 1  # greedy: the sampled token
        for token_id, lp in position.items():
            assert token_id.isdigit() and set(lp) == {"logprob", "rank", "decoded_token"}
            assert isinstance(lp["logprob"], float) and isinstance(lp["decoded_token"], str)
        sampled += ranked_first[0]["decoded_token"]
    text = result.as_numpy("text_output")[0].decode()
    assert (sampled if stream else PROMPT + sampled) == text


def test_streaming_with_the_prompt_in_the_output_is_refused_with_vllm_backends_text(url):
    responses = infer(url, "llm", _inputs(PROMPT, stream=True, sampling=GREEDY,
                                          exclude_input_in_output=False))
    ((result, error),) = responses
    assert error.message() == ("Error generating stream: When streaming, "
                               "`exclude_input_in_output` = False is not allowed.")


def test_sampling_parameters_also_work_as_request_parameters_alone(url):
    as_tensor = infer(url, "llm", _inputs(PROMPT, stream=False, sampling=GREEDY))
    as_parameters = infer(url, "llm", _inputs(PROMPT, stream=False, sampling=None),
                          parameters=GREEDY)
    assert text_of(as_parameters) == text_of(as_tensor) != PROMPT


# --- n > 1: several sequences per prompt, every per-sequence tensor n wide ---------------------
def _sequences(responses, n: int) -> dict[str, list]:
    """Per sequence: its text (deltas joined), output token count, last finish reason."""
    seqs = {"text": [""] * n, "tokens": [0] * n, "reason": [None] * n,
            "logprobs": [[] for _ in range(n)], "cumulative": [math.nan] * n}
    for result, _ in responses:
        texts = result.as_numpy("text_output")
        assert texts.shape == (n,)
        for name in ("finish_reason", "cumulative_logprob", "logprobs", "num_output_tokens"):
            assert result.as_numpy(name).shape == (n,), name
        for i in range(n):
            seqs["text"][i] += texts[i].decode()
            seqs["tokens"][i] += int(result.as_numpy("num_output_tokens")[i])
            seqs["reason"][i] = result.as_numpy("finish_reason")[i].decode()
            seqs["logprobs"][i] += json.loads(result.as_numpy("logprobs")[i])
            seqs["cumulative"][i] = float(result.as_numpy("cumulative_logprob")[i])
    return seqs


SAMPLED = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": 11,
           "logprobs": 1}


@pytest.mark.parametrize("stream", [False, True])
def test_n_sequences_come_n_wide_each_the_reply_of_its_own_seed(url, stream):
    """vLLM gives sequence i of a seeded request the seed + i: each must be the reply of a
    single request with that seed (vLLM refuses n > 1 with greedy sampling)."""
    flags = dict.fromkeys(FLAGS, True)
    singles = [_sequences(infer(url, "llm", _inputs(PROMPT, stream=False, sampling={
        **SAMPLED, "seed": SAMPLED["seed"] + i}, exclude_input_in_output=True, **flags)), 1)
        for i in range(3)]
    responses = infer(url, "llm", _inputs(PROMPT, stream=stream, sampling={**SAMPLED, "n": 3},
                                          exclude_input_in_output=True, **flags))
    assert all(e is None for _, e in responses), [e.message() for _, e in responses if e]
    assert stream or len(responses) == 1
    seqs = _sequences(responses, 3)
    assert seqs["text"] == [one["text"][0] for one in singles]
    assert len(set(seqs["text"])) == 3  # three seeds, three replies
    assert seqs["tokens"] == [MAX_TOKENS] * 3 and seqs["reason"] == ["length"] * 3
    for i in range(3):
        assert len(seqs["logprobs"][i]) == MAX_TOKENS
        assert math.isclose(seqs["cumulative"][i], singles[i]["cumulative"][0], abs_tol=1e-4)
    assert int(responses[0][0].as_numpy("num_input_tokens")[0]) > 0


@pytest.mark.parametrize(("sampling", "flags", "expected"), [
    ({"n": 5000}, {}, "sampling_parameters.n: must be between 1 and "),
    ({"n": 0}, {}, "sampling_parameters.n: must be a positive integer, got 0"),
    ({"n": "two"}, {}, "sampling_parameters.n: Input should be a valid integer"),
    ({"n": 2}, {"return_token_ids": True},
     "sampling_parameters.n: must be 1 (return_token_ids returns one sequence), got 2"),
])
def test_a_bad_n_is_invalid_arg_naming_it(url, sampling, flags, expected):
    ((_, error),) = infer(url, "llm", _inputs(PROMPT, stream=False,
                                              sampling={**SAMPLED, **sampling}, **flags))
    assert expected in error.message() and error_code(error) == "INVALID_ARG"
    assert text_of(infer(url, "llm", _inputs(PROMPT, stream=False, sampling=GREEDY)))


def test_a_lora_request_to_a_model_without_lora_gets_vllm_backends_text(url):
    ((_, error),) = infer(url, "llm", _inputs(PROMPT, stream=False,
                                              sampling={**GREEDY, "lora_name": "doll"}))
    assert error.message() == "LoRA feature is not enabled."


# --- a vllm_backend model repository ---------------------------------------------------------
def _tiny_lora(base: str, out: Path, seed: int = 0) -> Path:
    """A rank-8 LoRA adapter of q_proj and v_proj in PEFT's on-disk format, random B (PEFT
    starts B at zero), so it changes what the model says."""
    cfg = AutoConfig.from_pretrained(base)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    outs = {"q_proj": cfg.num_attention_heads * head_dim,
            "v_proj": cfg.num_key_value_heads * head_dim}
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_hidden_layers):
        for module, width in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(8, cfg.hidden_size, generator=g)
            weights[f"{key}.lora_B.weight"] = torch.randn(width, 8, generator=g)
    out.mkdir(parents=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(outs), "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False}))
    return out


def _vllm_backend_repository(root: Path) -> Path:
    base = str(ensure_model("qwen2-tiny"))
    model = root / "repo" / COMPAT
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "omni_llm"\n'
        'instance_group [ { count: 1, kind: KIND_MODEL } ]\n'
        'parameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n'
        'parameters: { key: "ENABLE_VLLM_HEALTH_CHECK" value: { string_value: "true" } }\n')
    (model / "1" / "model.json").write_text(json.dumps({
        "model": base, "enforce_eager": "true", "dtype": "float32", "max_model_len": 512,
        "max_num_seqs": 8, "enable_lora": "true", "max_lora_rank": 8, "max_loras": 1}))
    (model / "1" / "multi_lora.json").write_text(json.dumps(
        {"doll": str(_tiny_lora(base, root / "loras" / "doll"))}))
    embed = root / "repo" / EMBED  # vllm_backend's embedding model, as its docs write it
    (embed / "1").mkdir(parents=True)
    (embed / "config.pbtxt").write_text('backend: "omni_llm"\n'
                                        'instance_group [ { count: 1, kind: KIND_MODEL } ]\n')
    (embed / "1" / "model.json").write_text(json.dumps({
        "model": base, "runner": "pooling", "convert": "embed", "enforce_eager": "true",
        "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4}))
    return root / "repo"


@pytest.fixture(scope="module")
def compat(text_chat_server, tmp_path_factory):
    repo = _vllm_backend_repository(tmp_path_factory.mktemp("vllm-backend-repo"))
    with loaded(text_chat_server, repo, [(COMPAT, EMBED)]) as server:
        yield server


def test_a_vllm_backend_repository_loads_with_its_bare_config_completed(compat):
    with grpcclient.InferenceServerClient(compat.grpc_url) as client:
        assert client.is_model_ready(COMPAT)
        config = client.get_model_config(COMPAT, as_json=True)["config"]
    assert config["model_transaction_policy"]["decoupled"] is True
    assert config.get("max_batch_size", 0) == 0
    names = {t["name"] for t in config["input"]}
    assert {"text_input", "stream", "sampling_parameters", "exclude_input_in_output", "image",
            "embedding_request", *FLAGS} <= names
    assert names == {t.name for t in LLM_CONTRACT.inputs}  # all of ours, from the contract
    assert {"text_output", "finish_reason", "cumulative_logprob", "logprobs",
            "num_input_tokens", "num_output_tokens"} <= {t["name"] for t in config["output"]}


def test_a_lora_adapter_chosen_per_request_changes_the_output(compat):
    url = compat.grpc_url

    def say(**extra):
        sampling = {**GREEDY, "max_tokens": "12", **extra}
        responses = infer(url, COMPAT, _inputs(PROMPT, stream=False, sampling=sampling,
                                               exclude_input_in_output=True))
        assert all(e is None for _, e in responses), responses
        return text_of(responses)

    base, adapted = say(), say(lora_name="doll")
    assert adapted != base
    assert say(lora_name="doll") == adapted and say() == base  # deterministic, not a mix-up
    # as a request parameter, vllm_backend's other way to send it
    as_parameter = infer(url, COMPAT, _inputs(PROMPT, stream=False, sampling=None,
                                              exclude_input_in_output=True),
                         parameters={**GREEDY, "max_tokens": "12", "lora_name": "doll"})
    assert text_of(as_parameter) == adapted
    ((_, error),) = infer(url, COMPAT, _inputs(PROMPT, stream=False,
                                               sampling={**GREEDY, "lora_name": "sheep"}))
    assert error.message() == "LoRA sheep is not supported, we currently support ['doll']"


def _embedding_request(value) -> grpcclient.InferInput:
    t = grpcclient.InferInput("embedding_request", [1], "BYTES")
    t.set_data_from_numpy(np.array([json.dumps(value).encode()], dtype=object))
    return t


def _flag(name: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], "BOOL")
    t.set_data_from_numpy(np.array([True]))
    return t


def test_an_embedding_request_is_transformers_last_token_embedding_as_json(compat):
    """vllm_backend's embedding_request on a pooling model: text_output is the embedding as
    a JSON list, for text or token ids; with convert "embed" vLLM pools a causal LM's last
    token and normalises it, so it is transformers' last hidden state there, unit length."""
    from transformers import AutoModel

    base = ensure_model("qwen2-tiny")
    text = "The capital of France is"
    ids = AutoTokenizer.from_pretrained(base)(text).input_ids
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(base, dtype=torch.float32)(
            torch.tensor([ids])).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(hidden, dim=0).numpy()
    flags = [_flag("return_num_input_tokens"), _flag("return_num_output_tokens")]
    for what in (text, ids):
        ((result, error),) = infer(compat.grpc_url, EMBED, [_embedding_request({"input": what}),
                                                            *flags])
        assert error is None, error
        got = np.array(json.loads(result.as_numpy("text_output")[0]), dtype=np.float32)
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-4
        assert int(result.as_numpy("num_input_tokens")[0]) == len(ids)
        assert int(result.as_numpy("num_output_tokens")[0]) == 0


def test_each_task_a_model_cannot_serve_gets_vllm_backends_text(compat):
    ((_, error),) = infer(compat.grpc_url, COMPAT, [_embedding_request({"input": "hi"})])
    assert error.message() == f"Model {COMPAT} does not support 'embed' request"
    ((_, error),) = infer(compat.grpc_url, EMBED, _inputs(PROMPT, stream=False, sampling=GREEDY))
    assert error.message() == f"Model {EMBED} does not support 'generate' request"
    assert error_code(error) == "INVALID_ARG"


def _vllm_series(text: str, model: str) -> dict[str, float]:
    """vllm:* samples of `model` (histogram buckets left out), by series name."""
    found = {}
    for name, labels, value in re.findall(r"^(vllm:[a-z0-9_]+)\{([^}]*)\} (\S+)$", text, re.M):
        if f'model="{model}"' in labels and "le=" not in labels:
            assert 'version="1"' in labels, labels
            found[name] = float(value)
    return found


def test_vllm_metrics_appear_under_vllm_backends_names_and_count_the_requests(compat):
    prompts = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]
    before = _vllm_series(compat.metrics(), COMPAT)
    assert before, "REPORT_CUSTOM_METRICS is on: the vllm:* families exist from the start"
    prompt_tokens = generated = 0
    for prompt in prompts:
        responses = infer(compat.grpc_url, COMPAT, _inputs(
            prompt, stream=True, sampling=GREEDY, return_num_input_tokens=True,
            return_num_output_tokens=True))
        prompt_tokens += int(responses[0][0].as_numpy("num_input_tokens")[0])
        generated += sum(int(r.as_numpy("num_output_tokens")[0]) for r, _ in responses)
    assert generated == MAX_TOKENS * len(prompts)
    n = len(prompts)
    want = {"vllm:prompt_tokens_total": prompt_tokens, "vllm:generation_tokens_total": generated,
            "vllm:time_to_first_token_seconds_count": n,
            "vllm:time_per_output_token_seconds_count": generated - n,
            "vllm:e2e_request_latency_seconds_count": n,
            "vllm:request_prompt_tokens_count": n, "vllm:request_prompt_tokens_sum": prompt_tokens,
            "vllm:request_generation_tokens_count": n,
            "vllm:request_generation_tokens_sum": generated,
            "vllm:request_params_n_count": n, "vllm:request_params_n_sum": n}
    deadline = time.monotonic() + 20  # the stat logger reports once per engine step
    while True:
        now = _vllm_series(compat.metrics(), COMPAT)
        added = {k: now.get(k, 0) - before.get(k, 0) for k in want}
        if added == want or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert added == want
    text = compat.metrics()
    assert _vllm_series(text, "llm") == {}, "a model without REPORT_CUSTOM_METRICS reports none"
    assert f'omni_llm_generation_tokens_total{{model="{COMPAT}"}}' in text  # ours stay


def test_with_the_health_check_a_dead_engine_answers_vllm_backends_text_and_unloads(compat):
    # last in the module: it kills the model's engine (the module unloads it after)
    cores = [p for p in processes_of(compat, COMPAT) if "EngineCore" in " ".join(
        [p.name(), *p.cmdline()])]
    assert len(cores) == 1, cores
    os.kill(cores[0].pid, signal.SIGKILL)
    psutil.wait_procs(cores, timeout=10)
    deadline = time.monotonic() + 30
    while True:  # vLLM notices the dead core within moments; poll until a request says so
        responses = infer(compat.grpc_url, COMPAT, _inputs(PROMPT, stream=True, sampling=GREEDY))
        error = responses[-1][1]
        if error is not None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert error is not None and error.message() == UNHEALTHY
    with grpcclient.InferenceServerClient(compat.grpc_url) as client:
        deadline = time.monotonic() + 30
        while client.is_model_ready(COMPAT) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not client.is_model_ready(COMPAT), "explicit model control: it unloads itself"
        assert client.is_model_ready("llm")  # the server's own model serves on

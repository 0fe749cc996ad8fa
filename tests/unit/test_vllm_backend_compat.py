"""What omni_llm takes from Triton's vllm_backend, without a server: its request rules and
texts, its logprobs JSON, LoRA adapters from multi_lora.json, engine arguments from
model.json, and its vllm:* metric samples."""
from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from omni_serve.contract import LLM
from omni_serve.errors import RequestError, code_of_message
from omni_serve.llm import engine_args, logprobs
from omni_serve.llm.lora import LoraTable
from omni_serve.llm.metrics import vllm_backend_samples
from omni_serve.llm.request import EmbedRequest, parse_request
from omni_serve.metrics_table import VllmBackendMetrics, one_two_five

from .test_llm_request import tensors

STREAM_REFUSAL = ("Error generating stream: When streaming, `exclude_input_in_output` = "
                  "False is not allowed.")


# --- streaming and exclude_input_in_output -----------------------------------------
def test_streaming_with_the_prompt_in_the_output_is_refused_with_vllm_backends_text():
    with pytest.raises(RequestError) as e:
        parse_request("r", tensors(**{LLM.STREAM: True, LLM.EXCLUDE_INPUT_IN_OUTPUT: False}))
    assert str(e.value) == STREAM_REFUSAL and e.value.field == LLM.EXCLUDE_INPUT_IN_OUTPUT
    assert code_of_message(str(e.value)) == "INVALID_ARG"  # as a 2.51 gRPC stream shows it


@pytest.mark.parametrize("task", ["embed", "generate"])
def test_a_task_the_model_cannot_serve_is_invalid_arg_as_a_251_stream_shows_it(task):
    # llm/stage.py's refusal, vllm_backend's text: no "field: " prefix to read the code from
    assert code_of_message(f"Model llm does not support '{task}' request") == "INVALID_ARG"
    assert code_of_message(f"[StatusCode.INTERNAL] Model llm does not support '{task}' "
                           "request") == "INTERNAL"  # a status tag wins


@pytest.mark.parametrize("stream,exclude", [(True, True), (True, None), (False, False),
                                            (False, True), (False, None)])
def test_every_other_stream_and_exclude_combination_is_accepted(stream, exclude):
    extra = {LLM.STREAM: stream}
    if exclude is not None:
        extra[LLM.EXCLUDE_INPUT_IN_OUTPUT] = exclude
    req = parse_request("r", tensors(**extra))
    assert req.stream is stream and req.exclude_input_in_output is bool(exclude)


def test_the_new_return_flags_come_from_tensors_or_request_parameters():
    req = parse_request("r", tensors(**{LLM.RETURN_LOGPROBS: True}),
                        {"return_cumulative_logprob": "true", "logprobs": "2"})
    assert req.return_logprobs and req.return_cumulative_logprob
    assert req.sampling == {"logprobs": 2}


# --- LoRA ----------------------------------------------------------------------------
def test_lora_name_comes_from_the_tensor_else_the_parameters_and_leaves_sampling():
    req = parse_request("r", tensors(**{LLM.SAMPLING_PARAMETERS: json.dumps(
        {"lora_name": "doll", "temperature": "0"})}), {"lora_name": "sheep"})
    assert req.lora_name == "doll" and req.sampling == {"temperature": 0.0}
    assert parse_request("r", tensors(), {"lora_name": "sheep"}).lora_name == "sheep"
    with pytest.raises(RequestError, match=r"^parameters.lora_name: must be a non-empty"):
        parse_request("r", tensors(), {"lora_name": 3})


def test_a_lora_table_is_read_from_multi_lora_json_beside_the_engine_arguments(tmp_path):
    (tmp_path / "multi_lora.json").write_text(json.dumps({"doll": "/w/doll", "sheep": "sheep"}))
    table = LoraTable.load({"enable_lora": "true"}, str(tmp_path))
    assert table.names == ["doll", "sheep"]
    assert table.adapters["sheep"] == str(tmp_path / "sheep")  # relative to the file
    lora = table.request("sheep")
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("sheep", 2, str(tmp_path / "sheep"))
    assert table.request(None) is None
    with pytest.raises(RequestError) as e:
        table.check("goat")
    assert str(e.value) == "LoRA goat is not supported, we currently support ['doll', 'sheep']"
    assert code_of_message(str(e.value)) == "INVALID_ARG"


def test_lora_off_refuses_any_adapter_and_needs_no_file(tmp_path):
    table = LoraTable.load({"enable_lora": False}, str(tmp_path))
    table.check(None)
    with pytest.raises(RequestError) as e:
        table.check("doll")
    assert str(e.value) == "LoRA feature is not enabled."


def test_lora_on_without_multi_lora_json_fails_the_load_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="multi_lora.json: enable_lora is true"):
        LoraTable.load({"enable_lora": True}, str(tmp_path))
    (tmp_path / "multi_lora.json").write_text('["doll"]')
    with pytest.raises(ValueError, match="adapter name -> folder"):
        LoraTable.load({"enable_lora": True}, str(tmp_path))


# --- image and embedding_request -------------------------------------------------------
def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def test_images_are_base64_files_opened_as_rgb():
    b64 = base64.b64encode(_png())
    req = parse_request("r", {**tensors(), LLM.IMAGE: np.array([b64, b64], dtype=object)})
    assert [im.size for im in req.images] == [(4, 3), (4, 3)]
    assert all(im.mode == "RGB" for im in req.images)


def _huge_png() -> bytes:  # a header that announces 100000 x 2 pixels, over the side limit
    buf = io.BytesIO()
    Image.new("1", (100000, 2)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("value,msg", [
    (b"%%%", r"image\[0\]: must be base64"),
    (base64.b64encode(b"not an image"), r"image\[0\]: not a decodable image"),
    (base64.b64encode(_huge_png()), r"image\[0\]: image is 100000x2; width and height must "
                                    r"be between 1 and 8192 pixels"),
])
def test_a_bad_image_is_the_requests_error_naming_its_element(value, msg):
    with pytest.raises(RequestError, match=msg):
        parse_request("r", {**tensors(), LLM.IMAGE: np.array([value], dtype=object)})


def test_audio_files_are_kept_raw_and_decoded_at_the_models_rate():
    import soundfile as sf

    from omni_serve.llm.request import decode_audio_files

    buf = io.BytesIO()
    sf.write(buf, np.zeros((4410, 2), np.float32), 44100, format="WAV")
    req = parse_request("r", {**tensors(), LLM.AUDIO: np.array([buf.getvalue()], dtype=object)})
    (samples,) = decode_audio_files(req.audios, 16000)
    assert samples.shape == (1600,) and samples.dtype == np.float32
    with pytest.raises(RequestError, match=r"^audio\[0\]: not a decodable audio file"):
        decode_audio_files([b"RIFF nonsense"], 16000)
    with pytest.raises(RequestError, match=r"^audio\[0\]: is empty"):
        parse_request("r", {**tensors(), LLM.AUDIO: np.array([b""], dtype=object)})


def test_an_embedding_request_needs_no_prompt():
    body = json.dumps({"input": [1, 2, 3], "pooling_params": {"dimensions": [8]}})
    req = parse_request("r", {LLM.EMBEDDING_REQUEST: np.array([body.encode()], dtype=object)})
    assert req.embed == EmbedRequest([1, 2, 3], 8) and req.prompt is None


@pytest.mark.parametrize("body,field", [
    ("{", "embedding_request"), ('{"x": 1}', "embedding_request"),
    ('{"input": ""}', "embedding_request.input"), ('{"input": [-1]}', "embedding_request.input"),
    ('{"input": "a", "pooling_params": {"dimensions": [0]}}',
     "embedding_request.pooling_params.dimensions"),
])
def test_a_bad_embedding_request_names_its_field(body, field):
    with pytest.raises(RequestError) as e:
        parse_request("r", {LLM.EMBEDDING_REQUEST: np.array([body.encode()], dtype=object)})
    assert e.value.field == field


# --- logprobs JSON -----------------------------------------------------------------------
def test_logprobs_json_is_vllm_backends_layout():
    vllm_like = [{7: SimpleNamespace(logprob=-0.25, rank=1, decoded_token=" a"),
                  9: SimpleNamespace(logprob=-2.0, rank=2, decoded_token="b")}]
    doc = json.loads(logprobs.to_json(logprobs.collect(vllm_like)))
    assert doc == [{"7": {"logprob": -0.25, "rank": 1, "decoded_token": " a"},
                    "9": {"logprob": -2.0, "rank": 2, "decoded_token": "b"}}]
    assert logprobs.to_json(logprobs.collect(None)) == "null"


# --- model.json ------------------------------------------------------------------------------
def test_engine_arguments_come_from_engine_json_or_a_vllm_backend_model_json(tmp_path):
    (tmp_path / "1").mkdir()
    with pytest.raises(FileNotFoundError, match="1/model.json"):
        engine_args.read(str(tmp_path), "1")
    (tmp_path / "1" / "model.json").write_text(json.dumps(
        {"model": "m", "enforce_eager": "true", "enable_lora": "false", "max_lora_rank": 8}))
    args, where = engine_args.read(str(tmp_path), "1")
    assert args == {"model": "m", "enforce_eager": True, "enable_lora": False, "max_lora_rank": 8}
    assert where == str(tmp_path / "1")
    (tmp_path / "engine.json").write_text("{}")
    with pytest.raises(ValueError, match="keep one"):
        engine_args.read(str(tmp_path), "1")


def test_a_string_that_is_no_boolean_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="enforce_eager: must be true or false"):
        engine_args.string_booleans({"enforce_eager": "maybe"}, {"enforce_eager"})


# --- vllm:* metrics ------------------------------------------------------------------------------
def test_one_step_becomes_vllm_backends_samples():
    finished = [SimpleNamespace(e2e_latency=0.5, num_prompt_tokens=6, num_generation_tokens=4)]
    step = SimpleNamespace(num_prompt_tokens=6, num_generation_tokens=1, finished_requests=finished,
                           time_to_first_tokens_iter=[], inter_token_latencies_iter=[0.01],
                           n_params_iter=[])
    m = VllmBackendMetrics
    assert dict((s.name, v) for s, v in vllm_backend_samples(step)) == {
        m.PROMPT_TOKENS.name: [6], m.GENERATION_TOKENS.name: [1],
        m.TIME_PER_OUTPUT_TOKEN.name: [0.01], m.E2E_REQUEST_LATENCY.name: [0.5],
        m.REQUEST_PROMPT_TOKENS.name: [6], m.REQUEST_GENERATION_TOKENS.name: [4]}
    assert {s.labels for s in m.ALL} == {("model", "version")}


def test_token_histogram_buckets_are_1_2_5_up_to_the_model_length():
    assert one_two_five(128) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def test_structured_outputs_may_come_json_encoded_as_vllm_backend_sends_them():
    from omni_serve.llm import sampling

    as_string = sampling.coerce({"structured_outputs": '{"choice": ["a", "b"]}'})
    as_object = sampling.coerce({"structured_outputs": {"choice": ["a", "b"]}})
    assert as_string == as_object and as_object["structured_outputs"].choice == ["a", "b"]
    with pytest.raises(RequestError, match=r"^sampling_parameters.structured_outputs: a string"):
        sampling.coerce({"structured_outputs": "{"})


@pytest.mark.parametrize(("args", "kind", "refused"), [
    ({"tensor_parallel_size": 2}, "GPU", True), ({"pipeline_parallel_size": "2"}, "GPU", True),
    ({"tensor_parallel_size": 2}, "MODEL", False), ({"tensor_parallel_size": 1}, "GPU", False),
    ({}, "CPU", False),
])
def test_a_multi_gpu_engine_in_a_kind_gpu_instance_is_refused_with_vllm_backends_text(
        args, kind, refused):
    if refused:
        with pytest.raises(ValueError, match="^KIND_GPU is currently for single-GPU models, "
                                             "please specify KIND_MODEL"):
            engine_args.check_instance_kind(args, kind)
    else:
        engine_args.check_instance_kind(args, kind)

"""omni_client's pipeline calls without a server: tensors, events, media, retries, the CLI.

Responses are real tritonclient `InferResult`s built from protobuf (as in
test_client.py), so parsing runs the library's own code; the network side is
a fake tritonclient (injected through `client_factory`) or, for the CLI, a
fake `OmniClient` patched into omni_client.cli.
"""
from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.grpc import service_pb2
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
)

from omni_client import (
    AudioChunk,
    BadRequestError,
    ChatResult,
    Final,
    ImageOutput,
    ModelInfo,
    OmniClient,
    RequestTimeoutError,
    ServerError,
    SpeechResult,
    TextDelta,
    UnavailableError,
    Usage,
    _calls,
    cli,
)
from omni_client import _pipeline_io as pio
from omni_client.media import audio_bytes, image_bytes
from omni_serve.contract import DIT, DIT_CONTRACT, LLM, OMNI, OMNI_CONTRACT, StageContract
from tests.wav_check import assert_pcm16_wav

from .test_client import STREAMED, FakeTritonClient, sent_values

# --- helpers -----------------------------------------------------------------------------


def infer_result(contract: StageContract, values: dict[str, Any], *, final: bool = False,
                 model: str = "omni") -> grpcclient.InferResult:
    """One response of a `contract` model carrying `values` (numpy arrays by output name)."""
    response = service_pb2.ModelInferResponse(model_name=model, id="r")
    for name, array in values.items():
        spec = contract.output(name)
        array = np.asarray(array, dtype=spec.np_dtype)
        response.outputs.add(name=name, datatype=spec.wire_dtype, shape=list(array.shape))
        raw = (serialize_byte_tensor(array).item() if spec.wire_dtype == "BYTES"
               else array.tobytes())
        response.raw_output_contents.append(raw)
    if final:
        response.parameters["triton_final_response"].bool_param = True
    return grpcclient.InferResult(response)


def tensor_values(tensors: list[grpcclient.InferInput]) -> dict[str, np.ndarray]:
    """Decode input tensors into {name: numpy array of their shape}."""
    out = {}
    for tensor in tensors:
        raw = tensor._get_content()
        if tensor.datatype() == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            dtype = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32,
                     "BOOL": np.bool_}[tensor.datatype()]
            array = np.frombuffer(raw, dtype=dtype)
        out[tensor.name()] = array.reshape(tensor.shape())
    return out


def png_bytes(width: int = 8, height: int = 6, color=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def tone(n: int = 2400, rate: int = 24000) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / rate)).astype(np.float32)


OMNI_CONFIG = {"backend": "omni_orchestrator", "max_batch_size": 0}
LLM_CONFIG = {"backend": "omni_llm", "max_batch_size": 0}
DIT_CONFIG = {"backend": "omni_dit", "max_batch_size": 8}


# --- _pipeline_io: omni request tensors ----------------------------------------------------


def test_omni_inputs_carry_every_field_with_the_contract_dtype_and_shape():
    tensors = pio.omni_inputs(
        "héllo", image=b"\x89PNG...", audio=b"RIFF...", modalities=["text", "audio"],
        sampling_parameters={"max_tokens": 4, "temperature": 0}, voice="Ethan", seed=7,
        task="chat", extra={OMNI.SESSION_ID: "s-1"})

    by_name = {t.name(): t for t in tensors}
    assert set(by_name) == {OMNI.TEXT_INPUT, OMNI.IMAGE, OMNI.AUDIO, OMNI.MODALITIES,
                            OMNI.SAMPLING_PARAMETERS, OMNI.VOICE, OMNI.SEED, OMNI.TASK,
                            OMNI.SESSION_ID}
    for name, tensor in by_name.items():
        assert tensor.datatype() == OMNI_CONTRACT.input(name).wire_dtype
        assert tensor.shape() == ([2] if name == OMNI.MODALITIES else [1])  # no batch dim
    values = tensor_values(tensors)
    assert values[OMNI.TEXT_INPUT][0].decode() == "héllo"
    assert values[OMNI.IMAGE][0] == b"\x89PNG..."
    assert values[OMNI.AUDIO][0] == b"RIFF..."
    assert [m.decode() for m in values[OMNI.MODALITIES]] == ["text", "audio"]
    assert json.loads(values[OMNI.SAMPLING_PARAMETERS][0]) == {"max_tokens": 4, "temperature": 0}
    assert values[OMNI.VOICE][0] == b"Ethan"
    assert values[OMNI.SEED].dtype == np.int64 and values[OMNI.SEED][0] == 7
    assert values[OMNI.TASK][0] == b"chat"
    assert values[OMNI.SESSION_ID][0] == b"s-1"


def test_omni_inputs_leave_out_what_was_not_given():
    tensors = pio.omni_inputs("hi", sampling_parameters={})

    assert [t.name() for t in tensors] == [OMNI.TEXT_INPUT]


def test_an_unknown_extra_input_is_a_bad_request_naming_it():
    with pytest.raises(BadRequestError, match="unknown omni input 'voice_id'") as caught:
        pio.omni_inputs("hi", extra={"voice_id": "x"})
    assert OMNI.SESSION_ID in str(caught.value)  # and it lists the contract's names


def test_modalities_as_a_bare_string_is_rejected():
    with pytest.raises(BadRequestError, match="modalities must be a list"):
        pio.omni_inputs("hi", modalities="audio")


def test_the_omni_text_must_be_a_string():
    with pytest.raises(BadRequestError, match="text must be a str"):
        pio.omni_inputs(b"hi")


def test_unencodable_omni_sampling_parameters_are_a_bad_request():
    with pytest.raises(BadRequestError, match="JSON"):
        pio.omni_inputs("hi", sampling_parameters={"stop": {"a"}})


# --- _pipeline_io: omni responses ------------------------------------------------------------


def test_a_text_response_is_one_text_delta():
    result = infer_result(OMNI_CONTRACT, {OMNI.TEXT_OUTPUT: np.array(["Hi ".encode()], object)})

    assert pio.parse_omni(result) == [TextDelta("Hi ")]


def test_an_audio_response_is_a_float32_chunk_with_its_rate():
    samples = tone(480)
    result = infer_result(OMNI_CONTRACT, {OMNI.AUDIO_CHUNK: samples,
                                          OMNI.SAMPLE_RATE: np.array([24000], np.int32)})

    (chunk,) = pio.parse_omni(result)
    assert isinstance(chunk, AudioChunk)
    assert chunk.samples.dtype == np.float32 and chunk.samples.shape == (480,)
    np.testing.assert_array_equal(chunk.samples, samples)
    assert chunk.sample_rate == 24000
    assert chunk.duration_s == pytest.approx(0.02)


def test_an_image_response_is_the_png():
    png = png_bytes()
    result = infer_result(OMNI_CONTRACT, {OMNI.IMAGE_OUTPUT: np.array([png], object)})

    (image,) = pio.parse_omni(result)
    assert image == ImageOutput(png)
    assert image.to_pil().size == (8, 6)


def test_the_final_response_gives_finish_reason_metrics_and_usage():
    metrics = {"total_s": 1.5, "time_to_first_token_s": 0.1,
               "usage": {"prompt_tokens": 12, "completion_tokens": 16}}
    result = infer_result(OMNI_CONTRACT, {
        OMNI.FINISH_REASON: np.array([b"length"], object),
        OMNI.METRICS: np.array([json.dumps(metrics).encode()], object)}, final=True)

    (final,) = pio.parse_omni(result)
    assert final == Final("length", Usage(12, 16), metrics)
    assert final.usage.total_tokens == 28


def test_a_merged_response_yields_text_audio_image_then_final_in_that_order():
    result = infer_result(OMNI_CONTRACT, {
        OMNI.TEXT_OUTPUT: np.array([b"end."], object),
        OMNI.AUDIO_CHUNK: tone(10), OMNI.SAMPLE_RATE: np.array([24000], np.int32),
        OMNI.IMAGE_OUTPUT: np.array([png_bytes()], object),
        OMNI.FINISH_REASON: np.array([b"stop"], object),
        OMNI.METRICS: np.array([b"{}"], object)}, final=True)

    kinds = [type(e) for e in pio.parse_omni(result)]
    assert kinds == [TextDelta, AudioChunk, ImageOutput, Final]


def test_a_final_without_usage_or_reason_gives_none():
    result = infer_result(OMNI_CONTRACT, {OMNI.FINISH_REASON: np.array([b""], object),
                                          OMNI.METRICS: np.array([b'{"total_s": 1}'], object)})

    (final,) = pio.parse_omni(result)
    assert final.finish_reason is None and final.usage is None
    assert final.metrics == {"total_s": 1}


def test_an_empty_final_response_yields_nothing():
    assert pio.parse_omni(infer_result(OMNI_CONTRACT, {}, final=True)) == []


def test_llm_final_takes_the_last_reason_and_counts():
    # each delta counts the tokens it adds (vllm_backend's num_output_tokens): they add up
    deltas = [TextDelta("a", None, 5, 1), TextDelta("b", "length", 5, 2), TextDelta("")]

    assert pio.llm_final(deltas) == Final("length", Usage(5, 3))
    assert pio.llm_final([TextDelta("a")]) == Final(None, None)


def test_image_inputs_carry_a_batch_dimension_and_the_contract_dtypes():
    tensors = pio.image_inputs("a fox", width=64, height=32, steps=3, guidance_scale=2.5,
                               negative_prompt="blur", seed=9, step_cache=False)

    for tensor in tensors:
        assert tensor.shape() == [1, 1]
        assert tensor.datatype() == DIT_CONTRACT.input(tensor.name()).wire_dtype
    values = tensor_values(tensors)
    assert values[DIT.PROMPT][0, 0] == b"a fox"
    assert (values[DIT.WIDTH][0, 0], values[DIT.HEIGHT][0, 0]) == (64, 32)
    assert values[DIT.SEED][0, 0] == 9 and values[DIT.GUIDANCE_SCALE][0, 0] == 2.5
    assert values[DIT.STEP_CACHE][0, 0] == np.False_


# --- _calls: what each kind of model gets --------------------------------------------------------


@pytest.mark.parametrize(("config", "kind"), [
    (OMNI_CONFIG, "omni"), (LLM_CONFIG, "llm"), ({"backend": "vllm"}, "llm"), (DIT_CONFIG, "image"),
    ({"backend": "omni_encoder"}, None), ({"backend": "omni_audio"}, None), ({}, None),
])
def test_the_model_kind_comes_from_the_backend(config, kind):
    assert pio.model_kind(config) == kind
    info = _calls.model_info("m", config)
    assert (info is None) if kind is None else (info == ModelInfo("m", kind, config["backend"]))


def test_an_omni_model_gets_the_omni_tensors_streamed():
    prepared = _calls.prepare_stream("omni", OMNI_CONFIG, "hi", image=png_bytes(),
                                     audio=(tone(), 24000), modalities=["text", "audio"],
                                     max_tokens=5, temperature=0, voice="Ethan", seed=3)

    assert prepared.model == "omni" and not prepared.unary
    values = tensor_values(prepared.inputs)
    assert json.loads(values[OMNI.SAMPLING_PARAMETERS][0]) == {"max_tokens": 5, "temperature": 0}
    assert Image.open(io.BytesIO(values[OMNI.IMAGE][0])).size == (8, 6)
    samples, rate = sf.read(io.BytesIO(values[OMNI.AUDIO][0]), dtype="float32")
    assert rate == 24000 and samples.shape == (2400,)
    # codec_ids only when asked for (a server before it would refuse the request)
    assert {o.name() for o in prepared.outputs} == {s.name for s in OMNI_CONTRACT.outputs
                                                    if s.name != OMNI.CODEC_IDS}
    assert prepared.parse(infer_result(OMNI_CONTRACT, {
        OMNI.TEXT_OUTPUT: np.array([b"x"], object)})) == [TextDelta("x")]
    assert prepared.finish() == []  # the orchestrator sends its own final


def test_an_llm_model_gets_the_llm_tensors_and_a_final_from_its_deltas():
    prepared = _calls.prepare_stream("llm", LLM_CONFIG, "hi", modalities=["text"], max_tokens=3)

    assert not prepared.unary
    values = tensor_values(prepared.inputs)
    assert values[LLM.TEXT_INPUT][0] == b"hi" and values[LLM.STREAM][0]
    assert json.loads(values[LLM.SAMPLING_PARAMETERS][0]) == {"max_tokens": 3}
    events = [e for result, _ in STREAMED for e in prepared.parse(result)]
    assert [e.text for e in events] == ["Hel", "lo", "!"]
    assert prepared.finish() == [Final("stop", Usage(3, 3))]  # three responses of one token


def test_an_llm_model_refuses_media_and_voice_naming_them():
    with pytest.raises(BadRequestError) as caught:
        _calls.prepare_stream("llm", LLM_CONFIG, "hi", image=b"png", audio=b"wav", voice="Ethan")

    message = str(caught.value)
    assert "'llm' is a llm model" in message
    for name in ("image", "audio", "voice"):
        assert name in message


@pytest.mark.parametrize("kwargs", [dict(seed=1), dict(task="speech"),
                                    dict(inputs={"session_id": "s"}),
                                    dict(modalities=["text", "audio"])])
def test_an_llm_model_refuses_what_only_pipelines_take(kwargs):
    with pytest.raises(BadRequestError, match="llm model"):
        _calls.prepare_stream("llm", LLM_CONFIG, "hi", **kwargs)


def test_an_image_model_is_called_unary_with_a_batch_dimension():
    prepared = _calls.prepare_stream("text_to_image", DIT_CONFIG, "a fox", seed=4,
                                     modalities=["image"])

    assert prepared.unary
    assert all(t.shape() == [1, 1] for t in prepared.inputs)
    assert tensor_values(prepared.inputs)[DIT.SEED][0, 0] == 4
    png = png_bytes()
    result = infer_result(DIT_CONTRACT, {DIT.IMAGE: np.array([[png]], object)},
                          model="text_to_image")
    assert prepared.parse(result) == [ImageOutput(png)]
    assert prepared.finish() == [Final(None)]


@pytest.mark.parametrize("kwargs", [dict(max_tokens=3), dict(audio=b"wav"),
                                    dict(modalities=["text"])])
def test_an_image_model_refuses_llm_and_media_arguments(kwargs):
    with pytest.raises(BadRequestError, match="image model"):
        _calls.prepare_stream("text_to_image", DIT_CONFIG, "a fox", **kwargs)


def test_a_model_that_is_not_an_entry_model_is_rejected():
    with pytest.raises(BadRequestError,
                       match=r"'image_encoder' \(backend 'omni_encoder'\) is not an entry model"):
        _calls.prepare_stream("image_encoder", {"backend": "omni_encoder"}, "hi")


def test_prepare_image_sends_every_field():
    prepared = _calls.prepare_image("t2i", "a fox", width=32, height=48, steps=2, seed=1)

    values = tensor_values(prepared.inputs)
    assert (values[DIT.WIDTH][0, 0], values[DIT.HEIGHT][0, 0]) == (32, 48)
    assert values[DIT.NUM_INFERENCE_STEPS][0, 0] == 2
    assert prepared.unary and [o.name() for o in prepared.outputs] == [DIT.IMAGE]


def test_speech_result_needs_audio():
    assert _calls.speech_result(ChatResult("", tone(10), 24000)).sample_rate == 24000
    with pytest.raises(ServerError, match="without sending audio"):
        _calls.speech_result(ChatResult("", finish_reason="stop"))


# --- media ---------------------------------------------------------------------------------------


def test_image_inputs_may_be_a_path_bytes_or_a_pil_image(tmp_path):
    png = png_bytes()
    path = tmp_path / "in.png"
    path.write_bytes(png)

    assert image_bytes(str(path)) == png
    assert image_bytes(path) == png
    assert image_bytes(png) == png
    assert image_bytes(bytearray(png)) == png
    assert image_bytes(memoryview(png)) == png
    from_pil = image_bytes(Image.new("RGB", (5, 4), (0, 255, 0)))
    assert Image.open(io.BytesIO(from_pil)).format == "PNG"
    assert Image.open(io.BytesIO(from_pil)).size == (5, 4)


def test_an_unreadable_path_names_the_field_and_the_path(tmp_path):
    missing = tmp_path / "nope.png"

    with pytest.raises(BadRequestError, match=r"^image: cannot read .*nope\.png"):
        image_bytes(missing)
    with pytest.raises(BadRequestError, match=r"^audio: cannot read .*nope\.png"):
        audio_bytes(missing)
    with pytest.raises(BadRequestError, match=r"^--image: cannot read"):
        image_bytes(str(missing), field="--image")


@pytest.mark.parametrize("value", [b"", 42, np.zeros(3)])
def test_empty_or_unsupported_images_are_rejected(value):
    with pytest.raises(BadRequestError, match="^image: "):
        image_bytes(value)


def test_audio_inputs_may_be_a_path_bytes_samples_with_their_rate_or_a_pair(tmp_path):
    samples = tone(1600, rate=16000)
    path = tmp_path / "in.flac"
    sf.write(path, samples, 16000)

    assert audio_bytes(path) == path.read_bytes()
    assert audio_bytes(path.read_bytes()) == path.read_bytes()
    for data in (audio_bytes(samples, sample_rate=16000), audio_bytes((samples, 16000))):
        back, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == 16000
        np.testing.assert_allclose(back, samples, atol=1e-6)


def test_numpy_audio_without_a_sample_rate_is_rejected():
    with pytest.raises(BadRequestError, match="sample_rate"):
        audio_bytes(tone())


@pytest.mark.parametrize("value", [(tone(),), (tone(), 16000, "x"), b"", 3.5])
def test_malformed_audio_inputs_are_rejected(value):
    with pytest.raises(BadRequestError, match="^audio: "):
        audio_bytes(value)


# --- ChatResult ----------------------------------------------------------------------------------


def test_chat_result_gathers_a_stream():
    a, b = tone(100), tone(50)
    events = [TextDelta("Hel"), AudioChunk(a, 24000), TextDelta("lo"), ImageOutput(b"png1"),
              AudioChunk(b, 24000), Final("length", Usage(4, 2), {"total_s": 1.0})]

    result = ChatResult.from_events(events)

    assert result.text == "Hello"
    np.testing.assert_array_equal(result.audio, np.concatenate([a, b]))
    assert result.audio.dtype == np.float32 and result.sample_rate == 24000
    assert result.images == [b"png1"]
    assert (result.finish_reason, result.usage, result.metrics) == (
        "length", Usage(4, 2), {"total_s": 1.0})


def test_a_text_only_chat_result_has_no_audio_and_cannot_save_it(tmp_path):
    result = ChatResult.from_events(iter([TextDelta("hi"), Final("stop")]))

    assert result.audio is None and result.sample_rate is None and result.images == []
    with pytest.raises(ValueError, match="no audio"):
        result.save_audio(tmp_path / "x.wav")


# --- OmniClient over a fake tritonclient: pipelines and retries ----------------------------------


class FakeServer(FakeTritonClient):
    """A fake tritonclient that also answers the control calls (index, configs, unary infer)."""

    def __init__(self, events=None, *, configs: dict[str, dict] | None = None) -> None:
        super().__init__(events)
        self.configs = configs or {"omni": OMNI_CONFIG, "llm": LLM_CONFIG,
                                   "text_to_image": DIT_CONFIG,
                                   "image_encoder": {"backend": "omni_encoder"}}
        self.failures: dict[str, list[Exception]] = {}
        self.calls: list[str] = []
        self.infer_result: grpcclient.InferResult | None = None
        self.infer_requests: list[dict[str, Any]] = []

    def _maybe_fail(self, call: str) -> None:
        self.calls.append(call)
        pending = self.failures.get(call)
        if pending:
            raise pending.pop(0)

    def get_model_repository_index(self, headers=None, as_json=False, client_timeout=None):
        self._maybe_fail("index")
        return {"models": [{"name": n, "version": "1", "state": "READY"} for n in self.configs]
                + [{"name": "broken", "version": "1", "state": "UNAVAILABLE"}]}

    def get_model_config(self, model_name, model_version="", headers=None, as_json=False,
                         client_timeout=None):
        self._maybe_fail("config")
        if model_name not in self.configs:
            raise InferenceServerException(f"Request for unknown model: '{model_name}' is not found",
                                           status="StatusCode.NOT_FOUND")
        return {"config": {"name": model_name, **self.configs[model_name]}}

    def infer(self, model_name, inputs, **kwargs):
        self._maybe_fail("infer")
        self.infer_requests.append({"model_name": model_name, "inputs": inputs, **kwargs})
        return self.infer_result

    def async_stream_infer(self, model_name, inputs, **kwargs) -> None:
        self.calls.append("stream")
        super().async_stream_infer(model_name, inputs, **kwargs)


def unavailable() -> InferenceServerException:
    return InferenceServerException("failed to connect to all addresses",
                                    status="StatusCode.UNAVAILABLE")


def client_over(fake: FakeServer, **kwargs: Any) -> OmniClient:
    kwargs.setdefault("timeout", 2.0)
    kwargs.setdefault("retry_backoff_s", 0.0)
    return OmniClient("triton:8001", client_factory=lambda url, verbose: fake, **kwargs)


OMNI_STREAM = [
    (infer_result(OMNI_CONTRACT, {OMNI.TEXT_OUTPUT: np.array([b"Hi"], object)}), None),
    (infer_result(OMNI_CONTRACT, {OMNI.AUDIO_CHUNK: tone(240),
                                  OMNI.SAMPLE_RATE: np.array([24000], np.int32)}), None),
    (infer_result(OMNI_CONTRACT, {OMNI.TEXT_OUTPUT: np.array([b" there"], object),
                                  OMNI.AUDIO_CHUNK: tone(120),
                                  OMNI.SAMPLE_RATE: np.array([24000], np.int32)}), None),
    (infer_result(OMNI_CONTRACT, {
        OMNI.FINISH_REASON: np.array([b"length"], object),
        OMNI.METRICS: np.array([b'{"usage": {"prompt_tokens": 9, "completion_tokens": 2}}'],
                               object)}, final=True), None),
]


def test_list_models_lists_the_ready_entry_models_with_their_kind():
    client = client_over(FakeServer())

    assert client.list_models() == [ModelInfo("omni", "omni", "omni_orchestrator"),
                                    ModelInfo("llm", "llm", "omni_llm"),
                                    ModelInfo("text_to_image", "image", "omni_dit")]


def test_stream_defaults_to_the_omni_pipeline_and_yields_typed_events_then_final():
    fake = FakeServer(OMNI_STREAM)
    client = client_over(fake)

    events = list(client.stream("hi", modalities=["text", "audio"]))

    assert fake.requests[0]["model_name"] == "omni"
    assert [type(e) for e in events] == [TextDelta, AudioChunk, TextDelta, AudioChunk, Final]
    assert events[-1] == Final("length", Usage(9, 2), {"usage": {"prompt_tokens": 9,
                                                                 "completion_tokens": 2}})
    reply = client.chat("hi", modalities=["text", "audio"])
    assert reply.text == "Hi there" and reply.audio.size == 360 and reply.usage == Usage(9, 2)


def test_speech_asks_the_pipeline_to_read_aloud():
    fake = FakeServer(OMNI_STREAM)

    speech = client_over(fake).speech("read this", voice="Ethan", seed=2)

    values = tensor_values(fake.requests[0]["inputs"])
    assert values[OMNI.TASK][0] == b"speech" and values[OMNI.VOICE][0] == b"Ethan"
    assert speech.sample_rate == 24000 and speech.samples.size == 360


def test_generate_image_calls_the_dit_model_unary():
    fake = FakeServer()
    png = png_bytes(16, 8)
    fake.infer_result = infer_result(DIT_CONTRACT, {DIT.IMAGE: np.array([[png]], object)})

    image = client_over(fake).generate_image("a fox", width=16, height=8, seed=5)

    assert image == ImageOutput(png)
    request = fake.infer_requests[0]
    assert request["model_name"] == "text_to_image"
    assert tensor_values(request["inputs"])[DIT.SEED][0, 0] == 5


@pytest.mark.parametrize("failures", [1, 2])
def test_list_models_is_retried_on_unavailable(failures):
    fake = FakeServer()
    fake.failures["index"] = [unavailable() for _ in range(failures)]
    client = client_over(fake, retries=2)

    assert len(client.list_models()) == 3
    assert fake.calls.count("index") == failures + 1


def test_list_models_gives_up_after_the_retries():
    fake = FakeServer()
    fake.failures["index"] = [unavailable() for _ in range(5)]
    client = client_over(fake, retries=2)

    with pytest.raises(UnavailableError):
        client.list_models()
    assert fake.calls.count("index") == 3


def test_retries_back_off_exponentially():
    fake = FakeServer()
    fake.failures["index"] = [unavailable(), unavailable()]
    client = client_over(fake, retries=2, retry_backoff_s=0.05)

    started = time.monotonic()
    client.list_models()
    assert time.monotonic() - started >= 0.05 + 0.1 - 0.01


def test_generate_image_is_retried_on_unavailable():
    fake = FakeServer()
    fake.infer_result = infer_result(DIT_CONTRACT, {DIT.IMAGE: np.array([[png_bytes()]], object)})
    fake.failures["infer"] = [unavailable(), unavailable()]

    client_over(fake, retries=2).generate_image("x", model="text_to_image", seed=1)

    assert fake.calls.count("infer") == 3


def test_other_errors_are_not_retried():
    fake = FakeServer()
    fake.failures["infer"] = [InferenceServerException("height: too big",
                                                       status="StatusCode.INVALID_ARGUMENT")]

    with pytest.raises(BadRequestError, match="height"):
        client_over(fake, retries=2).generate_image("x", model="text_to_image")
    assert fake.calls.count("infer") == 1


def test_a_stream_is_never_retried():
    fake = FakeServer([(None, unavailable())])

    with pytest.raises(UnavailableError):
        list(client_over(fake, retries=3).stream("hi", model="omni"))
    assert fake.calls.count("stream") == 1


def test_zero_retries_means_one_attempt():
    fake = FakeServer()
    fake.failures["index"] = [unavailable()]

    with pytest.raises(UnavailableError):
        client_over(fake, retries=0).list_models()
    assert fake.calls.count("index") == 1


@pytest.mark.parametrize("retries", [-1, 1.5])
def test_bad_retry_counts_are_rejected(retries):
    with pytest.raises(ValueError, match="retries"):
        OmniClient(retries=retries)


def test_a_silent_pipeline_times_out_naming_the_model_it_called():
    fake = FakeServer([])

    with pytest.raises(RequestTimeoutError, match="no response from model 'omni' within 0.05s"):
        list(client_over(fake, timeout=0.05).stream("hi", model="omni"))
    assert fake.stop_calls == [True]


def test_a_chat_for_an_llm_model_goes_as_messages_for_its_chat_template():
    fake = FakeServer(STREAMED)
    earlier = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello"}]

    list(client_over(fake).stream("and then?", model="llm", history=earlier))
    list(client_over(fake).stream("plain prompt", model="llm"))

    chat, plain = (sent_values(r) for r in fake.requests)
    assert LLM.TEXT_INPUT not in chat
    assert json.loads(chat[LLM.MESSAGES]) == [*earlier, {"role": "user", "content": "and then?"}]
    assert plain[LLM.TEXT_INPUT] == "plain prompt" and LLM.MESSAGES not in plain


def test_a_bad_argument_for_the_model_kind_is_raised_before_anything_is_sent():
    fake = FakeServer(STREAMED)

    with pytest.raises(BadRequestError, match="voice"):
        client_over(fake).stream("hi", model="llm", voice="Ethan")
    assert "stream" not in fake.calls


# --- the CLI -------------------------------------------------------------------------------------


class FakeOmniClient:
    """Stands in for OmniClient in omni_client.cli: records calls, returns scripted results."""

    instances: list[FakeOmniClient] = []
    events: list = []
    error: Exception | None = None
    delay_s: float = 0.0

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.url, self.kwargs = url, kwargs
        self.calls: list[tuple[str, tuple, dict]] = []
        self.closed = False
        self.stream_closed = False
        FakeOmniClient.instances.append(self)

    def __enter__(self) -> FakeOmniClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error

    def stream(self, text: str, **kwargs: Any) -> Iterator:
        self._record("stream", text, **kwargs)

        def events():
            try:
                yield from self.events
            finally:
                self.stream_closed = True
        return events()

    def speech(self, text: str, **kwargs: Any) -> SpeechResult:
        self._record("speech", text, **kwargs)
        return SpeechResult(tone(4800), 24000)

    def generate_image(self, prompt: str, **kwargs: Any) -> ImageOutput:
        self._record("generate_image", prompt, **kwargs)
        return ImageOutput(png_bytes(16, 8))

    def list_models(self) -> list[ModelInfo]:
        self._record("list_models")
        talker = SimpleNamespace(name="talker", kind="llm", backend="omni_llm", internal=True)
        return [ModelInfo("omni", "omni", "omni_orchestrator"), ModelInfo("llm", "llm", "omni_llm"),
                talker, ModelInfo("text_to_image", "image", "omni_dit")]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


CHAT_EVENTS = [TextDelta("Hello"), AudioChunk(tone(2400), 24000), TextDelta(" world"),
               AudioChunk(tone(1200), 24000), Final("length", Usage(7, 3), {})]


@pytest.fixture
def fake_client(monkeypatch):
    monkeypatch.setattr(FakeOmniClient, "instances", [])
    monkeypatch.setattr(FakeOmniClient, "events", list(CHAT_EVENTS))
    monkeypatch.setattr(FakeOmniClient, "error", None)
    monkeypatch.setattr(FakeOmniClient, "delay_s", 0.0)
    monkeypatch.setattr(cli, "OmniClient", FakeOmniClient)
    monkeypatch.delenv("OMNI_URL", raising=False)
    return FakeOmniClient


def run_cli(*argv: str, out: io.StringIO | None = None,
            err: io.StringIO | None = None) -> tuple[int, str, str]:
    out = out if out is not None else io.StringIO()
    err = err if err is not None else io.StringIO()
    code = cli.main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_chat_streams_the_text_to_stdout_and_a_summary_to_stderr(fake_client):
    code, out, err = run_cli("chat", "hi there", "--max-tokens", "3", "--temperature", "0",
                             "--seed", "5", "--model", "omni")

    assert code == 0
    assert out == "Hello world\n"
    (client,) = fake_client.instances
    (name, args, kwargs), = client.calls
    assert (name, args) == ("stream", ("hi there",))
    assert kwargs["max_tokens"] == 3 and kwargs["temperature"] == 0.0 and kwargs["seed"] == 5
    assert kwargs["model"] == "omni" and kwargs["modalities"] is None
    assert kwargs["image"] is None and kwargs["audio"] is None and kwargs["voice"] is None
    assert client.closed and client.stream_closed
    # not a terminal: one summary line, nothing redrawn
    assert "\r" not in err and err.count("\n") == 1
    assert "first token" in err and "total" in err and "tokens 7 in / 3 out" in err
    assert "finish length" in err


@pytest.mark.parametrize(("suffix", "fmt"), [(".wav", "WAV"), (".flac", "FLAC")])
def test_cli_chat_audio_out_asks_for_speech_and_writes_it(fake_client, tmp_path, suffix, fmt):
    path = tmp_path / f"reply{suffix}"

    code, out, err = run_cli("chat", "hi", "--audio-out", str(path), "--voice", "Ethan",
                             "--image", "cat.png", "--audio", "q.wav")

    assert code == 0 and out == "Hello world\n"
    kwargs = fake_client.instances[0].calls[0][2]
    assert kwargs["modalities"] == ["text", "audio"] and kwargs["voice"] == "Ethan"
    assert kwargs["image"] == "cat.png" and kwargs["audio"] == "q.wav"
    samples, rate = sf.read(path, dtype="float32")
    assert sf.info(path).format == fmt and rate == 24000 and samples.size == 3600
    if fmt == "WAV":  # 16-bit PCM, as Python's wave module reads it
        assert_pcm16_wav(path.read_bytes(), np.concatenate([tone(2400), tone(1200)]), 24000)
    assert "audio 0.15 s" in err and f"wrote {path}" in err


def test_cli_chat_pcm_audio_out_is_raw_16_bit(fake_client, tmp_path):
    path = tmp_path / "reply.pcm"

    assert run_cli("chat", "hi", "--audio-out", str(path))[0] == 0
    assert path.stat().st_size == 2 * 3600


def test_cli_chat_with_an_unknown_audio_suffix_is_a_bad_request_before_calling(fake_client,
                                                                              tmp_path):
    code, out, err = run_cli("chat", "hi", "--audio-out", str(tmp_path / "reply.mp3"))

    assert code == 2
    assert err.startswith("error: --audio-out: cannot tell the audio format")
    assert fake_client.instances[0].calls == []


def test_cli_chat_image_out_asks_for_an_image(fake_client, tmp_path):
    png = png_bytes(4, 4)
    fake_client.events = [TextDelta("a cat"), ImageOutput(png), Final("stop")]
    path = tmp_path / "cat.png"

    code, _, _ = run_cli("chat", "draw a cat", "--image-out", str(path))

    assert code == 0 and path.read_bytes() == png
    assert fake_client.instances[0].calls[0][2]["modalities"] == ["text", "image"]


def test_cli_chat_fails_when_the_asked_audio_does_not_come(fake_client, tmp_path):
    fake_client.events = [TextDelta("hi"), Final("stop")]

    code, out, err = run_cli("chat", "hi", "--audio-out", str(tmp_path / "r.wav"))

    assert code == 1 and out == "hi\n" and err == "error: the reply came without audio\n"


def test_cli_chat_redraws_audio_progress_in_place_on_a_terminal(fake_client, tmp_path):
    code, out, err = run_cli("chat", "hi", "--audio-out", str(tmp_path / "r.wav"), err=Tty())

    assert code == 0 and out == "Hello world\n"
    assert "\r\033[Kaudio: 0.1 s received" in err  # 0.1 s after the first chunk
    assert "\r\033[Kaudio: 0.2 s received" in err  # 0.15 s after the second
    assert err.rstrip("\n").split("\r\033[K")[-1].startswith("first token")


def test_cli_chat_keeps_the_terminal_text_clean_when_stdout_is_that_terminal_too(fake_client,
                                                                                tmp_path):
    code, out, err = run_cli("chat", "hi", "--audio-out", str(tmp_path / "r.wav"), out=Tty(),
                             err=Tty())

    assert code == 0 and "\r" not in err and out == "Hello world\n"


def test_cli_quiet_prints_no_summary(fake_client):
    code, out, err = run_cli("chat", "hi", "-q")

    assert code == 0 and out == "Hello world\n" and err == ""


def test_cli_image_writes_the_png_and_prints_where_and_how_long(fake_client, tmp_path):
    path = tmp_path / "fox.png"

    code, out, err = run_cli("image", "a fox", "-o", str(path), "--size", "16x8", "--steps", "3",
                             "--seed", "7", "--negative-prompt", "blur", "--model", "t2i")

    assert code == 0
    assert Image.open(path).size == (16, 8) and path.read_bytes()[:4] == b"\x89PNG"
    assert out.startswith(f"wrote {path} (16x8) in ") and out.endswith(" s\n")
    name, args, kwargs = fake_client.instances[0].calls[0]
    assert (name, args) == ("generate_image", ("a fox",))
    assert kwargs == {"model": "t2i", "width": 16, "height": 8, "steps": 3, "guidance_scale": None,
                      "negative_prompt": "blur", "seed": 7}
    assert err == ""  # no ticking when stderr is not a terminal


def test_cli_image_converts_to_other_suffixes(fake_client, tmp_path):
    path = tmp_path / "fox.jpg"

    assert run_cli("image", "a fox", "-o", str(path))[0] == 0
    assert Image.open(path).format == "JPEG"


def test_cli_image_rejects_an_unknown_suffix(fake_client, tmp_path):
    code, _, err = run_cli("image", "a fox", "-o", str(tmp_path / "fox.nope"))

    assert code == 2 and "unknown image suffix '.nope'" in err
    assert fake_client.instances[0].calls == []


def test_cli_image_ticks_on_a_terminal_while_waiting(fake_client, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "TICK_S", 0.02)
    fake_client.delay_s = 0.2

    code, _, err = run_cli("image", "a fox", "-o", str(tmp_path / "f.png"), err=Tty())

    assert code == 0
    ticks = err.count("generating image:")
    assert ticks >= 3, err
    assert err.endswith("\r\033[K")  # the ticker line is cleared when the image is in
    assert not any(t.name == "omni-client-ticker" for t in threading.enumerate())


@pytest.mark.parametrize("size", ["512", "0x5", "axb", "5x-1"])
def test_cli_image_rejects_a_malformed_size(fake_client, size, capsys):
    with pytest.raises(SystemExit) as caught:
        run_cli("image", "x", "-o", "x.png", "--size", size)

    assert caught.value.code == 2
    assert "WIDTHxHEIGHT" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "extra", "fmt"), [
    ("hello.wav", [], "WAV"), ("hello.flac", [], "FLAC"), ("hello.out", ["--format", "flac"], "FLAC"),
])
def test_cli_speech_writes_the_format_of_the_suffix_or_format(fake_client, tmp_path, name, extra,
                                                              fmt):
    path = tmp_path / name

    code, out, _ = run_cli("speech", "read me", "-o", str(path), "--voice", "Ethan", *extra)

    assert code == 0
    assert sf.info(path).format == fmt and sf.info(path).samplerate == 24000
    if fmt == "WAV":
        assert_pcm16_wav(path.read_bytes(), tone(4800), 24000)
    assert out.startswith(f"wrote {path} (0.20 s of audio at 24000 Hz")
    assert fake_client.instances[0].calls[0] == ("speech", ("read me",),
                                                  {"model": None, "voice": "Ethan", "seed": None})


def test_cli_speech_pcm(fake_client, tmp_path):
    path = tmp_path / "hello.pcm"

    assert run_cli("speech", "read me", "-o", str(path))[0] == 0
    assert path.stat().st_size == 2 * 4800


def test_cli_speech_needs_a_known_format(fake_client, tmp_path):
    code, _, err = run_cli("speech", "read me", "-o", str(tmp_path / "hello.mp3"))

    assert code == 2 and "--format" in err and fake_client.instances[0].calls == []


def test_cli_models_lists_name_kind_and_backend(fake_client):
    code, out, _ = run_cli("models")

    assert code == 0
    assert out.splitlines() == ["NAME           KIND   BACKEND",
                                "omni           omni   omni_orchestrator",
                                "llm            llm    omni_llm",
                                "text_to_image  image  omni_dit"]


def test_cli_models_all_also_lists_the_internal_ones(fake_client):
    code, out, _ = run_cli("models", "--all")

    assert code == 0
    assert "talker         llm    omni_llm (internal)" in out.splitlines()


@pytest.mark.parametrize(("error", "code"), [
    (BadRequestError("voice: unknown voice 'Nobody'"), 2),
    (UnavailableError("failed to connect", status="StatusCode.UNAVAILABLE"), 3),
    (ServerError("engine died"), 1),
    (RuntimeError("something odd"), 1),
])
def test_cli_errors_are_one_line_and_an_exit_code(fake_client, error, code):
    fake_client.error = error

    got, out, err = run_cli("models")

    assert got == code and out == ""
    assert err == f"error: {error.message if hasattr(error, 'message') else error}\n"
    assert "Traceback" not in err


def test_cli_a_failure_mid_stream_keeps_the_text_and_reports_the_error(fake_client, tmp_path):
    def failing():
        yield TextDelta("partial")
        raise BadRequestError("voice: unknown voice 'Nobody'")

    fake_client.events = failing()

    code, out, err = run_cli("chat", "hi", "--audio-out", str(tmp_path / "r.wav"))

    assert code == 2 and out == "partial\n"
    assert err == "error: voice: unknown voice 'Nobody'\n"
    assert not (tmp_path / "r.wav").exists()


def test_cli_an_unwritable_output_is_an_error_naming_it(fake_client, tmp_path):
    path = tmp_path / "missing-dir" / "f.png"

    code, _, err = run_cli("image", "x", "-o", str(path))

    assert code == 1 and err.startswith(f"error: {path}: ")


def test_cli_global_options_go_before_or_after_the_command(fake_client, monkeypatch):
    run_cli("--url", "a:1", "--timeout", "5", "models")
    run_cli("models", "--url", "b:2", "--timeout", "7.5")
    run_cli("models")
    monkeypatch.setenv("OMNI_URL", "env:3")
    run_cli("models")
    run_cli("models", "--url", "c:4")

    got = [(c.url, c.kwargs) for c in fake_client.instances]
    assert got == [("a:1", {"timeout": 5.0}), ("b:2", {"timeout": 7.5}), ("localhost:8001", {}),
                   ("env:3", {}), ("c:4", {})]


@pytest.mark.parametrize("argv", [[], ["chat"], ["image", "x"], ["models", "--timeout", "0"],
                                  ["chat", "x", "--max-tokens", "-1"], ["speech", "x", "-o", "a.wav",
                                                                       "--format", "mp3"]])
def test_cli_usage_errors_exit_2(fake_client, argv, capsys):
    with pytest.raises(SystemExit) as caught:
        run_cli(*argv)
    assert caught.value.code == 2
    assert "usage: omni-client" in capsys.readouterr().err


def test_cli_against_nothing_listening_exits_3():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    code, out, err = run_cli("--url", f"127.0.0.1:{port}", "--timeout", "5", "models")

    assert code == 3 and out == "" and err.startswith("error: ")
    assert err.count("\n") == 1

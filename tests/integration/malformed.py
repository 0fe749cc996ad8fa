"""Malformed requests for every model a running server serves (test_malformed_requests.py).

Runs in the test process, against a real tritonserver, with stock tritonclient only.
What a server serves comes from the server: its repository index and each model's
config (backend, inputs with datatype, dims and `optional`, batching, decoupled). A
`Recipe` per kind of model (chosen by backend; for omni_llm and omni_encoder by asking
the model what it is) makes that model's valid request, checks that a result is real,
and holds, for each input of the model, the hypothesis strategy of malformed values
that must be refused naming that input. A model or an input without one is reported
as not covered, so a new model or input fails the suite until it has its strategies.
"""
from __future__ import annotations

import base64
import io
import json
import math
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import soundfile as sf
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import strategies as st
from PIL import Image
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from omni_serve.errors import code_of_message, normalise_code
from tests.video_clip import clip

CALL_TIMEOUT_S = 120.0  # no answer by then is a hang
WIRE_TYPES = ("BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT32", "UINT64", "FP16",
              "FP32", "FP64", "BYTES")
# what a Triton model config's data_type is on the wire
_WIRE = {f"TYPE_{t}": t for t in WIRE_TYPES} | {"TYPE_STRING": "BYTES"}
_HTTP_CODES = {"400": "INVALID_ARG", "404": "UNAVAILABLE", "503": "UNAVAILABLE", "499": "CANCELLED"}


# --- what the server serves ----------------------------------------------------------

@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str  # wire datatype: BYTES, INT64, ...
    dims: tuple[int, ...]  # without the batch dim
    optional: bool


@dataclass(frozen=True)
class Model:
    name: str
    backend: str
    decoupled: bool
    max_batch_size: int
    inputs: dict[str, InputSpec]
    outputs: tuple[str, ...]

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0


def served_models(grpc_url: str) -> list[Model]:
    """Every model of the server's repository index, as its served config describes it."""
    with grpcclient.InferenceServerClient(grpc_url) as client:
        index = client.get_model_repository_index(as_json=True).get("models", [])
        models = []
        for entry in index:
            assert entry.get("state") == "READY", f"model {entry['name']} is not ready: {entry}"
            config = client.get_model_config(entry["name"], as_json=True)["config"]
            inputs = {i["name"]: InputSpec(i["name"], _WIRE[i["data_type"]],
                                           tuple(int(d) for d in i.get("dims", ())),
                                           bool(i.get("optional", False)))
                      for i in config.get("input", [])}
            models.append(Model(
                name=config["name"], backend=config.get("backend", ""),
                decoupled=bool(config.get("model_transaction_policy", {}).get("decoupled")),
                max_batch_size=int(config.get("max_batch_size", 0)), inputs=inputs,
                outputs=tuple(o["name"] for o in config.get("output", []))))
    return sorted(models, key=lambda m: m.name)


# --- requests and what comes back ------------------------------------------------------

@dataclass(frozen=True)
class T:
    """One input tensor: `array` is one item's value (the batch dim is added for a batching
    model), unless `full`, when it is sent with exactly its shape."""

    array: np.ndarray
    datatype: str
    full: bool = False


Request = dict[str, T]


def text(value: str | bytes) -> T:
    return T(np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_),
             "BYTES")


def ints(values, datatype: str = "INT64") -> T:
    return T(np.array(values, dtype=triton_to_np_dtype(datatype)).reshape(-1), datatype)


def one(value, datatype: str) -> T:
    """A [1] tensor of a number or a boolean."""
    return T(np.array([value], dtype=triton_to_np_dtype(datatype)), datatype)


def floats(array) -> T:
    return T(np.asarray(array, dtype=np.float32), "FP32")


@dataclass
class Outcome:
    """What one request got: an error, or its responses' output tensors."""

    error: InferenceServerException | None = None
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)

    def last(self, name: str) -> np.ndarray | None:
        return next((o[name] for o in reversed(self.outputs) if name in o), None)

    def all(self, name: str) -> list[np.ndarray]:
        return [o[name] for o in self.outputs if name in o]


def error_code(error: InferenceServerException) -> str:
    """INVALID_ARG, UNAVAILABLE, INTERNAL, ... of an HTTP, gRPC or in-band stream error."""
    status = error.status()
    if status and status.isdigit():
        return _HTTP_CODES.get(status, "INTERNAL")
    return normalise_code(status) if status else code_of_message(error.message())


def _full(model: Model, t: T) -> np.ndarray:
    return t.array if t.full or not model.batched else t.array[np.newaxis]


class Caller:
    """Sends requests to one server: a gRPC stream for decoupled models (one at a time),
    HTTP or gRPC for the others (two at once, so that they can share a batch)."""

    def __init__(self, grpc_url: str, http_url: str):
        self.grpc = grpcclient.InferenceServerClient(grpc_url)
        self.http = httpclient.InferenceServerClient(http_url, concurrency=4,
                                                     network_timeout=CALL_TIMEOUT_S,
                                                     connection_timeout=CALL_TIMEOUT_S)
        self._stream_q: queue.Queue = queue.Queue()
        self._stream = False
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._stream:
            self.grpc.stop_stream()
        self.grpc.close()
        self.http.close()

    # decoupled: one request at a time on one stream
    def stream(self, model: Model, request: Request, parameters: dict | None = None) -> Outcome:
        with self._lock:
            if not self._stream:
                self.grpc.start_stream(
                    callback=lambda result, error: self._stream_q.put((result, error)))
                self._stream = True
            inputs = [_grpc_input(n, _full(model, t), t.datatype) for n, t in request.items()]
            self.grpc.async_stream_infer(model.name, inputs, request_id=uuid.uuid4().hex,
                                         parameters=parameters, enable_empty_final_response=True)
            outcome = Outcome()
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while True:
                try:
                    result, error = self._stream_q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"{model.name}: no final response within "
                                         f"{CALL_TIMEOUT_S:g} s (a hang)") from None
                if error is not None:
                    outcome.error = error
                    return outcome
                response = result.get_response()
                outcome.outputs.append({o.name: result.as_numpy(o.name) for o in response.outputs})
                if response.parameters["triton_final_response"].bool_param:
                    return outcome

    # not decoupled: several at once
    def infer_all(self, model: Model, requests: list[Request], protocol: str,
                  outputs: tuple[str, ...]) -> list[Outcome]:
        if protocol == "http":
            pending = [self.http.async_infer(
                model.name, [_http_input(n, _full(model, t), t.datatype) for n, t in r.items()],
                outputs=[httpclient.InferRequestedOutput(o, binary_data=True) for o in outputs])
                for r in requests]
            return [_http_outcome(p, outputs) for p in pending]
        done: list[queue.Queue] = []
        for r in requests:
            q: queue.Queue = queue.Queue()
            self.grpc.async_infer(
                model.name, [_grpc_input(n, _full(model, t), t.datatype) for n, t in r.items()],
                callback=lambda result, error, q=q: q.put((result, error)),
                outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                client_timeout=CALL_TIMEOUT_S)
            done.append(q)
        return [_grpc_outcome(q, model.name, outputs) for q in done]


def _grpc_input(name: str, array: np.ndarray, datatype: str):
    x = grpcclient.InferInput(name, list(array.shape), datatype)
    x.set_data_from_numpy(array)
    return x


def _http_input(name: str, array: np.ndarray, datatype: str):
    x = httpclient.InferInput(name, list(array.shape), datatype)
    x.set_data_from_numpy(array, binary_data=True)
    return x


def _http_outcome(pending, outputs) -> Outcome:
    try:
        result = pending.get_result(timeout=CALL_TIMEOUT_S)
    except InferenceServerException as e:
        return Outcome(error=e)
    return Outcome(outputs=[{o: result.as_numpy(o) for o in outputs
                             if result.as_numpy(o) is not None}])


def _grpc_outcome(q: queue.Queue, model: str, outputs) -> Outcome:
    try:
        result, error = q.get(timeout=CALL_TIMEOUT_S + 5)
    except queue.Empty:
        raise AssertionError(f"{model}: no response within {CALL_TIMEOUT_S:g} s (a hang)") from None
    if error is not None:
        return Outcome(error=error)
    return Outcome(outputs=[{o: result.as_numpy(o) for o in outputs
                             if result.as_numpy(o) is not None}])


# --- malformed values ------------------------------------------------------------------

@dataclass(frozen=True)
class Attack:
    """A malformed request and the inputs its error must name (any one of them)."""

    request: Request
    fields: tuple[str, ...]
    what: str
    parameters: dict | None = None  # Triton request parameters (gRPC)


def names_field(message: str, name: str) -> bool:
    """Whether `message` names input `name` (as a word: not inside a longer name)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


_NEVER_UTF8 = (b"\xff", b"\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80")


def non_utf8() -> st.SearchStrategy[bytes]:
    """Bytes that are never valid UTF-8 (one never-valid sequence inside arbitrary bytes)."""
    return st.builds(lambda a, bad, b: a + bad + b, st.binary(max_size=24),
                     st.sampled_from(_NEVER_UTF8), st.binary(max_size=24))


def _parses_as_object(raw: str) -> bool:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) or not raw.strip()


def bad_json() -> st.SearchStrategy[str]:
    """Text that is not JSON."""
    return st.one_of(
        st.sampled_from(["{", "{'max_tokens': 4}", '{"max_tokens": 4', "[1,", "nope", "{,}",
                         '{"a" 1}', "{}}", '{"a": tru}', "\x00"]),
        st.text(max_size=24).map(lambda s: "{" + s).filter(lambda s: not _parses_as_object(s)),
    )


def json_not_object() -> st.SearchStrategy[str]:
    """JSON that is valid but not an object."""
    return st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                     st.text(max_size=8), st.lists(st.integers(), max_size=3)).map(json.dumps)


def json_bad(extra: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[bytes]:
    """What a JSON-object input must refuse: not JSON, not an object, not UTF-8, `extra`."""
    parts = [bad_json().map(str.encode), json_not_object().map(str.encode), non_utf8()]
    if extra is not None:
        parts.append(extra.map(str.encode))
    return st.one_of(*parts)


def _dumps(value: dict) -> str:
    return json.dumps(value, allow_nan=True)


# vLLM SamplingParams values that are out of range for any model
def bad_sampling() -> st.SearchStrategy[str]:
    big = st.one_of(st.integers(min_value=2**64, max_value=2**200),
                    st.integers(min_value=-(2**200), max_value=-(2**63) - 1))
    nan_inf = st.sampled_from([math.nan, math.inf, -math.inf])
    return st.one_of(
        st.fixed_dictionaries({"max_tokens": st.one_of(
            st.integers(max_value=0), big, st.sampled_from([2.5, -1.5, "many", [4], {"n": 4}]))}),
        st.fixed_dictionaries({"temperature": st.one_of(
            st.floats(max_value=-1e-3, allow_nan=False), nan_inf, st.sampled_from(["hot", [1]]))}),
        st.fixed_dictionaries({"top_p": st.one_of(
            st.floats(max_value=0.0, allow_nan=False), st.floats(min_value=1.001, allow_nan=False),
            nan_inf)}),
        st.fixed_dictionaries({"seed": big}),
        st.fixed_dictionaries({"top_k": st.integers(max_value=-2)}),
        st.fixed_dictionaries({"n": st.integers(min_value=2, max_value=2**40)}),
        unknown_key().map(lambda k: {k: 1}),
    ).map(_dumps)


def never_int(lo: int, hi: int, *, datatype: str = "INT32") -> st.SearchStrategy[int]:
    """Integers of `datatype` outside [lo, hi]."""
    info = np.iinfo(triton_to_np_dtype(datatype))
    parts = []
    if lo > info.min:
        parts.append(st.integers(int(info.min), lo - 1))
    if hi < info.max:
        parts.append(st.integers(hi + 1, int(info.max)))
    return st.one_of(*parts)


def not_a_name(known: set[str] = frozenset()) -> st.SearchStrategy[str]:
    """Names nobody has (voices, tasks, modalities): never blank, never a known one."""
    return st.text(min_size=1, max_size=16).map(lambda s: "no-such-" + s).filter(
        lambda s: s.strip().lower() not in known)


# --- media -----------------------------------------------------------------------------

def png(width: int = 32, height: int = 32, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def wav(seconds: float = 0.3, rate: int = 16000, *, subtype: str = "PCM_16",
        samples: np.ndarray | None = None) -> bytes:
    if samples is None:
        t = np.arange(int(seconds * rate)) / rate
        samples = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def _huge_image() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, "PNG")  # 400 megapixels in a few kB
    return buf.getvalue()


def _nan_wav() -> bytes:
    samples = np.full(1600, np.nan, np.float32)
    return wav(samples=samples, subtype="FLOAT")


def _long_wav_header() -> bytes:
    """A WAV header that claims hours of audio (the data is short: the header is read first)."""
    data = wav(0.1)
    riff = bytearray(data)
    size = 16000 * 2 * 3600 * 5  # 5 hours of 16 kHz PCM_16
    riff[4:8] = (size + 36).to_bytes(4, "little")
    riff[40:44] = size.to_bytes(4, "little")
    return bytes(riff)


def bad_media(kind: str, max_bytes: int = 21 << 20) -> st.SearchStrategy[tuple[bytes, str]]:
    """(bytes, what) that an `kind` ("image" / "audio" / "video") input must refuse."""
    good = {"image": png(48, 40), "audio": wav(0.3), "video": clip()}[kind]
    other = png() if kind == "audio" else wav(0.3)  # a video's other file: sound only
    parts = [
        st.binary(min_size=1, max_size=512).filter(
            lambda b: not b.startswith((b"\x89PNG", b"RIFF", b"GIF", b"\xff\xd8", b"BM", b"fLaC",
                                       b"OggS", b"FORM", b"II", b"MM", b"ID3", b"RIFF")))
        .map(lambda b: (b, "random bytes")),
        st.just((b"", "empty")),
        st.just((other, "the other modality's file")),
        st.integers(8, len(good) // 2).map(lambda n: (good[:n], f"truncated to {n} bytes")),
        st.just((b"\0" * max_bytes, f"{max_bytes} bytes")),
    ]
    if kind == "image":
        parts.append(st.just((_huge_image(), "a 20000x20000 image")))
    elif kind == "audio":
        parts += [st.just((_nan_wav(), "NaN samples")), st.just((_long_wav_header(), "5 hours"))]
    return st.one_of(*parts)


# --- recipes: one kind of model each ------------------------------------------------------

AttackStrategy = st.SearchStrategy[Attack]


@dataclass
class Recipe:
    """A model's valid request, its result check, and its malformed values per input.

    `values[name]` is None for an input that has no malformed *value* (a boolean flag, a
    seed any integer of whose datatype is fine): wrong datatypes, shapes, leaving it out
    and unknown inputs still cover it. Keys that are not inputs (`parameters`: Triton
    request parameters) add attacks of their own. `required` are inputs the stage needs
    though the config marks them optional (one of several ways to give a prompt).
    """

    role: str
    model: Model
    valid: Callable[[], Request]
    check: Callable[[Outcome], None]
    values: dict[str, AttackStrategy | None] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    after: Callable[[], None] | None = None  # cleanup when the tests are done

    def attack(self, name: str, value: T | None, what: str, fields: tuple[str, ...] = (),
               drop: tuple[str, ...] = (), add: Request | None = None,
               parameters: dict | None = None) -> Attack:
        """The valid request with input `name` set to `value` (left out when None), inputs
        `drop` removed and `add` added; its error must name one of `name` + `fields`."""
        request = {k: v for k, v in self.valid().items() if k not in drop and k != name}
        request.update(add or {})
        if value is not None:
            request[name] = value  # last: Triton names the last input that disagrees
        return Attack(request, (name, *fields), what, parameters)

    def values_of(self, name: str, values: st.SearchStrategy, make: Callable[..., T | None],
                  what: str, **kw) -> AttackStrategy:
        return values.map(lambda v: self.attack(name, make(v), f"{what}: {_short(v)}", **kw))


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 120 else f"{r[:100]}... ({len(r)} chars)"


def oversized_text(min_chars: int = 600_000) -> st.SearchStrategy[str]:
    """Prompts far beyond any context of the tiny models (vLLM counts characters first)."""
    return st.integers(min_chars, 2 * min_chars).map(lambda n: ("hello " * (n // 6 + 1))[:n])


def _ok(outcome: Outcome) -> None:
    assert outcome.error is None, f"the valid request failed: {outcome.error}"
    assert outcome.outputs, "the valid request got no response"


def _joined(outcome: Outcome, name: str) -> str:
    return "".join(bytes(a.reshape(-1)[0]).decode() for a in outcome.all(name))


def _sampling_values(r: Recipe, name: str = "sampling_parameters") -> AttackStrategy:
    return r.values_of(name, st.one_of(json_bad(), bad_sampling().map(str.encode)), text,
                       "bad sampling")


def unknown_key() -> st.SearchStrategy[str]:
    """A key no sampling parameter set has."""
    return st.from_regex(r"zz[a-z_]{1,10}", fullmatch=True)


def _parameter_values(r: Recipe) -> AttackStrategy:
    """Triton request parameters (what vllm_backend clients send instead of tensors); the
    tensors they would lose to are left out."""
    bad = st.one_of(
        st.sampled_from(["maybe", "2", "yes please"]).map(lambda v: ("stream", {"stream": v})),
        unknown_key().map(lambda k: (k, {k: 1})),
        st.integers(-(2**63), 0).map(lambda v: ("max_tokens", {"max_tokens": v})),
    )
    request = {k: v for k, v in r.valid().items() if k not in ("sampling_parameters", "stream")}
    return bad.map(lambda kv: Attack(request, (kv[0],), f"parameters {kv[1]}", kv[1]))


# the vllm_backend-style LLM (text-chat's llm, omni-chat's thinker)

LLM_MAX_TOKENS = 4
GREEDY = {"max_tokens": LLM_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
_LLM_FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason",
              "return_num_input_tokens", "return_num_output_tokens", "return_token_ids",
              "return_hidden_states", "return_input_token_ids", "return_cumulative_logprob",
              "return_logprobs")
IMAGE_PAIR = ("image_embeds", "image_grid_thw")
AUDIO_PAIR = ("audio_features", "audio_feature_lengths")


def _llm_check(outcome: Outcome) -> None:
    _ok(outcome)
    reply = _joined(outcome, "text_output")
    assert reply.strip(), f"an empty reply: {outcome.outputs}"
    n = outcome.last("num_output_tokens")
    assert n is not None and int(n.reshape(-1)[0]) == LLM_MAX_TOKENS, outcome.outputs
    assert bytes(outcome.last("finish_reason").reshape(-1)[0]) == b"length", outcome.outputs


def llm_recipe(model: Model, media: Request | None = None) -> Recipe:
    """A text LLM (`media` None: text-only) or a multimodal thinker (`media`: one image's rows
    and grid and one clip's features, real ones from the server's encoders)."""
    prompt = "<|IMAGE|><|AUDIO|> describe" if media else "say something"

    def valid() -> Request:
        return {"text_input": text(prompt), "sampling_parameters": text(json.dumps(GREEDY)),
                "return_finish_reason": one(True, "BOOL"),
                "return_num_output_tokens": one(True, "BOOL"), **(media or {})}

    r = Recipe("multimodal thinker" if media else "text LLM", model, valid, _llm_check,
               required=("text_input",))
    ids = st.lists(st.integers(0, 100), min_size=1, max_size=8)
    # without text the media have no placeholders: they go too, so one fault is left
    no_text = dict(drop=("text_input", *(media or {})))
    r.values = {
        **dict.fromkeys(_LLM_FLAGS),
        "text_input": st.one_of(
            r.values_of("text_input", non_utf8(), text, "not UTF-8"),
            r.values_of("text_input", st.just(""), text, "empty"),
            r.values_of("text_input", oversized_text(), text, "oversized")),
        "sampling_parameters": _sampling_values(r),
        "parameters": _parameter_values(r),
        "hidden_states_in_shm": st.just(r.attack("hidden_states_in_shm", one(True, "BOOL"),
                                                 "without return_hidden_states")),
        "prompt_token_ids": st.one_of(
            st.tuples(ids, st.integers(-(2**63), -1)).map(
                lambda xb: r.attack("prompt_token_ids", ints(xb[0] + [xb[1]]),
                                    f"a negative id: {xb[0] + [xb[1]]}", **no_text)),
            st.integers(2**40, 2**63 - 1).map(
                lambda bad: r.attack("prompt_token_ids", ints([1, bad]), f"id {bad} >= vocab",
                                     **no_text)),
            st.just(r.attack("prompt_token_ids", ints([]), "empty", **no_text)),
            ids.map(lambda xs: r.attack("prompt_token_ids", ints(xs), "and text_input too"))),
        "messages": _messages_values(r, no_text["drop"]),
        "image": _image_values(r),
        # raw sound files, decoded by the stage before the engine sees them
        "audio": bad_media("audio").map(lambda bw: r.attack("audio", text(bw[0]), bw[1])),
        "video": bad_media("video").map(lambda bw: r.attack("video", text(bw[0]), bw[1])),
        "use_audio_in_video": st.just(r.attack("use_audio_in_video", one(True, "BOOL"),
                                               "without a video")),
        "embedding_request": _embedding_values(r, no_text["drop"]),
    }
    r.values.update(_media_values(r, media) if media else _text_only_media_values(r))
    return r


def bad_chat() -> st.SearchStrategy[str]:
    """What the llm stage's `messages` input must refuse: not a JSON array of messages."""
    turn = {"role": "user", "content": "hello"}
    return st.one_of(
        bad_json(), json_not_object().filter(lambda s: not s.startswith("[")),
        st.sampled_from([[], [1], ["hi"], [{"content": "x"}], [{"role": 3, "content": "x"}],
                         [{"role": "user", "content": 5}], [{"role": "user"}],
                         [{"role": "user", "content": [{"type": "image_url"}]}],
                         [turn, None]]).map(json.dumps))


def _messages_values(r: Recipe, drop: tuple[str, ...]) -> AttackStrategy:
    """A chat instead of the prompt: malformed, or beside a prompt it must not join."""
    chat = text(json.dumps([{"role": "user", "content": "hello"}]))
    return st.one_of(
        r.values_of("messages", st.one_of(bad_chat().map(str.encode), non_utf8()), text,
                    "bad chat", drop=drop),
        st.just(r.attack("messages", chat, "and text_input too")))


def _image_values(r: Recipe) -> AttackStrategy:
    """vllm_backend's `image`: base64 of an image file; neither base64 nor an image."""
    not_base64 = st.sampled_from([b"%%%", b"abc", b"not base64!", "\u00e9t\u00e9".encode()])
    # fixed bytes PIL cannot open: random ones may pass for a headerless format (TGA)
    not_image = st.sampled_from([b"\x00", b"hello", b"just some text, not pixels", b"{}"])
    return st.one_of(
        r.values_of("image", not_base64, text, "not base64"),
        r.values_of("image", not_image.map(base64.b64encode), text, "base64 of no image"))


def _embedding_values(r: Recipe, no_prompt: tuple[str, ...]) -> AttackStrategy:
    """vllm_backend's `embedding_request` instead of the prompt (`no_prompt`: the prompt
    and its media): malformed JSON, no input, or asked of a model that generates (the tiny
    LLMs are no pooling models)."""
    drop = (*no_prompt, "sampling_parameters")
    malformed = json_bad(st.sampled_from(['{"inputs": "x"}', '{"input": ""}', '{"input": []}',
                                          '{"input": [-1]}', '{"input": 3}']))
    return st.one_of(
        r.values_of("embedding_request", malformed, text, "bad embedding request", drop=drop),
        # vllm_backend's verbatim refusal names the task: "... does not support 'embed' ..."
        st.just(r.attack("embedding_request", text(json.dumps({"input": "hello"})),
                         "to a model that generates", ("embed",), drop=drop)))


def _text_only_media_values(r: Recipe) -> dict[str, AttackStrategy]:
    """Any media, well formed or not, to a text-only LLM."""
    n = st.integers(1, 6)
    image = n.map(lambda k: {"image_embeds": floats(np.ones((4 * k, 16))),
                             "image_grid_thw": ints([1, 4, 4 * k]).array.reshape(1, 3)})
    audio = n.map(lambda k: {"audio_features": floats(np.ones((8, 10 * k))),
                             "audio_feature_lengths": ints([10 * k])})

    def to_text_only(name: str, pair: tuple[str, str]):
        other = pair[1] if name == pair[0] else pair[0]

        def make(m: dict) -> Attack:
            m = {k: v if isinstance(v, T) else T(v, "INT64") for k, v in m.items()}
            return r.attack(name, m[name], "media to a text-only model", (other,),
                            add={other: m[other]})
        return make

    return {name: (image if name in IMAGE_PAIR else audio).map(
        to_text_only(name, IMAGE_PAIR if name in IMAGE_PAIR else AUDIO_PAIR))
        for name in (*IMAGE_PAIR, *AUDIO_PAIR)}


def _poison(array: np.ndarray, index: int, value: float) -> np.ndarray:
    out = np.array(array, dtype=np.float32, copy=True)
    out.reshape(-1)[index] = value
    return out


def _media_values(r: Recipe, media: Request) -> dict[str, AttackStrategy]:
    """Malformed media of a multimodal thinker: each mutates the valid request's real media."""
    embeds = media["image_embeds"].array
    grid = [int(v) for v in media["image_grid_thw"].array.reshape(-1)[:3]]
    features = media["audio_features"].array
    rows, hidden = embeds.shape
    mel, frames = features.shape

    def poisoned(array: np.ndarray):
        return st.tuples(st.integers(0, array.size - 1),
                         st.sampled_from([np.nan, np.inf, -np.inf])).map(lambda iv: _poison(array, *iv))

    def grid_t(g) -> T:
        return T(np.asarray(g, dtype=np.int64).reshape(-1, 3), "INT64")

    # a grid vLLM cannot place: h or w not a multiple of the merge size (2 in Qwen2.5-Omni)
    unplaceable = st.tuples(st.integers(0, 40), st.booleans()).map(
        lambda kb: [1, 2 * kb[0] + 1, 2] if kb[1] else [1, 2, 2 * kb[0] + 1])
    return {
        "image_embeds": st.one_of(
            poisoned(embeds).map(lambda a: r.attack("image_embeds", floats(a), "a NaN/inf value")),
            st.integers(1, 3 * hidden).filter(lambda w: w != hidden).map(
                lambda w: r.attack("image_embeds", floats(np.ones((rows, w))),
                                   f"rows {w} wide, not {hidden}")),
            st.integers(1, 64).filter(lambda n: n != rows).map(
                lambda n: r.attack("image_embeds", floats(np.ones((n, hidden))),
                                   f"{n} rows for grid {grid}", ("image_grid_thw",))),
            st.just(r.attack("image_embeds", floats(np.ones((0, hidden))), "no rows"))),
        "image_grid_thw": st.one_of(
            st.integers(-(2**63), 0).map(lambda v: r.attack(
                "image_grid_thw", grid_t([grid[0], v, grid[2]]), f"h = {v}")),
            unplaceable.map(lambda g: r.attack("image_grid_thw", grid_t(g),
                                               f"h or w not a multiple of the merge size: {g}",
                                               ("image_embeds",))),
            st.integers(2, 2**40).map(lambda k: r.attack(
                "image_grid_thw", grid_t([grid[0] * k, grid[1], grid[2]]),
                f"a grid of {k}x the rows", ("image_embeds",))),
            st.just(r.attack("image_grid_thw", grid_t([grid, grid]),
                             "two images, one placeholder", ("image_embeds",)))),
        "audio_features": st.one_of(
            poisoned(features).map(lambda a: r.attack("audio_features", floats(a),
                                                      "a NaN/inf value")),
            st.integers(1, 3 * mel).filter(lambda b: b != mel).map(
                lambda b: r.attack("audio_features", floats(np.ones((b, frames))),
                                   f"{b} mel bins, not {mel}")),
            st.just(r.attack("audio_features", floats(np.ones((mel, 0))), "no frames",
                             ("audio_feature_lengths",)))),
        "audio_feature_lengths": st.one_of(
            st.integers(1, 10**6).filter(lambda n: n != frames).map(
                lambda n: r.attack("audio_feature_lengths", ints([n]), f"{n} frames of {frames}",
                                   ("audio_features",))),
            st.integers(-(2**63), 0).map(
                lambda n: r.attack("audio_feature_lengths", ints([n]), f"length {n}")),
            st.integers(1, 2).map(lambda n: r.attack(
                "audio_feature_lengths", ints([n]), f"a clip of {n} frames (no audio token)",
                add={"audio_features": floats(features[:, :n])})),
            st.just(r.attack("audio_feature_lengths", ints([frames - 3, 3]),
                             "two clips, one placeholder", ("audio_features",)))),
    }


# the talker (omni_talker), fed a thinker's hidden states

TALKER_MAX_TOKENS = 8
TALKER_GREEDY = {"max_tokens": TALKER_MAX_TOKENS, "temperature": 0}
# omni_serve.families.qwen2_5_omni.talker_engine's pattern of a thinker's capture file
_CAPTURE_FILE = re.compile(r"^/(dev/shm|tmp)/[^/]*omni_hs_[A-Za-z0-9_]+/[A-Za-z0-9_-]{1,64}$")


def talker_recipe(model: Model, hidden_file: str, prompt_ids: list[int], rows: int,
                  remove: Callable[[], None]) -> Recipe:
    """`hidden_file`: a thinker reply's handed-over rows (`rows` of them) for prompt `prompt_ids`."""
    def valid() -> Request:
        return {"thinker_hidden_states_file": text(hidden_file),
                "prompt_token_ids": ints(prompt_ids),
                "sampling_parameters": text(json.dumps(TALKER_GREEDY))}

    def check(outcome: Outcome) -> None:
        _ok(outcome)
        frames = [a for a in outcome.all("codec_ids")]
        assert all(a.ndim == 2 and a.shape[1] == 1 for a in frames), [a.shape for a in frames]
        codes = [int(c) for a in frames for c in a.reshape(-1)]
        assert 1 <= len(codes) <= TALKER_MAX_TOKENS and min(codes) >= 0, codes

    r = Recipe("talker", model, valid, check, after=remove,
               required=("thinker_hidden_states_file", "prompt_token_ids"))
    paths = st.one_of(
        st.text(min_size=1, max_size=60).filter(lambda p: not _CAPTURE_FILE.match(p)).map(str.encode),
        non_utf8(),
        st.from_regex(r"[a-f0-9]{8,32}", fullmatch=True).map(
            lambda h: f"/dev/shm/omni_hs_nosuchdir/{h}".encode()))
    r.values = {
        "sampling_parameters": _sampling_values(r),
        "parameters": _parameter_values(r),
        "prompt_token_ids": st.one_of(
            st.integers(-(2**63), -1).map(lambda v: r.attack(
                "prompt_token_ids", ints([*prompt_ids[:-1], v]), f"a negative id {v}")),
            st.just(r.attack("prompt_token_ids", ints([]), "empty")),
            st.integers(rows, rows + 5000).map(lambda n: r.attack(
                "prompt_token_ids", ints([1] * n), f"{n} ids, the thinker wrote {rows} rows",
                ("thinker_hidden_states_file",)))),
        "thinker_hidden_states_file": r.values_of("thinker_hidden_states_file", paths, text,
                                                  "not a capture file"),
        "voice": r.values_of("voice", st.one_of(not_a_name().map(str.encode), non_utf8()),
                             text, "unknown voice"),
        "image_grid_thw": st.integers(-(2**63), 0).map(lambda v: r.attack(
            "image_grid_thw", T(np.array([[1, v, 2]], np.int64), "INT64"), f"h = {v}")),
        "audio_feature_lengths": st.integers(-(2**63), 0).map(lambda v: r.attack(
            "audio_feature_lengths", ints([v]), f"length {v}")),
        # a video's grid and its seconds a grid step travel together
        "video_grid_thw": st.one_of(
            st.integers(-(2**63), 0).map(lambda v: r.attack(
                "video_grid_thw", T(np.array([[2, v, 2]], np.int64), "INT64"), f"h = {v}",
                add={"video_second_per_grid": floats([2.0])})),
            st.just(r.attack("video_grid_thw", T(np.array([[2, 4, 4]], np.int64), "INT64"),
                             "without video_second_per_grid", ("video_second_per_grid",)))),
        "video_second_per_grid": st.one_of(
            st.sampled_from([0.0, -1.0, float("nan"), float("inf")]).map(lambda v: r.attack(
                "video_second_per_grid", floats([v]), f"{v} s a grid step",
                add={"video_grid_thw": T(np.array([[2, 4, 4]], np.int64), "INT64")})),
            st.just(r.attack("video_second_per_grid", floats([2.0]), "without video_grid_thw",
                             ("video_grid_thw",)))),
        "use_audio_in_video": st.one_of(
            st.just(r.attack("use_audio_in_video", one(True, "BOOL"), "without video_grid_thw")),
            st.just(r.attack("use_audio_in_video", one(True, "BOOL"),
                             "without audio_feature_lengths",
                             add={"video_grid_thw": T(np.array([[2, 4, 4]], np.int64), "INT64"),
                                  "video_second_per_grid": floats([2.0])}))),
    }
    return r


# the diffusion generator (omni_dit)

DIT_SIZE = (16, 32)  # height, width


def dit_recipe(model: Model) -> Recipe:
    def valid() -> Request:
        return {"prompt": text("a red fox in the snow"), "height": one(DIT_SIZE[0], "INT32"),
                "width": one(DIT_SIZE[1], "INT32"), "num_inference_steps": one(1, "INT32"),
                "seed": one(7, "INT64")}

    def check(outcome: Outcome) -> None:
        _ok(outcome)
        image = Image.open(io.BytesIO(bytes(outcome.last("image").reshape(-1)[0])))
        raw = outcome.last("image_raw")
        assert image.format == "PNG" and image.size == DIT_SIZE[::-1], image
        assert raw.shape == (1, *DIT_SIZE, 3) and np.array_equal(np.asarray(image), raw[0])

    r = Recipe("diffusion", model, valid, check, outputs=("image", "image_raw"))
    never_side = st.one_of(st.integers(-(2**31), 0), st.integers(2**16, 2**31 - 1),
                           st.integers(0, 2**15 - 1).map(lambda k: 2 * k + 1))
    r.values = {
        "prompt": r.values_of("prompt", st.one_of(non_utf8(), st.sampled_from([b"", b"  ", b"\n"])),
                              text, "bad prompt"),
        "negative_prompt": r.values_of("negative_prompt", non_utf8(), text, "not UTF-8"),
        "height": r.values_of("height", never_side, lambda v: one(v, "INT32"), "height"),
        "width": r.values_of("width", never_side, lambda v: one(v, "INT32"), "width"),
        "num_inference_steps": r.values_of(
            "num_inference_steps", st.one_of(st.integers(-(2**31), 0), st.integers(2**16, 2**31 - 1)),
            lambda v: one(v, "INT32"), "steps"),
        "guidance_scale": r.values_of(
            "guidance_scale", st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]),
                                        st.floats(max_value=-(2.0**-10), width=32, allow_nan=False),
                                        st.floats(min_value=1e6, width=32, allow_nan=False)),
            lambda v: one(v, "FP32"), "guidance"),
        "seed": None,  # any INT64 is a seed
        "step_cache": None,
    }
    return r


# the modality encoders (omni_encoder)

def encoder_recipe(model: Model, modality: str) -> Recipe:
    media = png(48, 40) if modality == "image" else wav(0.3)

    def check(outcome: Outcome) -> None:
        _ok(outcome)
        if modality == "image":
            rows, grid = outcome.last("embeddings"), outcome.last("grid_thw").reshape(-1)
            assert rows.ndim == 3 and rows.shape[1] == int(np.prod(grid)) // 4, (rows.shape, grid)
            assert np.isfinite(rows).all() and rows.std() > 0
        else:
            features = outcome.last("features")
            assert features.ndim == 3 and features.shape[2] > 0 and np.isfinite(features).all()

    outputs = ("embeddings", "grid_thw") if modality == "image" else ("features",)
    r = Recipe(f"{modality} encoder", model, lambda: {"media": text(media)}, check, outputs=outputs)
    r.values = {"media": bad_media(modality).map(
        lambda bw: r.attack("media", text(bw[0]), f"{modality} media: {bw[1]}"))}
    return r


# the audio generator (omni_audio)

AUDIO_CODES = list(range(1, 9))


def frames(codes) -> T:
    """Codec codes as the audio decoder takes them: [frames, 1], one code a frame."""
    return T(ints(codes).array.reshape(-1, 1), "INT64")


def audio_decoder_recipe(model: Model) -> Recipe:
    def check(outcome: Outcome) -> None:
        _ok(outcome)
        pcm, rate = outcome.last("audio_chunk"), outcome.last("sample_rate")
        assert pcm.size > 0 and np.isfinite(pcm).all() and np.abs(pcm).max() > 0, pcm
        assert int(rate.reshape(-1)[0]) > 0

    n = len(AUDIO_CODES)
    r = Recipe("audio decoder", model,
               lambda: {"codec_ids": frames(AUDIO_CODES), "seed": one(3, "INT64")}, check,
               outputs=("audio_chunk", "sample_rate"))
    bad_code = st.one_of(st.integers(-(2**63), -1), st.integers(2**31, 2**63 - 1))
    r.values = {
        "codec_ids": st.one_of(
            st.tuples(st.integers(0, n - 1), bad_code).map(lambda ib: r.attack(
                "codec_ids", frames(AUDIO_CODES[:ib[0]] + [ib[1]] + AUDIO_CODES[ib[0] + 1:]),
                f"code {ib[1]} at {ib[0]}")),
            st.just(r.attack("codec_ids", frames([]), "empty")),
            st.just(r.attack("codec_ids", ints(AUDIO_CODES), "[frames] without the groups")),
            st.integers(100_000, 200_000).map(lambda k: r.attack(
                "codec_ids", frames(np.ones(k, np.int64)), f"{k} frames"))),
        "context_tokens": r.values_of("context_tokens", never_int(0, n - 1),
                                      lambda v: one(v, "INT32"), "context"),
        "lookahead_tokens": r.values_of("lookahead_tokens", never_int(0, n - 1),
                                        lambda v: one(v, "INT32"), "lookahead"),
        "code_offset": r.values_of("code_offset", never_int(0, 2**40, datatype="INT64"),
                                   lambda v: one(v, "INT64"), "offset"),
        "voice": r.values_of("voice", st.one_of(not_a_name().map(str.encode), non_utf8()),
                             text, "unknown voice"),
        "seed": None,
    }
    return r


# the orchestrator (omni_orchestrator)

OMNI_MODALITIES = {"text", "audio", "image"}


# a history audio part (its bytes are refused only by the encoder: a RIFF header alone)
_AUDIO_PART = {"type": "audio", "audio": base64.b64encode(b"RIFF").decode()}


def omni_recipe(model: Model) -> Recipe:
    def valid() -> Request:
        return {"text_input": text("hi"), "sampling_parameters": text(json.dumps(GREEDY))}

    def check(outcome: Outcome) -> None:
        _ok(outcome)
        assert _joined(outcome, "text_output").strip(), outcome.outputs
        assert bytes(outcome.last("finish_reason").reshape(-1)[0]) == b"length"
        assert "stage_seconds" in json.loads(bytes(outcome.last("metrics").reshape(-1)[0]))

    r = Recipe("orchestrator", model, valid, check)
    strings = lambda items: T(np.array(items, dtype=np.object_).reshape(-1), "BYTES")  # noqa: E731
    turn = {"role": "user", "content": "hello"}
    bad_history = st.one_of(
        bad_json(), json_not_object().filter(lambda s: not s.startswith("[")),
        st.sampled_from([[1], ["hi"], [{"role": "system", "content": "x"}],
                         [{"role": "user", "content": 5}], [{"role": "user"}],
                         [{**turn, "name": "x"}], [turn, None],
                         # audio parts (history[i].content[j].audio)
                         [{"role": "user", "content": [{"type": "audio", "audio": "!!"}]}],
                         [{"role": "user", "content": [{"type": "audio"}]}],
                         [{"role": "user", "content": [{"type": "audio", "audio": ""}]}],
                         [{"role": "assistant", "content": [_AUDIO_PART]}],
                         [{"role": "user", "content": [{"type": "image", "image": "eA=="}]}],
                         [{"role": "user", "content": [{**_AUDIO_PART, "x": 1}]}],
                         [{"role": "user", "content": []}],
                         # more than the orchestrator's default max_audio_items (16)
                         [{"role": "user", "content": [_AUDIO_PART] * 17}]]).map(json.dumps))
    talker_keys = {"temperature": st.one_of(st.floats(max_value=-1e-3, allow_nan=False),
                                            st.floats(min_value=2.001, allow_nan=False),
                                            st.sampled_from([math.nan, "hot"])),
                   "top_k": st.integers(max_value=-2), "top_p": st.sampled_from([0, -1, 1.5]),
                   "repetition_penalty": st.sampled_from([0, -1, 2.5, math.inf]),
                   "max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=32769),
                                           st.sampled_from([2.5, "many"])),
                   "seed": st.integers()}
    bad_talker = st.one_of(
        st.sampled_from(sorted(talker_keys)).flatmap(
            lambda k: talker_keys[k].map(lambda v: _dumps({k: v}))),
        unknown_key().map(lambda k: _dumps({k: 1})))
    r.values = {
        "text_input": r.values_of("text_input", st.one_of(
            non_utf8(), st.sampled_from([b"", b" ", b"\n\t"]),
            oversized_text().map(str.encode)), text, "bad text"),
        "image": bad_media("image").map(lambda bw: r.attack("image", text(bw[0]), bw[1])),
        "audio": bad_media("audio").map(lambda bw: r.attack("audio", text(bw[0]), bw[1])),
        "video": bad_media("video").map(lambda bw: r.attack("video", text(bw[0]), bw[1])),
        "modalities": st.one_of(
            st.lists(not_a_name(OMNI_MODALITIES).map(str.encode), min_size=1, max_size=3).map(
                lambda xs: r.attack("modalities", strings([b"text", *xs]), f"modalities {xs}")),
            non_utf8().map(lambda b: r.attack("modalities", strings([b]), "not UTF-8")),
            st.just(r.attack("modalities", T(np.zeros(0, np.object_), "BYTES"), "none")),
            st.sampled_from([b'["text", 1]', b'["text"', b'[{"a": 1}]', b"[]"]).map(
                lambda b: r.attack("modalities", strings([b]), f"JSON {b!r}"))),
        "sampling_parameters": _sampling_values(r),
        "voice": r.values_of("voice", st.one_of(not_a_name().map(str.encode), non_utf8()),
                             text, "unknown voice"),
        "seed": None,  # any INT64 seeds the generators
        "task": r.values_of("task", st.one_of(not_a_name({"chat", "speech"}).map(str.encode),
                                              non_utf8()), text, "unknown task"),
        "session_id": r.values_of("session_id", st.one_of(
            non_utf8(), st.integers(257, 20_000).map(lambda k: b"s" * k)), text, "bad session"),
        "history": st.one_of(
            r.values_of("history", st.one_of(bad_history.map(str.encode), non_utf8()), text,
                        "bad history"),
            st.just(r.attack("history", text(json.dumps([turn])), "with task speech",
                             add={"task": text("speech")}))),
        "talker_sampling_parameters": r.values_of(
            "talker_sampling_parameters", st.one_of(json_bad(), bad_talker.map(str.encode)), text,
            "bad talker sampling"),
        "stream_audio": None,
        "return_codec_ids": st.just(r.attack("return_codec_ids", one(True, "BOOL"),
                                             "without audio output")),
        "return_timeline": None,
        "use_audio_in_video": st.one_of(
            st.just(r.attack("use_audio_in_video", one(True, "BOOL"), "without a video")),
            # a thinker without video names the video instead
            st.just(r.attack("use_audio_in_video", one(True, "BOOL"), "a clip without sound",
                             ("video",), add={"video": text(clip())}))),
    }
    return r


# --- discovery: a recipe for every model the server serves ---------------------------------

@dataclass
class Catalog:
    models: list[Model]
    recipes: dict[str, Recipe]  # model name -> its recipe
    uncovered: dict[str, str]  # model name -> why it has none


def _message(outcome: Outcome) -> str:
    return outcome.error.message() if outcome.error is not None else "no error"


def discover(caller: Caller, models: list[Model]) -> Catalog:
    """Find what each model is (asking it where its config does not say) and its recipe."""
    from omni_serve.llm.hidden_states import remove_handed_over

    catalog = Catalog(models, {}, {})
    by_backend: dict[str, list[Model]] = {}
    for m in models:
        by_backend.setdefault(m.backend, []).append(m)
    encoded: dict[str, Outcome] = {}
    for m in by_backend.pop("omni_encoder", []):
        for modality, outputs in (("image", ("embeddings", "grid_thw")), ("audio", ("features",))):
            recipe = encoder_recipe(m, modality)
            (outcome,) = caller.infer_all(m, [recipe.valid()], "http", outputs)
            if outcome.error is None and outcome.last(outputs[0]) is not None:
                catalog.recipes[m.name] = recipe
                encoded[modality] = outcome
                break
        else:
            catalog.uncovered[m.name] = "an omni_encoder that encodes neither a PNG nor a WAV"
    media = None
    if {"image", "audio"} <= set(encoded):
        features = encoded["audio"].last("features")[0]
        media = {"image_embeds": floats(encoded["image"].last("embeddings")[0]),
                 "image_grid_thw": T(encoded["image"].last("grid_thw").reshape(1, 3), "INT64"),
                 "audio_features": floats(features),
                 "audio_feature_lengths": ints([features.shape[1]])}
    talkers, thinkers = by_backend.pop("omni_talker", []), []
    for m in by_backend.pop("omni_llm", []):
        text_only = llm_recipe(m)
        outcome = caller.stream(m, text_only.valid())
        if outcome.error is not None:
            catalog.uncovered[m.name] = f"omni_llm that refuses a text prompt: {_message(outcome)}"
            continue
        recipe = text_only
        if media is not None:
            multimodal = llm_recipe(m, media)
            outcome = caller.stream(m, multimodal.valid())
            if outcome.error is None:
                recipe = multimodal
                thinkers.append(m)
            elif "text-only" not in _message(outcome):
                catalog.uncovered[m.name] = f"media refused: {_message(outcome)}"
                continue
        catalog.recipes[m.name] = recipe
    for m in talkers:
        if not thinkers:
            catalog.uncovered[m.name] = "a talker without a multimodal thinker in its server"
            continue
        catalog.recipes[m.name] = _talker(caller, m, thinkers[0], remove_handed_over)
    for backend, make in (("omni_dit", dit_recipe), ("omni_audio", audio_decoder_recipe),
                          ("omni_orchestrator", omni_recipe)):
        for m in by_backend.pop(backend, []):
            catalog.recipes[m.name] = make(m)
    for backend, rest in by_backend.items():
        for m in rest:
            catalog.uncovered[m.name] = f"no recipe for backend {backend!r}"
    return catalog


def _talker(caller: Caller, talker: Model, thinker: Model, remove) -> Recipe:
    """The talker's recipe, fed one thinker reply's hidden states (kept until `after`)."""
    request = {"text_input": text("hello there"),
               "sampling_parameters": text(json.dumps({**GREEDY, "max_tokens": 6})),
               "stream": one(True, "BOOL"), "return_hidden_states": one(True, "BOOL"),
               "hidden_states_in_shm": one(True, "BOOL"),
               "return_input_token_ids": one(True, "BOOL")}
    outcome = caller.stream(thinker, request)
    _ok(outcome)
    path = bytes(outcome.last("hidden_states_file").reshape(-1)[0]).decode()
    prompt_ids = [int(i) for i in outcome.last("input_token_ids").reshape(-1)]
    rows = max(int(a[0]) + int(a[1]) for a in (x.reshape(-1) for x in outcome.all("hidden_states_rows")))
    return talker_recipe(talker, path, prompt_ids, rows, lambda: remove(path))

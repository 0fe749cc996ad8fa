"""Raw tritonclient helpers for the omni entry model (what a stock Triton client does)."""
from __future__ import annotations

import io
import json
import queue
from dataclasses import dataclass, field

import numpy as np
import soundfile as sf
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from omni_serve.contract import OMNI
from omni_serve.errors import (
    STRICT_STREAM_ERRORS_HEADER,
    code_of_message,
    normalise_code,
    strict_stream_errors_safe,
)

MODEL = "omni"


@dataclass
class OmniResult:
    """Every response of one omni request, in arrival order."""

    kinds: list[str] = field(default_factory=list)  # "text" / "audio" / "image" per response part
    deltas: list[str] = field(default_factory=list)
    chunks: list[np.ndarray] = field(default_factory=list)
    sample_rate: int | None = None
    images: list[bytes] = field(default_factory=list)
    codec_ids: list[list[int]] = field(default_factory=list)  # [frames][groups]
    finish_reason: str | None = None
    metrics: dict | None = None
    error: InferenceServerException | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)


def _tensor(name: str, arr: np.ndarray, dtype: str):
    x = grpcclient.InferInput(name, list(arr.shape), dtype)
    x.set_data_from_numpy(arr)
    return x


def omni_inputs(text: str = "describe what you get", *, modalities=None, image: bytes | None = None,
                audio: bytes | None = None, sampling: dict | None = None, voice: str | None = None,
                seed: int | None = None, session_id: str | None = None,
                history: list[dict] | str | None = None, talker_sampling: dict | None = None,
                stream_audio: bool | None = None, return_codec_ids: bool = False,
                task: str | None = None, video: bytes | None = None,
                return_timeline: bool = False):
    ins = [_tensor(OMNI.TEXT_INPUT, np.array([text.encode()], dtype=object), "BYTES")]
    if modalities is not None:
        ins.append(_tensor(OMNI.MODALITIES, np.array([m.encode() for m in modalities], dtype=object),
                           "BYTES"))
    for name, data in ((OMNI.IMAGE, image), (OMNI.AUDIO, audio), (OMNI.VIDEO, video)):
        if data is not None:
            ins.append(_tensor(name, np.array([data], dtype=object), "BYTES"))
    if sampling is not None:
        ins.append(_tensor(OMNI.SAMPLING_PARAMETERS,
                           np.array([json.dumps(sampling).encode()], dtype=object), "BYTES"))
    if voice is not None:
        ins.append(_tensor(OMNI.VOICE, np.array([voice.encode()], dtype=object), "BYTES"))
    if seed is not None:
        ins.append(_tensor(OMNI.SEED, np.array([seed], dtype=np.int64), "INT64"))
    if session_id is not None:
        ins.append(_tensor(OMNI.SESSION_ID, np.array([session_id.encode()], dtype=object), "BYTES"))
    if history is not None:  # a list of {role, content}, or raw text (to test bad JSON)
        raw = history if isinstance(history, str) else json.dumps(history)
        ins.append(_tensor(OMNI.HISTORY, np.array([raw.encode()], dtype=object), "BYTES"))
    if talker_sampling is not None:
        ins.append(_tensor(OMNI.TALKER_SAMPLING_PARAMETERS,
                           np.array([json.dumps(talker_sampling).encode()], dtype=object), "BYTES"))
    if stream_audio is not None:
        ins.append(_tensor(OMNI.STREAM_AUDIO, np.array([stream_audio]), "BOOL"))
    if return_codec_ids:
        ins.append(_tensor(OMNI.RETURN_CODEC_IDS, np.array([True]), "BOOL"))
    if return_timeline:
        ins.append(_tensor(OMNI.RETURN_TIMELINE, np.array([True]), "BOOL"))
    if task is not None:
        ins.append(_tensor(OMNI.TASK, np.array([task.encode()], dtype=object), "BYTES"))
    return ins


def stream_headers(client: grpcclient.InferenceServerClient) -> dict | None:
    """The strict-errors header (an error closes the stream with its gRPC code) where the
    server survives it; Triton 2.51 gets none and its errors arrive in-band."""
    version = client.get_server_metadata(as_json=True)["version"]
    return {STRICT_STREAM_ERRORS_HEADER: "true"} if strict_stream_errors_safe(version) else None


def error_code(error: InferenceServerException) -> str:
    """INVALID_ARG, UNAVAILABLE, ... of a stream error: its gRPC status when it carries one,
    else what a client reads from the in-band message."""
    status = error.status()
    return normalise_code(status) if status else code_of_message(error.message())


class OmniStream:
    """One gRPC stream to the omni model; responses land in a queue."""

    def __init__(self, url: str, model: str = MODEL):
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)),
                                 headers=stream_headers(self.client))

    def send(self, inputs) -> None:
        self.client.async_stream_infer(self.model, inputs, enable_empty_final_response=True)

    def next(self, timeout: float = 120.0):
        return self.q.get(timeout=timeout)

    def collect(self, result: OmniResult | None = None, timeout: float = 120.0) -> OmniResult:
        """Read responses until the final one (or an error)."""
        result = result or OmniResult()
        while True:
            response, error = self.next(timeout)
            if error is not None:
                result.error = error
                return result
            if absorb(result, response):
                return result

    def collect_until(self, done, result: OmniResult | None = None,
                      timeout: float = 120.0) -> OmniResult:
        """Read responses until `done(result)` holds (fails on an error or the final one)."""
        result = result or OmniResult()
        while not done(result):
            response, error = self.next(timeout)
            assert error is None, error
            assert not absorb(result, response), "the request ended first"
        return result

    def received(self, result: OmniResult | None = None) -> OmniResult:
        """Absorb the responses already queued, without waiting for more."""
        result = result or OmniResult()
        while not self.q.empty():
            response, error = self.q.get_nowait()
            assert error is None, error
            absorb(result, response)
        return result

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def absorb(result: OmniResult, response) -> bool:
    """Add one response to `result`; True when it was the final one."""
    res = response.get_response()
    names = {o.name for o in res.outputs}
    if OMNI.TEXT_OUTPUT in names:
        result.deltas.append(response.as_numpy(OMNI.TEXT_OUTPUT)[0].decode())
        result.kinds.append("text")
    if OMNI.CODEC_IDS in names:
        frames = response.as_numpy(OMNI.CODEC_IDS)
        assert frames.ndim == 2 and frames.dtype == np.int64, (frames.shape, frames.dtype)
        result.codec_ids.extend(frames.tolist())
    if OMNI.AUDIO_CHUNK in names:
        chunk = response.as_numpy(OMNI.AUDIO_CHUNK)
        assert chunk.dtype == np.float32 and chunk.ndim == 1
        result.chunks.append(chunk)
        result.sample_rate = int(response.as_numpy(OMNI.SAMPLE_RATE)[0])
        result.kinds.append("audio")
    if OMNI.IMAGE_OUTPUT in names:
        result.images.append(bytes(response.as_numpy(OMNI.IMAGE_OUTPUT)[0]))
        result.kinds.append("image")
    if OMNI.FINISH_REASON in names:
        result.finish_reason = response.as_numpy(OMNI.FINISH_REASON)[0].decode()
        result.metrics = json.loads(response.as_numpy(OMNI.METRICS)[0])
    final = res.parameters.get("triton_final_response")
    return bool(final and final.bool_param)


def audio_amid_text(url: str, model: str = MODEL, *, seed: int = 7,
                    max_tokens: int = 1000) -> OmniResult:
    """A long spoken reply read until its first audio chunk and then more text (so the
    audio came while the reply was still being written), then cancelled. Asserts that
    the request ended in neither of those waits."""
    long = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    stream = OmniStream(url, model)
    stream.send(omni_inputs("tell me a long story", modalities=["text", "audio"], sampling=long,
                            seed=seed))
    result = OmniResult()
    try:
        while "audio" not in result.kinds:  # until the first audio chunk
            response, error = stream.next(timeout=60)
            assert error is None, error
            assert not absorb(result, response), "the request ended before any audio"
        while result.kinds[-1] != "text":  # then more text: the reply was not finished yet
            response, error = stream.next(timeout=60)
            assert error is None, error
            assert not absorb(result, response), "the text ended with the first audio"
    finally:
        stream.close(cancel=True)
    assert result.finish_reason is None and result.sample_rate == 24000
    return result


def run_omni(url: str, model: str = MODEL, *, result: OmniResult | None = None,
             extra_inputs=(), **kwargs) -> OmniResult:
    """One request of `omni_inputs(**kwargs)` plus `extra_inputs`, read to its end; pass
    `result` to watch it fill in from another thread as responses arrive."""
    stream = OmniStream(url, model)
    try:
        stream.send([*omni_inputs(**kwargs), *extra_inputs])
        return stream.collect(result)
    finally:
        stream.close()


# --- media --------------------------------------------------------------------------

def png(width: int = 100, height: int = 80, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def tone(seconds: float = 1.0, rate: int = 16000, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV")
    return buf.getvalue()


# --- audio in video -----------------------------------------------------------------

def run_omni_hearing(url: str, use_audio_in_video: bool, model: str = MODEL,
                     **kwargs) -> OmniResult:
    """run_omni with the `use_audio_in_video` flag set (true: the clip's sound is heard)."""
    flag = _tensor(OMNI.USE_AUDIO_IN_VIDEO, np.array([use_audio_in_video]), "BOOL")
    return run_omni(url, model, extra_inputs=[flag], **kwargs)

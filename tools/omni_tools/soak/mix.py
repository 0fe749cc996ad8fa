"""The soak's request mix: what each kind of request sends, to which model, and expects.

Runs in the soak tool's process. Each `Kind` builds the stock tritonclient
gRPC inputs of one request (the tensors a user's client sends; the
orchestrator's are in omni_serve.contract.OMNI) from its index, so a run is
reproducible. The embedded default (omni-chat) serves every kind: its entry
model `omni` (text chat, chat with media in, chat with speech out, image
generation, read-aloud), plus `llm` and `text_to_image`, which are the models
of the text-chat and text-to-image presets with the same tensor interfaces.
Against a server of another preset, the kinds whose model it lacks are left out.
"""
from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient

from omni_serve.contract import DIT, LLM, OMNI


def _tensor(name: str, values, dtype: str, shape: Sequence[int] | None = None):
    arr = np.array(values, dtype=object if dtype == "BYTES" else None)
    if shape is not None:
        arr = arr.reshape(shape)
    x = grpcclient.InferInput(name, list(arr.shape), dtype)
    x.set_data_from_numpy(arr)
    return x


def _json(name: str, value: dict):
    return _tensor(name, [json.dumps(value).encode()], "BYTES")


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix."""

    name: str
    model: str
    build: Callable[[int], list]  # request index -> tritonclient InferInputs
    expect: tuple[str, ...]  # outputs a completed reply carries at least once
    doc: str


# --- media -------------------------------------------------------------------------

def _png(i: int, width: int = 64, height: int = 48) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _wav(i: int, seconds: float = 0.5, rate: int = 16000) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * (200 + 20 * (i % 10)) * t)).astype(np.float32), rate,
             format="WAV")
    return buf.getvalue()


# --- the omni entry model -------------------------------------------------------------

THINKER = {"max_tokens": 24, "temperature": 0.7}
TALKER = {"max_tokens": 48}


def _omni(i: int, text: str, modalities: Sequence[str] = ("text",), *, task: str | None = None,
          image: bytes | None = None, audio: bytes | None = None) -> list:
    ins = [_tensor(OMNI.TEXT_INPUT, [f"{text} (request {i})".encode()], "BYTES"),
           _tensor(OMNI.MODALITIES, [m.encode() for m in modalities], "BYTES"),
           _json(OMNI.SAMPLING_PARAMETERS, {**THINKER, "seed": i}),
           _tensor(OMNI.SEED, [i], "INT64")]
    if "audio" in modalities:
        ins.append(_json(OMNI.TALKER_SAMPLING_PARAMETERS, TALKER))
    if task is not None:
        ins.append(_tensor(OMNI.TASK, [task.encode()], "BYTES"))
    for name, data in ((OMNI.IMAGE, image), (OMNI.AUDIO, audio)):
        if data is not None:
            ins.append(_tensor(name, [data], "BYTES"))
    return ins


def _llm(i: int) -> list:
    return [_tensor(LLM.TEXT_INPUT, [f"Tell me about the sea, {i}".encode()], "BYTES"),
            _tensor(LLM.STREAM, [True], "BOOL"),
            _json(LLM.SAMPLING_PARAMETERS, {"max_tokens": 32, "temperature": 0.7, "seed": i}),
            _tensor(LLM.EXCLUDE_INPUT_IN_OUTPUT, [True], "BOOL"),
            _tensor(LLM.RETURN_FINISH_REASON, [True], "BOOL")]


def _text_to_image(i: int) -> list:
    def t(name, value, dtype):
        return _tensor(name, [value], dtype, shape=(1, 1))  # max_batch_size > 0: [batch, 1]

    return [t(DIT.PROMPT, f"a lighthouse at dusk, {i}".encode(), "BYTES"),
            t(DIT.HEIGHT, np.int32(64), "INT32"), t(DIT.WIDTH, np.int32(64), "INT32"),
            t(DIT.NUM_INFERENCE_STEPS, np.int32(2), "INT32"), t(DIT.SEED, np.int64(i), "INT64")]


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("chat", "omni", lambda i: _omni(i, "Say something nice"), (OMNI.TEXT_OUTPUT,),
         "omni: text in, text out"),
    Kind("chat_media", "omni",
         lambda i: _omni(i, "What do you see and hear?", image=_png(i), audio=_wav(i)),
         (OMNI.TEXT_OUTPUT,), "omni: text + image + audio in (both encoders), text out"),
    Kind("chat_speech", "omni", lambda i: _omni(i, "Tell me a story", ("text", "audio")),
         (OMNI.TEXT_OUTPUT, OMNI.AUDIO_CHUNK), "omni: text in, text + speech out (thinker, "
         "talker, Token2Wav)"),
    Kind("read_aloud", "omni", lambda i: _omni(i, "Hello there, welcome aboard", ("audio",),
                                               task="speech"),
         (OMNI.AUDIO_CHUNK,), "omni task speech: the talker reads text_input aloud"),
    Kind("chat_image", "omni", lambda i: _omni(i, "Draw a cat", ("text", "image")),
         (OMNI.TEXT_OUTPUT, OMNI.IMAGE_OUTPUT), "omni: text in, text + a generated image out (DiT)"),
    Kind("llm", "llm", _llm, (LLM.TEXT_OUTPUT,), "llm directly (the text-chat preset's model): "
         "vllm_backend tensors, streamed"),
    Kind("text_to_image", "text_to_image", _text_to_image, (DIT.IMAGE,),
         "text_to_image directly (the text-to-image preset's model), dynamically batched"),
)}


def available(kinds: Sequence[str], models: set[str]) -> list[Kind]:
    """The kinds named in `kinds` whose model the server has; ValueError for unknown names."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown request kind(s) {unknown}; known: {', '.join(KINDS)}")
    return [KINDS[k] for k in kinds if KINDS[k].model in models]

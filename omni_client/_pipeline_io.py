"""Requests and responses of every entry model kind, to and from plain Python values.

Runs in the caller's process, with no network I/O. An entry model is one of
three kinds, told apart by its config's backend:

- "omni": the orchestrator (`omni_orchestrator`): text/image/audio/video in, text
  deltas, audio chunks, images and a final metrics response out (streamed);
- "llm": an LLM stage (`omni_llm`, or Triton's own `vllm` backend): text in,
  text deltas out (streamed);
- "image": a DiT stage (`omni_dit`): a prompt in, one PNG out (unary, batched
  by Triton, so tensors carry a batch dimension).

Tensor names, dtypes and shapes come from omni_serve.contract only.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import tritonclient.grpc as grpcclient

from omni_client import _llm_io
from omni_client._tensor import ArrayInput
from omni_client.errors import BadRequestError
from omni_client.types import AudioChunk, CodecIds, Event, Final, ImageOutput, TextDelta, Usage
from omni_serve.contract import DIT, DIT_CONTRACT, LLM, OMNI, OMNI_CONTRACT, StageContract

ModelKind = Literal["omni", "llm", "image"]

_KIND_BY_BACKEND: dict[str, ModelKind] = {
    "omni_orchestrator": "omni",
    "omni_llm": "llm",
    "vllm": "llm",
    "omni_dit": "image",
}


def model_kind(config: Mapping[str, Any]) -> ModelKind | None:
    """The kind of entry model a Triton model config (JSON form) describes; None: not an entry."""
    return _KIND_BY_BACKEND.get(str(config.get("backend", "")))


def _tensor(contract: StageContract, name: str, value: Any, batched: bool) -> grpcclient.InferInput:
    spec = contract.input(name)
    array = np.asarray(value, dtype=spec.np_dtype)
    if spec.np_dtype is np.object_:
        array = np.array([v.encode("utf-8") if isinstance(v, str) else v
                          for v in array.reshape(-1)], dtype=np.object_)
    array = array.reshape(-1) if -1 in spec.dims else array.reshape(spec.dims)
    if batched:
        array = array[np.newaxis]
    return ArrayInput(spec.name, array, spec.wire_dtype)


def _tensors(contract: StageContract, values: Mapping[str, Any], *, batched: bool = False
             ) -> list[grpcclient.InferInput]:
    return [_tensor(contract, name, value, batched) for name, value in values.items()
            if value is not None]


# --- omni ------------------------------------------------------------------------

def omni_inputs(
    text: str,
    *,
    image: bytes | None = None,
    audio: bytes | None = None,
    video: bytes | None = None,
    modalities: Sequence[str] | None = None,
    sampling_parameters: Mapping[str, Any] | None = None,
    voice: str | None = None,
    seed: int | None = None,
    task: str | None = None,
    session_id: str | None = None,
    history: Sequence[Mapping[str, str]] | None = None,
    talker_sampling: Mapping[str, Any] | None = None,
    stream_audio: bool | None = None,
    return_codec_ids: bool = False,
    extra: Mapping[str, Any] | None = None,
    use_audio_in_video: bool | None = None,
) -> list[grpcclient.InferInput]:
    """Input tensors of one request to an omni orchestrator.

    `talker_sampling` goes out as `talker_sampling_parameters` (JSON; None or
    empty: the checkpoint's defaults), `stream_audio` and `use_audio_in_video`
    only when given, and `return_codec_ids` only when true. `extra` adds inputs
    of the contract by name (e.g. a pipeline's session id), unknown names being
    a BadRequestError.

    Raises:
        BadRequestError: `text` is not a str, modalities is a bare string,
            the sampling parameters cannot be JSON-encoded, or
            stream_audio / return_codec_ids are not booleans.
    """
    if not isinstance(text, str):
        raise BadRequestError(f"text must be a str, got {type(text).__name__}")
    if isinstance(modalities, str):
        raise BadRequestError(f"modalities must be a list such as ['text', 'audio'], "
                              f"got the string {modalities!r}")
    values: dict[str, Any] = {
        OMNI.TEXT_INPUT: text,
        OMNI.IMAGE: None if image is None else np.array([image], dtype=np.object_),
        OMNI.AUDIO: None if audio is None else np.array([audio], dtype=np.object_),
        OMNI.VIDEO: None if video is None else np.array([video], dtype=np.object_),
        OMNI.MODALITIES: None if modalities is None else list(modalities),
        OMNI.SAMPLING_PARAMETERS: None if not sampling_parameters
        else _llm_io.encode_sampling_parameters(sampling_parameters),
        OMNI.VOICE: voice,
        OMNI.SEED: seed,
        OMNI.TASK: task,
        OMNI.SESSION_ID: session_id,
        OMNI.HISTORY: None if history is None else _llm_io.history_json(history),
        OMNI.TALKER_SAMPLING_PARAMETERS: None if not talker_sampling
        else _talker_sampling_json(talker_sampling),
        OMNI.STREAM_AUDIO: _flag("stream_audio", stream_audio),
        OMNI.USE_AUDIO_IN_VIDEO: _flag("use_audio_in_video", use_audio_in_video),
        OMNI.RETURN_CODEC_IDS: True if _flag("return_codec_ids", return_codec_ids) else None,
    }
    known = {spec.name for spec in OMNI_CONTRACT.inputs}
    for name, value in (extra or {}).items():
        if name not in known:
            raise BadRequestError(f"unknown omni input {name!r}; the contract has {sorted(known)}")
        values[name] = value
    return _tensors(OMNI_CONTRACT, values)


def _talker_sampling_json(talker_sampling: Mapping[str, Any]) -> str:
    if not isinstance(talker_sampling, Mapping):
        raise BadRequestError("talker_sampling must be a dict such as {'temperature': 0.7}, got "
                              f"{type(talker_sampling).__name__}")
    try:
        return json.dumps(dict(talker_sampling), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(f"talker_sampling must be JSON-serialisable: {exc}") from exc


def _flag(name: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool | np.bool_):
        return None if value is None else bool(value)
    raise BadRequestError(f"{name} must be True, False or None, got {value!r}")


def omni_outputs(*, codec_ids: bool = False) -> list[grpcclient.InferRequestedOutput]:
    """The outputs to ask for; `codec_ids` only with return_codec_ids (older servers lack it)."""
    return [grpcclient.InferRequestedOutput(spec.name) for spec in OMNI_CONTRACT.outputs
            if codec_ids or spec.name != OMNI.CODEC_IDS]


def _usage(metrics: Mapping[str, Any]) -> Usage | None:
    usage = metrics.get("usage")
    if not isinstance(usage, Mapping):
        return None
    return Usage(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))


def parse_omni(result: grpcclient.InferResult) -> list[Event]:
    """The events of one orchestrator response (text, audio, image, codec ids, final), in that order."""
    names = {o.name for o in result.get_response().outputs}
    events: list[Event] = []
    if OMNI.TEXT_OUTPUT in names:
        events.append(TextDelta(_text(result.as_numpy(OMNI.TEXT_OUTPUT))))
    if OMNI.AUDIO_CHUNK in names:
        samples = result.as_numpy(OMNI.AUDIO_CHUNK).astype(np.float32, copy=False).reshape(-1)
        rate = int(result.as_numpy(OMNI.SAMPLE_RATE).reshape(-1)[0])
        events.append(AudioChunk(samples, rate))
    if OMNI.IMAGE_OUTPUT in names:
        events.append(ImageOutput(bytes(result.as_numpy(OMNI.IMAGE_OUTPUT).reshape(-1)[0])))
    if OMNI.CODEC_IDS in names:
        codes = result.as_numpy(OMNI.CODEC_IDS)
        frames = codes.reshape(-1, codes.shape[-1] if codes.ndim == 2 else 1)  # [frames, groups]
        events.append(CodecIds(frames.astype(int).tolist()))
    if OMNI.FINISH_REASON in names:
        metrics: dict[str, Any] = {}
        if OMNI.METRICS in names:
            metrics = json.loads(_text(result.as_numpy(OMNI.METRICS)) or "{}")
        reason = _text(result.as_numpy(OMNI.FINISH_REASON)) or None
        events.append(Final(reason, _usage(metrics), metrics))
    return events


def _text(array: np.ndarray) -> str:
    value = array.reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


# --- llm -------------------------------------------------------------------------

def llm_final(deltas: Sequence[TextDelta]) -> Final:
    """The Final event closing an LLM stream (its last finish reason and token counts)."""
    reason = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
    n_in = next((d.num_input_tokens for d in reversed(deltas) if d.num_input_tokens is not None), None)
    counted = [d.num_output_tokens for d in deltas if d.num_output_tokens is not None]
    n_out = sum(counted) if counted else None  # each delta counts the tokens it adds
    usage = None if n_in is None and n_out is None else Usage(n_in or 0, n_out or 0)
    return Final(reason, usage)


# --- image -----------------------------------------------------------------------

def image_inputs(
    prompt: str,
    *,
    width: int | None = None,
    height: int | None = None,
    steps: int | None = None,
    guidance_scale: float | None = None,
    negative_prompt: str | None = None,
    seed: int | None = None,
    step_cache: bool | None = None,
) -> list[grpcclient.InferInput]:
    """Input tensors of one DiT request (with the batch dimension Triton's batcher needs).

    Raises:
        BadRequestError: `prompt` is not a str.
    """
    if not isinstance(prompt, str):
        raise BadRequestError(f"prompt must be a str, got {type(prompt).__name__}")
    values = {DIT.PROMPT: prompt, DIT.NEGATIVE_PROMPT: negative_prompt, DIT.WIDTH: width,
              DIT.HEIGHT: height, DIT.NUM_INFERENCE_STEPS: steps,
              DIT.GUIDANCE_SCALE: guidance_scale, DIT.SEED: seed, DIT.STEP_CACHE: step_cache}
    return _tensors(DIT_CONTRACT, values, batched=True)


def image_outputs() -> list[grpcclient.InferRequestedOutput]:
    return [grpcclient.InferRequestedOutput(DIT.IMAGE)]


def parse_image(result: grpcclient.InferResult) -> ImageOutput:
    return ImageOutput(bytes(result.as_numpy(DIT.IMAGE).reshape(-1)[0]))


# Re-exported for the clients: the LLM request/response helpers.
llm_inputs = _llm_io.build_inputs
llm_outputs = _llm_io.requested_outputs
parse_llm = _llm_io.parse_response
is_final = _llm_io.is_final
merge_sampling_parameters = _llm_io.merge_sampling_parameters
__all__ = ["LLM", "ModelKind", "image_inputs", "is_final", "llm_final", "model_kind", "omni_inputs",
           "parse_image", "parse_omni"]

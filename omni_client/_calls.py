"""What each call sends to which kind of model, shared by the sync and asyncio clients.

Runs in the caller's process, with no network I/O: `prepare_stream()` turns a
call's arguments and the model's config into a `Prepared` request (tensors,
requested outputs, and how to turn responses into events); the clients only
move it over gRPC.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tritonclient.grpc as grpcclient

from omni_client import _pipeline_io as io
from omni_client.errors import BadRequestError, ServerError
from omni_client.media import (
    AudioInput,
    ImageInput,
    VideoInput,
    audio_bytes,
    image_bytes,
    video_bytes,
)
from omni_client.types import ChatResult, Event, Final, ImageOutput, SpeechResult, TextDelta
from omni_serve.contract import ENTRY_PARAMETER

model_kind = io.model_kind
parse_image = io.parse_image


@dataclass(frozen=True)
class ModelInfo:
    """An entry model of the server.

    Attributes:
        name: the Triton model name.
        kind: "omni" (a pipeline: chat, speech, images), "llm" (text chat) or
            "image" (a DiT: image generation).
        backend: the Triton backend that serves it.
        internal: the model only serves a pipeline (e.g. a talker LLM, whose
            "text" is codec tokens); omni-gen-repo marks such models with the
            config parameter `omni.entry: "false"`.
    """

    name: str
    kind: io.ModelKind
    backend: str
    internal: bool = False


def model_info(name: str, config: Mapping[str, Any]) -> ModelInfo | None:
    kind = io.model_kind(config)
    if kind is None:
        return None
    entry = (config.get("parameters") or {}).get(ENTRY_PARAMETER, {}).get("string_value", "true")
    return ModelInfo(name, kind, str(config.get("backend", "")), internal=entry == "false")


@dataclass
class Prepared:
    """One request ready to send, and how its responses become events."""

    model: str
    inputs: list[grpcclient.InferInput]
    outputs: list[grpcclient.InferRequestedOutput]
    unary: bool
    parse: Callable[[Any], list[Event]]
    finish: Callable[[], list[Event]] = field(default=lambda: [])


def check_retries(retries: int) -> int:
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    return retries


def _is_batched(config: Mapping[str, Any]) -> bool:
    return int(config.get("max_batch_size", 0) or 0) > 0


def prepare_stream(model: str, config: Mapping[str, Any], text: str, *,
                   image: ImageInput | None = None, audio: AudioInput | None = None,
                   video: VideoInput | None = None, audio_sample_rate: int | None = None,
                   modalities: Sequence[str] | None = None,
                   sampling_parameters: Mapping[str, Any] | None = None,
                   max_tokens: int | None = None, temperature: float | None = None,
                   voice: str | None = None, seed: int | None = None, task: str | None = None,
                   session_id: str | None = None,
                   history: Sequence[Mapping[str, str]] | None = None,
                   talker_sampling: Mapping[str, Any] | None = None,
                   stream_audio: bool | None = None, return_codec_ids: bool = False,
                   inputs: Mapping[str, Any] | None = None,
                   use_audio_in_video: bool | None = None) -> Prepared:
    """The request `stream()` sends to `model` (whose Triton config is `config`).

    Raises:
        BadRequestError: the model is not an entry model, or an argument does
            not fit its kind (media for a text-only LLM, ...).
    """
    kind = io.model_kind(config)
    sampling = io.merge_sampling_parameters(sampling_parameters, max_tokens=max_tokens,
                                            temperature=temperature)
    if kind == "omni":
        tensors = io.omni_inputs(
            text, modalities=modalities, sampling_parameters=sampling, voice=voice, seed=seed,
            task=task, session_id=session_id, history=history, talker_sampling=talker_sampling,
            stream_audio=stream_audio, return_codec_ids=return_codec_ids, extra=inputs,
            use_audio_in_video=use_audio_in_video,
            image=None if image is None else image_bytes(image),
            audio=None if audio is None else audio_bytes(audio, sample_rate=audio_sample_rate),
            video=None if video is None else video_bytes(video))
        return Prepared(model, tensors, io.omni_outputs(codec_ids=bool(return_codec_ids)),
                        unary=False, parse=io.parse_omni)
    extras = {"image": image, "audio": audio, "video": video, "voice": voice, "task": task, "inputs": inputs,
              "session_id": session_id,
              "talker_sampling": talker_sampling or None, "stream_audio": stream_audio,
              "return_codec_ids": return_codec_ids or None,
              "use_audio_in_video": use_audio_in_video}
    if kind == "llm":
        _refuse(model, kind, {**extras, "seed": seed}, modalities, allowed=("text",))
        deltas: list[TextDelta] = []

        def parse(result: Any) -> list[Event]:
            delta = io.parse_llm(result)
            if delta is None:
                return []
            deltas.append(delta)
            return [delta]

        inputs = io.llm_inputs(text, stream=True, sampling_parameters=sampling, history=history)
        return Prepared(model, inputs,
                        io.llm_outputs(), unary=False, parse=parse,
                        finish=lambda: [io.llm_final(deltas)])
    if kind == "image":
        _refuse(model, kind, {**extras, "history": history, "sampling_parameters": sampling or None},
                modalities, allowed=("image",))
        tensors = io.image_inputs(text, seed=seed)
        return Prepared(model, tensors, io.image_outputs(), unary=True,
                        parse=lambda result: [io.parse_image(result)],
                        finish=lambda: [Final(None)])
    raise BadRequestError(f"model {model!r} (backend {config.get('backend')!r}) is not an entry "
                          "model; use an omni pipeline, an LLM or a DiT model")


def _refuse(model: str, kind: str, values: Mapping[str, Any], modalities: Sequence[str] | None,
            *, allowed: tuple[str, ...]) -> None:
    given = [name for name, value in values.items() if value is not None]
    if given:
        raise BadRequestError(f"model {model!r} is a {kind} model: it takes no {', '.join(given)}")
    if modalities is not None and set(modalities) - set(allowed):
        raise BadRequestError(f"model {model!r} is a {kind} model: modalities must be within "
                              f"{list(allowed)}, got {list(modalities)}")


def prepare_image(model: str, prompt: str, **fields: Any) -> Prepared:
    return Prepared(model, io.image_inputs(prompt, **fields), io.image_outputs(), unary=True,
                    parse=lambda result: [io.parse_image(result)], finish=lambda: [Final(None)])


def speech_result(result: ChatResult) -> SpeechResult:
    """The audio of a finished task-"speech" request.

    Raises:
        ServerError: the pipeline sent no audio at all.
    """
    if result.audio is None or result.sample_rate is None:
        raise ServerError("the pipeline finished without sending audio "
                          f"(finish reason {result.finish_reason!r})")
    return SpeechResult(result.audio, result.sample_rate, codec_ids=result.codec_ids)


__all__ = ["ImageOutput", "ModelInfo", "Prepared", "model_info", "prepare_image", "prepare_stream"]

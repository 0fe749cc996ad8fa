"""Requests and responses of the omni_llm stage (runs inside the Triton stub and in tests).

`parse_request` turns the named input tensors (already numpy) plus the Triton
request parameters into an `LLMRequest`, validating everything before the
engine sees it. It is the only place that knows the wire shapes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_serve.contract import LLM
from omni_serve.encoder import media as media_files
from omni_serve.encoder.config import MediaLimits, VideoLimits
from omni_serve.errors import RequestError, VerbatimRequestError
from omni_serve.fields import ChatRules, json_chat, scalar, text
from omni_serve.llm import sampling

# The `messages` chat, as the chat template reads it: any role; content a
# string or a list of {"type": "text", "text": str} parts.
MESSAGES_RULES = ChatRules(shape="a non-empty JSON array of messages", text_parts=True,
                           non_empty=True, json_position=True)


@dataclass
class LLMRequest:
    """One generation request as the stage sees it."""

    request_id: str
    prompt: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    # vllm_backend semantics: non-streaming responses carry the prompt unless
    # this is true; streaming responses never do.
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_token_ids: bool = False
    return_hidden_states: bool = False
    hidden_states_in_shm: bool = False
    # Omni extras: the prompt as token ids, and the media of a multimodal prompt.
    prompt_token_ids: list[int] | None = None
    # a chat for the checkpoint's chat template (OpenAI message dicts)
    messages: list[dict[str, Any]] | None = None
    media: Media | None = None
    return_input_token_ids: bool = False
    # vllm_backend's: a LoRA adapter of the model's multi_lora.json, images for a vision
    # model's own processor (PIL, RGB), and an embedding request for a pooling model
    lora_name: str | None = None
    images: list[Any] | None = None
    embed: EmbedRequest | None = None
    # sound files for an audio model's own processor (decoded by the stage, which knows
    # the model's feature rate)
    audios: list[bytes] | None = None
    # video files for a video model's own processor (decoded by the stage, which knows how
    # the model's family samples frames)
    videos: list[bytes] | None = None
    # hear each video's soundtrack, interleaved with its frames (vLLM's mm_processor_kwargs)
    use_audio_in_video: bool = False


@dataclass(frozen=True)
class EmbedRequest:
    """vllm_backend's `embedding_request`: what to embed and the pooling options."""

    input: str | list[int]
    dimensions: int | None = None


@dataclass(frozen=True)
class Media:
    """A multimodal prompt's media, as vLLM's omni thinkers take them (omni_serve.llm.media)."""

    image_embeds: np.ndarray | None = None  # float32 (rows, hidden): every image's rows
    image_grid_thw: np.ndarray | None = None  # int64 (images, 3)
    audio_features: np.ndarray | None = None  # float32 (mel bins, frames): every clip's
    audio_feature_lengths: np.ndarray | None = None  # int64 (clips,)


@dataclass
class LLMOutput:
    """One response: a delta (stream) or the whole text (non-stream)."""

    text: str
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int  # tokens this output adds (streaming: a delta; else all)
    final: bool
    token_ids: tuple[int, ...] = ()
    # vLLM's cumulative logprob of the reply so far (None unless sampling asks logprobs)
    cumulative_logprob: float | None = None
    # with sampling logprobs: one {token id: (logprob, rank, decoded token)} per new token
    logprobs: list[dict[int, tuple[float, int | None, str | None]]] | None = None
    # an embedding request's result
    embedding: list[float] | None = None
    # with return_hidden_states: new rows [input embedding | final hidden state]
    hidden: np.ndarray | None = None
    # with hidden_states_in_shm instead: the file, and (first row, rows added, width)
    hidden_file: str | None = None
    hidden_span: tuple[int, int, int] | None = None
    # with return_input_token_ids, on the first output: the prompt as the engine saw it
    input_token_ids: tuple[int, ...] | None = None
    # with sampling n > 1: one output per sequence, by index (what each sequence adds; the
    # outer output's num_output_tokens is their sum, its text and ids stay empty)
    sequences: tuple[LLMOutput, ...] | None = None


def merge_outputs(outputs: list[LLMOutput]) -> LLMOutput:
    """Several consecutive deltas of one request as one (texts joined, last counts)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    sequences = None
    if last.sequences is not None:
        sequences = tuple(merge_outputs([o.sequences[i] for o in outputs])
                          for i in range(len(last.sequences)))
    rows = [o.hidden for o in outputs if o.hidden is not None]
    spans = [o.hidden_span for o in outputs if o.hidden_span is not None]
    logprobs = [o.logprobs for o in outputs if o.logprobs is not None]
    return LLMOutput(text="".join(o.text for o in outputs), finish_reason=last.finish_reason,
                     num_input_tokens=last.num_input_tokens,
                     num_output_tokens=sum(o.num_output_tokens for o in outputs),
                     final=last.final, cumulative_logprob=last.cumulative_logprob,
                     logprobs=[d for lp in logprobs for d in lp] if logprobs else None,
                     embedding=last.embedding,
                     token_ids=tuple(t for o in outputs for t in o.token_ids),
                     hidden=np.concatenate(rows) if rows else None,
                     hidden_file=last.hidden_file,
                     input_token_ids=next((o.input_token_ids for o in outputs
                                           if o.input_token_ids is not None), None),
                     hidden_span=(spans[0][0], sum(s[1] for s in spans), spans[0][2])
                     if spans else None, sequences=sequences)


_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise RequestError(name, f"must be a boolean (true/false), got {value!r}")


def parse_request(
    request_id: str,
    tensors: dict[str, np.ndarray | None],
    parameters: str | dict[str, Any] | None = None,
) -> LLMRequest:
    """Validate the tensors and request parameters of one request.

    Request parameters may carry the boolean flags and any sampling field (as
    in vllm_backend); the `sampling_parameters` tensor wins on conflicts.
    """
    embed = _embedding_request(scalar(tensors, LLM.EMBEDDING_REQUEST))
    prompt = text(LLM.TEXT_INPUT, scalar(tensors, LLM.TEXT_INPUT))
    ids = token_ids(LLM.PROMPT_TOKEN_IDS, tensors.get(LLM.PROMPT_TOKEN_IDS))
    messages = json_chat(LLM.MESSAGES, scalar(tensors, LLM.MESSAGES), MESSAGES_RULES)
    if embed is not None:  # vllm_backend embeds `input` and reads no prompt
        prompt = ids = messages = None
    if messages is not None and (prompt is not None or ids is not None):
        raise RequestError(LLM.MESSAGES, f"send either it or {LLM.TEXT_INPUT} / "
                                         f"{LLM.PROMPT_TOKEN_IDS}, not both")
    if prompt is None and ids is None and messages is None and embed is None:
        raise RequestError(LLM.TEXT_INPUT, f"is required (or send {LLM.PROMPT_TOKEN_IDS} or "
                                           f"{LLM.MESSAGES})")
    if prompt is not None and ids is not None:
        raise RequestError(LLM.PROMPT_TOKEN_IDS, f"send either it or {LLM.TEXT_INPUT}, not both")
    if prompt is not None and not prompt:
        raise RequestError(LLM.TEXT_INPUT, "must not be empty")
    media = _media(tensors)
    if media is not None and prompt is None:
        field = LLM.IMAGE_EMBEDS if media.image_embeds is not None else LLM.AUDIO_FEATURES
        raise RequestError(field, f"needs a {LLM.TEXT_INPUT} with placeholder tokens")
    images = None if embed is not None else _images(tensors.get(LLM.IMAGE))
    audios = None if embed is not None else _files(LLM.AUDIO, tensors.get(LLM.AUDIO), "a sound")
    videos = None if embed is not None else _files(LLM.VIDEO, tensors.get(LLM.VIDEO), "a video")
    # a modality comes either raw or precomputed (a video only raw: beside an encoder
    # stage's image rows, its frames go through the thinker's own tower)
    embeds, features = (None, None) if media is None else (media.image_embeds, media.audio_features)
    for name, raw, computed in ((LLM.IMAGE, images, embeds), (LLM.AUDIO, audios, features),
                                (LLM.VIDEO, videos, None)):
        if raw and prompt is None:
            raise RequestError(name, f"needs a {LLM.TEXT_INPUT}")
        if raw and computed is not None:
            other = LLM.IMAGE_EMBEDS if name == LLM.IMAGE else LLM.AUDIO_FEATURES
            raise RequestError(name, f"send either it or {other}, not both")

    use_audio_in_video = _use_audio_in_video(tensors, videos, audios, features)

    params = _parameters_dict(parameters)
    flags: dict[str, bool] = {}
    for flag in LLM.FLAGS:
        value = scalar(tensors, flag)
        if value is None and flag in params:
            value = params.pop(flag)
        else:
            params.pop(flag, None)
        if value is not None:
            flags[flag] = _as_bool(flag, value)
    if flags.get(LLM.STREAM) and flags.get(LLM.EXCLUDE_INPUT_IN_OUTPUT) is False:
        # vllm_backend's text, verbatim: its clients match on it
        raise VerbatimRequestError(LLM.EXCLUDE_INPUT_IN_OUTPUT, STREAM_WITH_INPUT)

    if flags.get(LLM.HIDDEN_STATES_IN_SHM) and not flags.get(LLM.RETURN_HIDDEN_STATES):
        raise RequestError(LLM.HIDDEN_STATES_IN_SHM, f"needs {LLM.RETURN_HIDDEN_STATES}: true")
    tensor_json = sampling.parse_json(scalar(tensors, LLM.SAMPLING_PARAMETERS))
    lora_name = _lora_name(tensor_json.pop(LLM.LORA_NAME, None),
                           params.pop(LLM.LORA_NAME, None))
    from_params = sampling.coerce(params, source="parameters")
    from_tensor = sampling.coerce(tensor_json)
    return LLMRequest(request_id=request_id, prompt=prompt,
                      sampling={**from_params, **from_tensor}, prompt_token_ids=ids,
                      media=media, messages=messages, lora_name=lora_name, images=images,
                      audios=audios, videos=videos, embed=embed,
                      use_audio_in_video=use_audio_in_video, **flags)


def _use_audio_in_video(tensors: dict[str, np.ndarray | None], videos: list[bytes] | None,
                        audios: list[bytes] | None, features: np.ndarray | None) -> bool:
    """`use_audio_in_video`: only with videos, and then without other sound (vLLM's omni
    processors take each video's soundtrack as the prompt's audio items)."""
    value = scalar(tensors, LLM.USE_AUDIO_IN_VIDEO)
    if value is None or not _as_bool(LLM.USE_AUDIO_IN_VIDEO, value):
        return False
    if not videos:
        raise RequestError(LLM.USE_AUDIO_IN_VIDEO, f"needs {LLM.VIDEO}: it hears a video's "
                                                   "soundtrack")
    if audios or features is not None:
        raise RequestError(LLM.USE_AUDIO_IN_VIDEO, f"cannot be combined with {LLM.AUDIO} or "
                                                   f"{LLM.AUDIO_FEATURES}: send the sound in "
                                                   "the video")
    return True


# what one raw image or sound file may be (the encoder stage's defaults)
MEDIA_LIMITS = MediaLimits()

STREAM_WITH_INPUT = ("Error generating stream: When streaming, `exclude_input_in_output` = "
                     "False is not allowed.")


def _lora_name(from_tensor: Any, from_params: Any) -> str | None:
    """`lora_name` of the sampling_parameters tensor, else of the request parameters."""
    name, where = ((from_tensor, f"{sampling.FIELD}.{LLM.LORA_NAME}") if from_tensor is not None
                   else (from_params, f"parameters.{LLM.LORA_NAME}"))
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise RequestError(where, f"must be a non-empty string (an adapter name of the "
                                  f"model's multi_lora.json), got {name!r}")
    return name


def _images(arr: np.ndarray | None) -> list[Any] | None:
    """The `image` elements: base64 of an image file each, opened as RGB PIL images within
    the media limits (omni_serve.encoder.media)."""
    if arr is None:
        return None
    import base64
    import binascii

    images = []
    for i, value in enumerate(np.asarray(arr).reshape(-1)):
        where = f"{LLM.IMAGE}[{i}]"
        raw = text(where, value)
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RequestError(where, f"must be base64 of an image file ({e})") from e
        images.append(_decoded(where, media_files.decode_image, data))
    return images or None


def _files(name: str, arr: np.ndarray | None, what: str) -> list[bytes] | None:
    """The `audio` / `video` elements: a file's bytes each (decoded by the stage)."""
    if arr is None:
        return None
    files = []
    for i, value in enumerate(np.asarray(arr).reshape(-1)):
        data = value.encode("latin-1") if isinstance(value, str) else bytes(value)
        if not data:
            raise RequestError(f"{name}[{i}]", f"is empty; send {what} file's bytes")
        files.append(data)
    return files or None


def decode_audio_files(files: list[bytes], sample_rate: int) -> list[np.ndarray]:
    """Float32 mono samples of each file at `sample_rate`, within the media limits."""
    limits = MEDIA_LIMITS.model_copy(update={"sample_rate": sample_rate})
    return [_decoded(f"{LLM.AUDIO}[{i}]", media_files.decode_audio, data, limits)
            for i, data in enumerate(files)]


def decode_video_files(files: list[bytes], sampling: Any, *, sample_rate: int | None = None,
                       video_limits: VideoLimits | None = None
                       ) -> list[np.ndarray] | tuple[list[np.ndarray], list[np.ndarray]]:
    """Each video file's frames (uint8 [T, H, W, 3]) as the model family's processor samples
    them (`sampling`, omni_serve.encoder.video.VideoSampling), within `video_limits` (the
    stage's; None: the defaults), without their sound; with `sample_rate`, (frames,
    soundtracks): each file's sound as float32 mono at that rate too (RequestError for a file
    without sound)."""
    from omni_serve.encoder.video import decode_video

    limits = MEDIA_LIMITS.with_video(video_limits)
    if sample_rate is None:
        return [_decoded(f"{LLM.VIDEO}[{i}]", lambda d, lim: decode_video(
            d, lim, sampling, soundtrack=False).frames, data, limits)
            for i, data in enumerate(files)]
    limits = limits.model_copy(update={"sample_rate": sample_rate})
    clips = [_decoded(f"{LLM.VIDEO}[{i}]", lambda d, lim: decode_video(d, lim, sampling),
                      data, limits) for i, data in enumerate(files)]
    for i, clip in enumerate(clips):
        if clip.audio is None:
            raise RequestError(f"{LLM.VIDEO}[{i}]", f"has no audio stream, which "
                                                    f"{LLM.USE_AUDIO_IN_VIDEO} hears; send a "
                                                    "video with sound, or that flag false")
    return [c.frames for c in clips], [c.audio for c in clips]


def _decoded(where: str, decode, data: bytes, limits=None):
    """`decode(data, limits)`, its RequestError naming `where` instead of the encoder's field."""
    try:
        return decode(data, limits or MEDIA_LIMITS)
    except RequestError as e:
        raise RequestError(where, e.message) from None


def _embedding_request(value: Any) -> EmbedRequest | None:
    """vllm_backend's `embedding_request` JSON: {"input": text or token ids,
    "pooling_params": {"dimensions": [n]}} (other pooling_params keys are ignored there too)."""
    if value is None:
        return None
    field = LLM.EMBEDDING_REQUEST
    try:
        body = json.loads(text(field, value))
    except json.JSONDecodeError as e:
        raise RequestError(field, f"invalid JSON ({e.msg})") from e
    if not isinstance(body, dict) or "input" not in body:
        raise RequestError(field, 'must be a JSON object with "input" (text or token ids)')
    what = body["input"]
    ok_ids = (isinstance(what, list) and what
              and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in what))
    if not (isinstance(what, str) and what) and not ok_ids:
        raise RequestError(f"{field}.input", "must be non-empty text or a non-empty list of "
                                             f"token ids >= 0, got {what!r}"[:300])
    pooling = body.get("pooling_params") or {}
    if not isinstance(pooling, dict):
        raise RequestError(f"{field}.pooling_params", "must be a JSON object")
    dims = pooling.get("dimensions")
    if isinstance(dims, list) and dims:
        dims = dims[0]
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise RequestError(f"{field}.pooling_params.dimensions",
                           f"must be an integer >= 1 (or a list holding one), got {dims!r}")
    return EmbedRequest(input=what, dimensions=dims)


def token_ids(name: str, arr: np.ndarray | None) -> list[int] | None:
    """Non-negative integer token ids, flattened; None when not sent."""
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.dtype.kind not in "iu":
        raise RequestError(name, f"must be integers, got {arr.dtype}")
    ids = arr.reshape(-1)
    if ids.size == 0:
        raise RequestError(name, "must not be empty")
    if ids.min() < 0:
        raise RequestError(name, f"token ids must be >= 0, got {int(ids.min())}")
    return [int(t) for t in ids]


def _matrix(name: str, arr: np.ndarray | None, what: str) -> np.ndarray | None:
    """A finite non-empty FP32 matrix (a leading batch dim of 1 is dropped), copied."""
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.ndim == 3 and arr.shape[0] == 1:  # a client that sent a batch dim
        arr = arr[0]
    if arr.ndim != 2 or 0 in arr.shape:
        raise RequestError(name, f"must be a non-empty [{what}] matrix, got shape {list(arr.shape)}")
    if arr.dtype != np.float32:
        raise RequestError(name, f"must be FP32, got {arr.dtype}")
    if not np.isfinite(arr).all():
        raise RequestError(name, "must be finite (found NaN or inf)")
    # a copy: the request's tensor may be a view of memory Triton frees after execute()
    return np.array(arr, copy=True)


def counts(name: str, arr: np.ndarray | None, shape: str) -> np.ndarray | None:
    """Positive integers of the given shape ("n" or "n,3"), as int64."""
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.dtype.kind not in "iu":
        raise RequestError(name, f"must be integers, got {arr.dtype}")
    arr = arr.reshape(-1, 3) if shape == "n,3" and arr.size % 3 == 0 else arr.reshape(-1)
    if arr.size == 0 or (shape == "n,3" and arr.shape[-1] != 3):
        raise RequestError(name, f"must be a non-empty [{shape}] array, got {arr.size} values")
    if arr.min() < 1:
        raise RequestError(name, f"must be >= 1, got {int(arr.min())}")
    return arr.astype(np.int64)


def _paired(values: np.ndarray | None, counts: np.ndarray | None, names: tuple[str, str]) -> None:
    if (values is None) != (counts is None):
        have, need = names if values is not None else names[::-1]
        raise RequestError(need, f"is required with {have}")


def _media(tensors: dict[str, np.ndarray | None]) -> Media | None:
    image = _matrix(LLM.IMAGE_EMBEDS, tensors.get(LLM.IMAGE_EMBEDS), "tokens, hidden")
    grid = counts(LLM.IMAGE_GRID_THW, tensors.get(LLM.IMAGE_GRID_THW), "n,3")
    _paired(image, grid, (LLM.IMAGE_EMBEDS, LLM.IMAGE_GRID_THW))
    audio = _matrix(LLM.AUDIO_FEATURES, tensors.get(LLM.AUDIO_FEATURES), "mel bins, frames")
    lengths = counts(LLM.AUDIO_FEATURE_LENGTHS, tensors.get(LLM.AUDIO_FEATURE_LENGTHS), "n")
    _paired(audio, lengths, (LLM.AUDIO_FEATURES, LLM.AUDIO_FEATURE_LENGTHS))
    if audio is not None and int(lengths.sum()) != audio.shape[1]:
        raise RequestError(LLM.AUDIO_FEATURE_LENGTHS,
                           f"sum to {int(lengths.sum())} frames but {LLM.AUDIO_FEATURES} has "
                           f"{audio.shape[1]}")
    if image is None and audio is None:
        return None
    return Media(image, grid, audio, lengths)


def _parameters_dict(parameters: str | dict[str, Any] | None) -> dict[str, Any]:
    if not parameters:
        return {}
    if isinstance(parameters, dict):
        return dict(parameters)
    try:
        value = json.loads(parameters)
    except json.JSONDecodeError as e:
        raise RequestError("parameters", f"invalid JSON ({e.msg})") from e
    return dict(value) if isinstance(value, dict) else {}

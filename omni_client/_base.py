"""What OmniClient and AsyncOmniClient share: arguments, defaults and request building.

Runs in the caller's process, with no network I/O. The two clients differ only
in how they move a `Prepared` request over gRPC (tritonclient's threaded
stream, or grpc.aio); their calls, arguments, defaults, timeout rules,
retries and results are defined here once.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from omni_client import _calls, _llm_io
from omni_client._calls import ModelInfo, Prepared
from omni_client.errors import RequestTimeoutError
from omni_client.media import AudioInput, ImageInput, VideoInput
from omni_client.types import Completion, TextDelta

logger = logging.getLogger("omni_client")


class _Default(enum.Enum):
    CLIENT_TIMEOUT = "the client's timeout"


CLIENT_TIMEOUT = _Default.CLIENT_TIMEOUT
"""A call's `timeout` default: the timeout the client was made with."""
Timeout = float | None | _Default


class StreamOptions(TypedDict, total=False):
    """What `stream()` and `chat()` take besides the text (all optional).

    Attributes:
        image, audio: media inputs (omni pipelines): a path, the file's
            bytes, a PIL image / numpy samples (give `audio_sample_rate`).
        video: a video (omni pipelines whose thinker takes one): a path or
            the container file's bytes (MP4, MOV, MKV, WebM, AVI, ...).
        use_audio_in_video: with `video`, True hears its soundtrack interleaved
            with its frames, False sees the frames alone (default, None: the
            checkpoint processor's default, False for the Qwen omni models).
        modalities: outputs wanted, e.g. ["text", "audio"] (omni pipelines).
        sampling_parameters: vLLM SamplingParams fields for the LLM;
            `max_tokens` and `temperature` override the same keys.
        voice: of the speech output (a voice of the checkpoint or an alias of
            the orchestrator's voice_map, e.g. OpenAI's); seed: of the generators.
        task: "chat" (default) or "speech" (read the text aloud).
        session_id: omni pipelines with several thinker engines send a
            session's requests to the same one (its prefix cache hits).
        history: earlier turns, [{"role": "user"|"assistant", "content": str}].
            For an LLM model, history (even []) makes `text` the user's new
            message: the server renders the chat with the model's chat
            template, as vLLM's OpenAI server does (a "system" turn is allowed).
        talker_sampling: the talker's sampling (omni pipelines with speech):
            any of temperature (0: greedy), top_k, top_p, repetition_penalty,
            max_tokens, min_tokens; unset keys keep the checkpoint's
            defaults. Its seed is `seed`.
        stream_audio: False decodes the whole utterance at once and sends it
            as one AudioChunk (default, None: the server's, streamed).
        return_codec_ids: also yield the talker's codec ids (CodecIds
            events; ChatResult.codec_ids); needs audio output.
        inputs: further inputs of the omni contract by name.
    """

    image: ImageInput | None
    audio: AudioInput | None
    video: VideoInput | None
    use_audio_in_video: bool | None
    audio_sample_rate: int | None
    modalities: Sequence[str] | None
    sampling_parameters: Mapping[str, Any] | None
    max_tokens: int | None
    temperature: float | None
    voice: str | None
    seed: int | None
    task: str | None
    session_id: str | None
    history: Sequence[Mapping[str, str]] | None
    talker_sampling: Mapping[str, Any] | None
    stream_audio: bool | None
    return_codec_ids: bool
    inputs: Mapping[str, Any] | None


class ImageOptions(TypedDict, total=False):
    """What `generate_image()` takes besides the prompt (unset: the DiT stage's defaults).

    Attributes:
        step_cache: the DiT's first-block step cache on or off (faster, not
            bit-equal to an uncached run); None: the stage's `cache` setting.
    """

    width: int | None
    height: int | None
    steps: int | None
    guidance_scale: float | None
    negative_prompt: str | None
    seed: int | None
    step_cache: bool | None


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return timeout


class ClientBase:
    """The state and the I/O-free half of both clients (see OmniClient for the arguments)."""

    def __init__(self, url: str, *, timeout: float | None, model: str, retries: int,
                 retry_backoff_s: float, strict_stream_errors: bool | None) -> None:
        self.url = url
        self.model = model
        self.timeout = check_timeout(timeout)
        self.retries = _calls.check_retries(retries)
        self.retry_backoff_s = retry_backoff_s
        self._strict = strict_stream_errors
        self._configs: dict[str, dict] = {}

    def _resolve_timeout(self, timeout: Timeout) -> float | None:
        if timeout is CLIENT_TIMEOUT:
            return self.timeout
        return check_timeout(timeout)

    def _retry_delay(self, attempt: int) -> float | None:
        """Seconds before retry `attempt + 1` of an UnavailableError; None: give up."""
        if attempt == self.retries:
            return None
        delay = self.retry_backoff_s * 2 ** attempt
        logger.debug("unavailable; retry %d/%d in %.2fs", attempt + 1, self.retries, delay)
        return delay

    def _pick_model(self, models: Iterable[ModelInfo], kinds: Sequence[str]) -> str:
        """The first entry model of the first kind present; else `self.model`."""
        models = list(models)
        for kind in kinds:
            for info in models:
                if info.kind == kind and not info.internal:
                    return info.name
        return self.model

    def _ready_models(self, index: Mapping[str, Any]) -> list[str]:
        """The names of the READY models in a repository index."""
        return [row.get("name", "") for row in index.get("models", [])
                if row.get("state") == "READY"]

    def _keep_config(self, model: str, config: Mapping[str, Any]) -> dict:
        self._configs[model] = dict(config.get("config", config))
        return self._configs[model]

    def _llm_request(self, prompt: str, stream: bool, sampling_parameters: Mapping[str, Any] | None,
                     max_tokens: int | None, temperature: float | None) -> Prepared:
        """A `generate`/`generate_stream` request to `self.model`, parsed into TextDeltas."""
        merged = _llm_io.merge_sampling_parameters(
            sampling_parameters, max_tokens=max_tokens, temperature=temperature)
        inputs = _llm_io.build_inputs(prompt, stream=stream, sampling_parameters=merged)
        return Prepared(self.model, inputs, _llm_io.requested_outputs(), unary=False,
                        parse=lambda r: [] if (d := _llm_io.parse_response(r)) is None else [d])

    @staticmethod
    def _timed_out(model: str, wait_s: float | None, request_id: str) -> RequestTimeoutError:
        return RequestTimeoutError(f"no response from model {model!r} within {wait_s}s "
                                   f"(request id {request_id})")


def completion(deltas: Sequence[TextDelta]) -> Completion:
    """The deltas of one non-streamed generation, as one Completion."""
    def last(values: Iterable[Any]) -> Any:
        found = None
        for value in values:
            if value is not None:
                found = value
        return found

    counted = [d.num_output_tokens for d in deltas if d.num_output_tokens is not None]
    return Completion(text="".join(d.text for d in deltas),
                      finish_reason=last(d.finish_reason for d in deltas),
                      num_input_tokens=last(d.num_input_tokens for d in deltas),
                      num_output_tokens=sum(counted) if counted else None)

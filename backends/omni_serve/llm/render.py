"""One request's prompt rendered into the vLLM engine's input.

Runs on the omni_llm stage's event loop. What a request sends (token ids, a chat of
OpenAI messages, or prompt text with its media) goes through the engine's own renderer:
the chat through its chat template, as vLLM's OpenAI server renders it, the rest as
vLLM's completion path does. A chat the template refuses is the request's error.
"""
from __future__ import annotations

import asyncio
from typing import Any

from omni_serve.contract import LLM
from omni_serve.encoder.config import VideoLimits
from omni_serve.errors import RequestError
from omni_serve.llm.media import MediaShapes, multi_modal_data
from omni_serve.llm.request import LLMRequest, decode_audio_files, decode_video_files


async def render_prompt(engine: Any, prompt: dict) -> Any:
    """A completion prompt ({"prompt"} or {"prompt_token_ids"}, maybe with media)."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = parse_model_prompt(engine.model_config, prompt)
    (engine_input,) = await engine.renderer.render_cmpl_async([parsed])
    return engine_input


async def render_chat(engine: Any, messages: list[dict]) -> Any:
    """A chat, rendered by the checkpoint's chat template with the assistant's turn opened."""
    from jinja2 import TemplateError
    from vllm.renderers.params import ChatParams

    params = ChatParams(chat_template_kwargs={"add_generation_prompt": True})
    try:
        _, (engine_input,) = await engine.renderer.render_chat_async([messages], params)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise RequestError(LLM.MESSAGES, f"the chat template cannot render it: {exc}") from None
    return engine_input


async def render_request(engine: Any, req: LLMRequest, media_shapes: MediaShapes,
                         stage: str, audio_rate: int = 16000, video_sampling: Any = None,
                         video_limits: VideoLimits | None = None) -> Any:
    """The engine input of a (non-talker) request.

    `video_sampling`: how the model's family samples a clip's frames (VideoSampling; None
    for a model that takes no video); `video_limits`: the stage's limits on a clip (None:
    the defaults)."""
    if req.prompt_token_ids is not None:
        vocab = engine.model_config.get_vocab_size()
        if max(req.prompt_token_ids) >= vocab:
            raise RequestError(LLM.PROMPT_TOKEN_IDS,
                               f"token ids must be below the vocabulary size {vocab}, "
                               f"got {max(req.prompt_token_ids)}")
        return await render_prompt(engine, {"prompt_token_ids": req.prompt_token_ids})
    if req.messages is not None:
        return await render_chat(engine, req.messages)
    data: dict[str, Any] = {}
    if req.media is not None:  # what encoder stages computed (embeddings, features)
        data = multi_modal_data(req.media, req.prompt, media_shapes, stage)
    if req.images or req.audios or req.videos:  # raw media: the model's own processor takes them
        data |= await raw_media_data(req, stage, audio_rate, video_sampling, video_limits)
    if not data:
        return await render_prompt(engine, {"prompt": req.prompt})
    prompt = {"prompt": req.prompt, "multi_modal_data": data}
    if req.use_audio_in_video:  # each video's placeholder expands to its frames and sound
        prompt["mm_processor_kwargs"] = {"use_audio_in_video": True}
    return await render_prompt(engine, prompt)


async def raw_media_data(req: LLMRequest, stage: str, audio_rate: int, video_sampling: Any,
                         video_limits: VideoLimits | None = None) -> dict[str, Any]:
    """vLLM's `multi_modal_data` of raw media: images as they are, sound at the feature rate
    (so vLLM resamples nothing), each video as the frames its family's processor samples
    (decoded in a thread: the engine loop goes on), all of them given to the processor, so
    it samples none itself. With `use_audio_in_video`, each video's soundtrack at the feature
    rate is the prompt's audio item of that video (vLLM's omni processors pair the n-th
    audio with the n-th video)."""
    data: dict[str, Any] = {"image": req.images} if req.images else {}
    if req.audios:
        data["audio"] = [(samples, audio_rate)
                         for samples in decode_audio_files(req.audios, audio_rate)]
    if req.videos:
        if video_sampling is None:
            raise RequestError(LLM.VIDEO, f"stage {stage} serves a model that takes no video")
        if req.use_audio_in_video:
            data["video"], sounds = await asyncio.to_thread(
                decode_video_files, req.videos, video_sampling, sample_rate=audio_rate,
                video_limits=video_limits)
            data["audio"] = [(samples, audio_rate) for samples in sounds]
        else:
            data["video"] = await asyncio.to_thread(decode_video_files, req.videos,
                                                    video_sampling, video_limits=video_limits)
    return data

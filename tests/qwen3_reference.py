"""Qwen3-Omni's reference output in transformers: what the Qwen3 goldens compare the served pipeline to.

Where it runs: in the pytest process (CPU, fp32), beside the server under test or alone.
What flows through it: a checkpoint folder and a chat (messages, or processor inputs) in;
the thinker's greedy reply ids out (`thinker_reply`, text only), or `(reply_ids, codes,
waveform)` (`reference`), from `Qwen3OmniMoeForConditionalGeneration.generate(
return_audio=True, thinker_do_sample=False, talker_do_sample=False, speaker=...)` after
`torch.manual_seed(seed)`, greedy thinker and talker (in transformers 5.19 the code predictor
follows `talker_do_sample`). `codes` is `[frames, 16]` int64: the talker's code and the code
predictor's 15 for each frame, as Code2Wav received them; `waveform` float32 at 24 kHz.

transformers quirks the helper absorbs (ENVIRONMENT.md): `generate` stops the thinker on the
real `<|im_end|>` id (151645) unless told, so the tokenizer's `<|im_end|>` is passed; and
`generate(use_audio_in_video=True)` hands the flag to the thinker only (its talker kwargs take
just the grids), so the talker would place the interleaved frames and sound of its prompt as
if they were not: the flag is passed to the talker too (`talker_use_audio_in_video`), as
Qwen2.5-Omni's `generate` passes it.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

OUTPUT_SAMPLE_RATE = 24000


@functools.lru_cache(maxsize=4)
def load(folder: str | Path) -> tuple[Any, Any]:
    """(model, processor) of `folder`, fp32, eval; cached per folder (read them, never change them)."""
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    talker = model.talker.config if hasattr(model, "talker") else None  # none: Thinking
    if talker is not None and not hasattr(talker, "audio_config"):
        # transformers 5.19's talker computes its prompt's M-RoPE positions with the
        # thinker's get_rope_index, which reads config.audio_config.n_window when the
        # prompt holds audio and an image or video; the talker's config has none, so
        # speech about both raised AttributeError. The thinker's audio config is the one
        # that function reads for the same positions in the thinker.
        talker.audio_config = model.config.thinker_config.audio_config
    return model.eval(), AutoProcessor.from_pretrained(str(folder))


def processor_inputs(processor: Any, messages: Sequence[Mapping[str, Any]], *,
                     use_audio_in_video: bool = False) -> Any:
    """The processor's tensors for a chat: images, audio and videos taken from the parts that
    carry them.

    A part `{"type": "image", "image": PIL.Image}`, `{"type": "audio", "audio": float32 16 kHz
    samples}` or `{"type": "video", "video": uint8 [T, H, W, 3] frames}` renders as its
    placeholder and is passed to the processor in order; a video's frames are taken as they
    are (the processor's default `do_sample_frames=False`; its positions assume its default fps).
    With `use_audio_in_video` a video part's `"soundtrack"` (float32 16 kHz samples; not
    "audio", which the checkpoint's template renders as an audio part) is the audio item of
    that video, heard with its frames.
    """
    images, audio, videos = [], [], []
    for message in messages:
        content = message["content"]
        for part in [] if isinstance(content, str) else content:
            if part.get("type") == "image":
                images.append(part["image"])
            elif part.get("type") == "audio":
                audio.append(np.asarray(part["audio"], dtype=np.float32))
            elif part.get("type") == "video":
                videos.append(part["video"])
                if use_audio_in_video:
                    audio.append(np.asarray(part["soundtrack"], dtype=np.float32))
    heard = {"use_audio_in_video": True} if use_audio_in_video else {}
    prompt = processor.apply_chat_template(list(messages), add_generation_prompt=True,
                                           tokenize=False, **heard)
    return processor(text=prompt, images=images or None, audio=audio or None,
                     videos=videos or None, return_tensors="pt", **heard)


def thinker_reply(folder: str | Path, messages: Sequence[Mapping[str, Any]], *,
                  max_new_tokens: int, use_audio_in_video: bool = False) -> list[int]:
    """The thinker's greedy reply ids (`model.thinker.generate`) to a chat of any number of turns.

    `messages`: user and assistant turns (see `processor_inputs`), the last one the user's;
    the checkpoint's own chat template renders them, the assistant's turn opened after them.
    """
    model, processor = load(str(folder))
    heard = {"use_audio_in_video": True} if use_audio_in_video else {}
    inputs = processor_inputs(processor, messages, **heard)
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=im_end, **heard)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def reference(folder: str | Path, messages_or_inputs: Sequence[Mapping[str, Any]] | Mapping[str, Any], *,
              speaker: str, seed: int, max_new_tokens: int, talker_max_new_tokens: int = 64,
              use_audio_in_video: bool = False) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(reply token ids, codes [frames, 16] int64, waveform float32) of transformers on `folder`.

    `messages_or_inputs`: chat messages (see `processor_inputs`) or the processor's output.
    `max_new_tokens` bounds the thinker's reply, `talker_max_new_tokens` the codec frames.
    `use_audio_in_video`: each video is heard with its soundtrack (see `processor_inputs`).
    """
    model, processor = load(str(folder))
    heard = {"use_audio_in_video": True} if use_audio_in_video else {}
    inputs = messages_or_inputs
    if not isinstance(messages_or_inputs, Mapping):
        inputs = processor_inputs(processor, messages_or_inputs, **heard)
    captured: list[torch.Tensor] = []
    decode = model.code2wav.chunked_decode

    def chunked_decode(codes: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        captured.append(codes.detach().clone())
        return decode(codes, *args, **kwargs)

    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.code2wav.chunked_decode = chunked_decode
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            sequences, waveform = model.generate(
                **inputs, speaker=speaker, return_audio=True,
                thinker_do_sample=False, talker_do_sample=False,
                thinker_max_new_tokens=max_new_tokens, thinker_eos_token_id=im_end,
                talker_max_new_tokens=talker_max_new_tokens, **heard,
                **{f"talker_{k}": v for k, v in heard.items()})
    finally:
        del model.code2wav.chunked_decode  # back to the class's method
    reply = sequences[0, inputs["input_ids"].shape[1]:].tolist()
    codes = captured[-1][0].transpose(0, 1).to(torch.int64).numpy()  # [16, frames] -> [frames, 16]
    return reply, codes, waveform.reshape(-1).to(torch.float32).numpy()

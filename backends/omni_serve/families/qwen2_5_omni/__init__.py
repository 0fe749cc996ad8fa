"""Qwen2.5-Omni (Qwen/Qwen2.5-Omni-3B, -7B): the family's checkpoint layout, defaults and feeds.

Imported by omni_serve.families (any process), with the three plain modules:
- media_tokens.py: the thinker's media-token accounting (25 audio tokens a second);
- speech.py: the orchestrator's side (talker and Token2Wav requests, codes [frames, 1]);
- video.py: how its processor samples and sizes a clip's frames (2 a second).
The stage-side modules are named by path and loaded only in the process that runs them:
- thinker.py: vLLM's Qwen2.5-Omni thinker with the image-rows fix (vLLM worker);
- talker_model.py, talker_engine.py: the talker as a vLLM model and its
  per-step feed (vLLM engine core / worker);
- talker_prompt.py: the talker stage's side (prompt, sampling, stops);
- encoders.py: the encoder stage's side (the vision tower; log-mel features);
- token2wav.py: the audio decoder stage's side (Token2Wav: DiT flow matching and
  BigVGAN, the voices of spk_dict.pt, the default voice Chelsie);
- token2wav_context.py: Token2Wav's chunk context from config.json (omni-gen-repo).
Still outside: vLLM's hidden-state capture the talker reads (omni_serve/llm/hidden_states.py,
any family may ask for it); tools/omni_tools/tiny_omni.py and tiny_token2wav.py build
the tiny checkpoint.
"""
from __future__ import annotations

from omni_serve.families import Family
from omni_serve.families.qwen2_5_omni.media_tokens import Qwen25OmniMediaTokens
from omni_serve.families.qwen2_5_omni.speech import Qwen25OmniSpeech
from omni_serve.families.qwen2_5_omni.video import VIDEO_SAMPLING

# Qwen2.5-Omni's own (its model card): the talker speaks only with this one
SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech.")

# OpenAI's voices (what OpenAI apps send as `audio.voice`) onto the two voices of its
# spk_dict.pt, by how they sound: the female-sounding ones to Chelsie, the others to Ethan.
OPENAI_VOICE_MAP: dict[str, str] = {
    **dict.fromkeys(("alloy", "coral", "nova", "sage", "shimmer"), "Chelsie"),
    **dict.fromkeys(("ash", "ballad", "echo", "fable", "onyx", "verse"), "Ethan"),
}

FAMILY = Family(
    name="qwen2_5_omni",
    title="Qwen2.5-Omni",
    # the whole model, a thinker alone, a stand-alone Token2Wav (omni_tools.tiny_token2wav)
    model_types=("qwen2_5_omni", "qwen2_5_omni_thinker", "qwen2_5_omni_token2wav"),
    parts={
        "thinker": ("thinker.model.", ("tokenizer_config.json",)),
        "image_encoder": ("thinker.visual.", ("preprocessor_config.json",)),
        "audio_encoder": ("thinker.audio_tower.", ("preprocessor_config.json",)),
        "talker": ("talker.model.", ("spk_dict.pt",)),
        "audio_decoder": ("token2wav.", ("spk_dict.pt",)),
    },
    system_prompt=SYSTEM_PROMPT,
    voice_map=OPENAI_VOICE_MAP,
    # transformers' Qwen2_5OmniForConditionalGeneration.generate talker_* defaults
    talker_sampling={"temperature": 0.9, "top_k": 40, "top_p": 0.8, "repetition_penalty": 1.05},
    # 48 codes = 0.96 s: 24 also come in time at concurrency 1 on the tiny default, but
    # mean more decoder calls and later first audio at 16; sized from the pace (no
    # min_first_chunk_codes) it gained 3-5% at 1 and lost at 4 (docs/omni-chat.md, first chunk)
    speech_chunks={"first_chunk_codes": 48},
    speech=Qwen25OmniSpeech(),
    media_tokens=Qwen25OmniMediaTokens(),
    vllm_models={
        "Qwen2_5OmniModel": f"{__name__}.thinker:OmniThinker",
        "Qwen2_5OmniForConditionalGeneration": f"{__name__}.thinker:OmniThinker",
        # the talker stage's engine (talker_prompt.engine_args sets it through hf_overrides)
        "OmniTalkerForConditionalGeneration": f"{__name__}.talker_model:OmniTalker",
    },
    talker=f"{__name__}.talker_prompt:TalkerPrompter",
    encoders=f"{__name__}.encoders:load",
    decoder=f"{__name__}.token2wav:Token2Wav",
    decoder_context=f"{__name__}.token2wav_context:chunk_context",
    video=VIDEO_SAMPLING,
    # a clip's frames go to the thinker as they are: vLLM's own video processor and the
    # thinker's vision tower run there (the encoder stage encodes images only)
    raw_media=("video",),
    raw_media_shapes="omni_serve.families.processor_media_shapes:load",
)

"""Qwen2.5-Omni (Qwen/Qwen2.5-Omni-3B, -7B): the family's checkpoint layout, defaults and feeds.

Imported by omni_serve.families (any process); the stage-side modules are named
by path and loaded only in the process that runs them:
- thinker.py: vLLM's Qwen2.5-Omni thinker with the image-rows fix (vLLM worker);
- talker_model.py, talker_engine.py: the talker as a vLLM model and its
  per-step feed (vLLM engine core / worker);
- talker_prompt.py: the talker stage's side (prompt, sampling, stops);
- speech.py: the orchestrator's side (talker and Token2Wav requests).
Still with their stage kinds: the vision tower and features (encoder/runner.py),
Token2Wav (audio/runner.py); tools/omni_tools/tiny_omni.py builds the tiny checkpoint.
"""
from __future__ import annotations

from omni_serve.families import Family
from omni_serve.families.qwen2_5_omni.speech import Qwen25OmniSpeech

# Qwen2.5-Omni's own (its model card): the talker speaks only with this one
SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech.")

# OpenAI's voices (what OpenAI apps send as `audio.voice`) onto the two speakers of its
# spk_dict.pt, by how they sound: the female-sounding ones to Chelsie, the others to Ethan.
OPENAI_VOICE_MAP: dict[str, str] = {
    **dict.fromkeys(("alloy", "coral", "nova", "sage", "shimmer"), "Chelsie"),
    **dict.fromkeys(("ash", "ballad", "echo", "fable", "onyx", "verse"), "Ethan"),
}

FAMILY = Family(
    name="qwen2_5_omni",
    title="Qwen2.5-Omni",
    model_types=("qwen2_5_omni", "qwen2_5_omni_thinker"),
    parts={
        "thinker": ("thinker.model.", ("tokenizer_config.json",)),
        "image_encoder": ("thinker.visual.", ("preprocessor_config.json",)),
        "audio_encoder": ("thinker.audio_tower.", ("preprocessor_config.json",)),
        "talker": ("talker.model.", ("spk_dict.pt",)),
        "audio_decoder": ("token2wav.", ("spk_dict.pt",)),
    },
    system_prompt=SYSTEM_PROMPT,
    voice_map=OPENAI_VOICE_MAP,
    speech=Qwen25OmniSpeech(),
    vllm_models={
        "Qwen2_5OmniModel": f"{__name__}.thinker:OmniThinker",
        "Qwen2_5OmniForConditionalGeneration": f"{__name__}.thinker:OmniThinker",
        # the talker stage's engine (talker_prompt.engine_args sets it through hf_overrides)
        "OmniTalkerForConditionalGeneration": f"{__name__}.talker_model:OmniTalker",
    },
    talker=f"{__name__}.talker_prompt:TalkerPrompter",
)

"""Qwen3-Omni (Qwen/Qwen3-Omni-30B-A3B-Instruct, -Thinking, -Captioner): layout and defaults.

Imported by omni_serve.families (any process). The thinker is vLLM's own
`Qwen3OmniMoeThinkerForConditionalGeneration` (vLLM maps the whole model's
architecture to it), and it takes images, audio and video raw: vLLM accepts no
precomputed image inputs for this family, so its own processor and towers run
in the thinker's engine and the family has no encoder stage (`raw_media`).
The stage-side modules are named by path and loaded only where they run:
- code2wav.py: the audio decoder stage's side (Code2Wav, 16 codes a frame,
  1920 samples a frame at 24 kHz, causal);
- code2wav_context.py: Code2Wav's left context from config.json (omni-gen-repo);
- thinker.py: vLLM's thinker keeping the hidden state after accept_hidden_layer
  for the talker's rows (vLLM worker), and thinker_processor.py, its multimodal
  processor: vLLM's, but a sound's feature frames are transformers' (vLLM's own
  makes one more of a clip that is no whole number of 10 ms hops);
- talker_model.py, talker_engine.py: the talker and its code predictor as a vLLM
  model and its per-step feed (vLLM engine core / worker);
- talker_prompt.py: the talker stage's side (prompt, sampling, stops, frames).
With the plain modules speech.py: the orchestrator's side (talker and Code2Wav
requests, codes [frames, 16]), and video.py: how its processor samples and sizes a clip's
frames (1 a second).
Still outside: tools/omni_tools/tiny_qwen3_omni.py builds the tiny checkpoint.
"""
from __future__ import annotations

from omni_serve.families import Family
from omni_serve.families.qwen3_omni_moe.speech import Qwen3OmniSpeech
from omni_serve.families.qwen3_omni_moe.video import VIDEO_SAMPLING

# OpenAI's voices onto the talker's speakers (config.json talker_config.speaker_id), by
# how they sound: the female-sounding ones to Chelsie, the others to Ethan and Aiden.
OPENAI_VOICE_MAP: dict[str, str] = {
    **dict.fromkeys(("alloy", "coral", "nova", "sage", "shimmer"), "chelsie"),
    **dict.fromkeys(("ash", "echo", "onyx", "verse"), "ethan"),
    **dict.fromkeys(("ballad", "fable"), "aiden"),
}

# The talker's own speakers, named as transformers' generate(speaker="Ethan") takes them (it
# lower-cases the name): any case reaches config.json's lower-case speaker_id keys.
SPEAKERS = ("chelsie", "ethan", "aiden")

FAMILY = Family(
    name="qwen3_omni_moe",
    title="Qwen3-Omni",
    # the whole model (Instruct; Thinking and Captioner ship enable_audio_output false and
    # no talker), or a thinker alone
    model_types=("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
    parts={
        "thinker": ("thinker.model.", ("tokenizer_config.json", "preprocessor_config.json")),
        # the talker, its code predictor and projections (it also reads the thinker's
        # embed_tokens, which a folder with a thinker has)
        "talker": ("talker.", ()),
        "audio_decoder": ("code2wav.", ()),
    },
    # the model card asks for none; the thinker answers without one
    system_prompt=None,
    voice_map={**OPENAI_VOICE_MAP, **{name: name for name in SPEAKERS}},
    # transformers' Qwen3OmniMoeForConditionalGeneration.generate talker_* defaults
    talker_sampling={"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05},
    raw_media=("image", "audio", "video"),
    # 12 frames = 0.96 s: the smallest first chunk the second chunk followed in time at
    # concurrency 1 to 8 on the tiny checkpoint; smaller (down to 4), and the later chunks
    # growing from 4 to chunk_codes, when the measured pace allows (orchestrator/pace.py;
    # omni-bench first-chunk, docs/omni-chat.md)
    speech_chunks={"first_chunk_codes": 12, "min_first_chunk_codes": 4, "min_chunk_codes": 4},
    raw_media_shapes="omni_serve.families.processor_media_shapes:load",
    speech=Qwen3OmniSpeech(),
    vllm_models={
        # the thinker stage's engine: vLLM's thinker, keeping accept_hidden_layer's output
        "Qwen3OmniMoeForConditionalGeneration": f"{__name__}.thinker:Qwen3OmniThinker",
        # the talker stage's engine (talker_prompt.engine_args sets it through hf_overrides)
        "Qwen3OmniTalkerForConditionalGeneration": f"{__name__}.talker_model:Qwen3OmniTalker",
    },
    talker=f"{__name__}.talker_prompt:TalkerPrompter",
    decoder=f"{__name__}.code2wav:Code2Wav",
    decoder_context=f"{__name__}.code2wav_context:chunk_context",
    video=VIDEO_SAMPLING,
)

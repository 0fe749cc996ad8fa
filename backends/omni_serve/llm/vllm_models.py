"""A vLLM general plugin: the model classes this package puts in vLLM's registry.

Loaded by vLLM in every process it starts (pyproject.toml registers `register`
under `vllm.general_plugins`); the classes are named by import path, so
nothing is imported until vLLM builds that model in its worker.
"""
from __future__ import annotations

# checkpoint architecture -> the class vLLM builds for it
MODELS = {
    "Qwen2_5OmniModel": "omni_serve.llm.omni_thinker:OmniThinker",
    "Qwen2_5OmniForConditionalGeneration": "omni_serve.llm.omni_thinker:OmniThinker",
    # a talker stage's engine (talker/prompt.py sets it through hf_overrides)
    "OmniTalkerForConditionalGeneration": "omni_serve.talker.model:OmniTalker",
}


def register() -> None:
    from vllm import ModelRegistry

    for arch, path in MODELS.items():
        ModelRegistry.register_model(arch, path)

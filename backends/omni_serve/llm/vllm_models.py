"""A vLLM general plugin: the model families' classes in vLLM's registry.

Loaded by vLLM in every process it starts (pyproject.toml registers `register`
under `vllm.general_plugins`). Each family (omni_serve.families) names its
classes by import path (`Family.vllm_models`: checkpoint architecture ->
"module:Class"), so nothing is imported until vLLM builds that model.
"""
from __future__ import annotations


def models() -> dict[str, str]:
    """Checkpoint architecture -> the class vLLM builds for it, over every family."""
    from omni_serve import families

    return {arch: path for family in families.all_families()
            for arch, path in family.vllm_models.items()}


def register() -> None:
    from vllm import ModelRegistry

    for arch, path in models().items():
        ModelRegistry.register_model(arch, path)

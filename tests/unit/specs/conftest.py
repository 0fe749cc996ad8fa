"""Fixtures of the spec and omni-gen-repo tests (autouse here): no vLLM import, no model build."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from omni_tools import spec as spec_mod

# The real lookup, kept before the fixture below replaces it.
REAL_ENGINE_ARG_NAMES = spec_mod.vllm_engine_arg_names
FAKE_ENGINE_ARGS = frozenset({"model", "max_model_len", "enforce_eager", "max_num_seqs", "dtype",
                              "tensor_parallel_size", "gpu_memory_utilization", "seed"})


@pytest.fixture(autouse=True)
def fake_engine_args(monkeypatch):
    """vLLM's AsyncEngineArgs field names without importing vLLM (seconds per import)."""
    monkeypatch.setattr(spec_mod, "vllm_engine_arg_names", lambda: FAKE_ENGINE_ARGS)


@pytest.fixture(autouse=True)
def fake_tiny_models(monkeypatch, tmp_path_factory):
    """A stand-in for omni_tools.tiny_models: `qwen2-tiny` is a folder with a config.json."""
    root = tmp_path_factory.mktemp("tiny-cache")
    module = types.ModuleType("omni_tools.tiny_models")
    module.TINY_MODELS = {"qwen2-tiny": object()}
    module.built = []

    def ensure_model(name: str) -> Path:
        module.built.append(name)
        path = root / name
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text("{}")
        return path

    module.ensure_model = ensure_model
    monkeypatch.setitem(sys.modules, "omni_tools.tiny_models", module)
    return module


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A fake Hugging Face checkpoint directory."""
    path = tmp_path / "checkpoints" / "chat-model"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path

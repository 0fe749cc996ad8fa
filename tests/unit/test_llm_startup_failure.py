"""A vLLM engine that cannot build its model: the stage's error names the stage and the root
cause in one line (llm/startup_failure.py), not "See root cause above".

The engine here is real: vLLM's engine-core and worker processes try to build a tiny Qwen2
whose config asks for M-RoPE sections that do not fit its head_dim, the same assertion the
Qwen2.5-Omni-7B talker hit before its attention honoured head_dim.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from omni_serve.llm import startup_failure
from omni_tools.tiny_models import ensure_model


def test_the_first_logged_failure_is_the_one_quoted(monkeypatch):
    monkeypatch.delenv(startup_failure.ENV, raising=False)
    logger = logging.getLogger("vllm.omni_test")
    with pytest.raises(startup_failure.EngineStartError) as info:
        with startup_failure.watch("llm"):
            startup_failure.register()
            for message in ("deep cause", "later symptom"):
                try:
                    raise ValueError(message)
                except ValueError:
                    logger.exception("failed to start")
            raise RuntimeError("Engine core initialization failed. See root cause above.")
    text = str(info.value)
    assert text.startswith("stage llm: its vLLM engine failed to start: ValueError: deep cause (")
    assert "later symptom" not in text and "\n" not in text
    assert startup_failure.ENV not in os.environ


def test_without_a_logged_cause_the_exception_itself_is_quoted(monkeypatch):
    monkeypatch.delenv(startup_failure.ENV, raising=False)
    with pytest.raises(startup_failure.EngineStartError, match=r"stage talker: .*KeyError: 'x'"):
        with startup_failure.watch("talker"):
            raise KeyError("x")


def test_a_real_engine_that_cannot_build_its_model_names_the_cause(tmp_path, monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = tmp_path / "broken"
    shutil.copytree(ensure_model("qwen2-tiny"), model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_type": "default",
                                 "mrope_section": [1, 1, 1]}  # head_dim 64 needs a sum of 32
    (model / "config.json").write_text(json.dumps(config))
    args = AsyncEngineArgs(model=str(model), max_model_len=256, enforce_eager=True)
    with pytest.raises(startup_failure.EngineStartError) as info:
        with startup_failure.watch("llm"):
            AsyncLLM.from_engine_args(args)
    text = str(info.value)
    assert text.startswith("stage llm: its vLLM engine failed to start: AssertionError")
    assert "mrope_section" in text and "\n" not in text, text

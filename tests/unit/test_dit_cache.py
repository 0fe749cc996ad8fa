"""The omni_dit step cache (diffusers FirstBlockCache): switchable per request, always reset."""
from __future__ import annotations

import numpy as np
import pytest

from omni_serve.contract import DIT
from omni_serve.dit.config import DitStageConfig
from omni_serve.dit.request import DitRequest, group_key, parse_request
from omni_serve.dit.runner import DitRunner
from omni_serve.errors import RequestError
from omni_tools.tiny_models import ensure_model


@pytest.fixture(scope="module")
def model_path():
    return str(ensure_model("qwen-image-tiny"))


def req(i: int, cache: bool, steps: int = 8) -> DitRequest:
    return DitRequest(f"image {i}: a lighthouse", None, 32, 32, steps, 4.0, i, cache)


def test_step_cache_defaults_to_the_stage_setting_and_requests_override_it():
    prompt = {DIT.PROMPT: np.array([b"x"], dtype=object)}
    off = DitStageConfig(model="m")
    on = DitStageConfig(model="m", cache="first_block")
    assert parse_request(prompt, off).step_cache is False
    assert parse_request(prompt, on).step_cache is True
    assert parse_request({**prompt, DIT.STEP_CACHE: np.array([False])}, on).step_cache is False
    with pytest.raises(RequestError, match="step_cache: must be a boolean"):
        parse_request({**prompt, DIT.STEP_CACHE: np.array([3])}, off)


def test_cached_and_uncached_requests_never_share_a_call():
    assert group_key(req(0, True)) != group_key(req(0, False))


def test_the_cache_engages_and_is_off_again_after_the_call(model_path):
    # threshold 1.0: every step after the first reuses the cached residual
    runner = DitRunner(DitStageConfig(model=model_path, cache_threshold=1.0))
    plain = runner.run([req(1, False)])[0]
    assert runner.cache_stats == {"lookups": 0, "hits": 0}
    cached = runner.run([req(1, True)])[0]
    assert not runner.pipe.transformer.is_cache_enabled
    # 8 steps: the first computes, the other 7 reuse the cached residual
    assert runner.cache_stats == {"lookups": 8, "hits": 7}
    assert np.abs(plain.astype(int) - cached.astype(int)).max() > 0, "the cache changed nothing"
    # and it leaves no state behind: the uncached image is reproduced exactly
    assert np.array_equal(runner.run([req(1, False)])[0], plain)


def test_a_failing_cached_call_still_disables_the_cache(model_path, monkeypatch):
    runner = DitRunner(DitStageConfig(model=model_path))
    monkeypatch.setattr(runner, "pipe", runner.pipe)
    original = type(runner.pipe).__call__

    def boom(self, *a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(type(runner.pipe), "__call__", boom)
    out = runner.run([req(2, True)])
    assert isinstance(out[0], RuntimeError)
    assert not runner.pipe.transformer.is_cache_enabled
    monkeypatch.setattr(type(runner.pipe), "__call__", original)
    assert isinstance(runner.run([req(2, True)])[0], np.ndarray)

"""When a vLLM-hosted stage runs its engine's worker inside the engine core (asked for, CPU,
one worker, no executor chosen)."""
from __future__ import annotations

import os

import pytest

from omni_serve import env
from omni_serve.llm import cpu_engine


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(env.VLLM_WORKER_IN_ENGINE.name, raising=False)
    monkeypatch.delenv(cpu_engine.MULTIPROCESSING_ENV, raising=False)


@pytest.mark.parametrize("args, is_cpu, setting, expected", [
    ({"model": "m"}, True, None, False),  # off by default
    ({"model": "m"}, True, "0", False),
    ({"model": "m"}, True, "1", True),
    ({"model": "m", "tensor_parallel_size": 1, "data_parallel_size": "1"}, True, "1", True),
    ({"model": "m"}, False, "1", False),  # a GPU engine of one device runs so already
    ({"model": "m", "distributed_executor_backend": "mp"}, True, "1", False),  # chosen
    ({"model": "m", "tensor_parallel_size": 2}, True, "1", False),
    ({"model": "m", "pipeline_parallel_size": 2}, True, "1", False),
    ({"model": "m", "data_parallel_size": 2}, True, "1", False),
])
def test_only_a_one_worker_cpu_engine_with_no_executor_chosen(monkeypatch, args, is_cpu,
                                                               setting, expected):
    if setting is not None:
        monkeypatch.setenv(env.VLLM_WORKER_IN_ENGINE.name, setting)
    assert cpu_engine.in_engine_core(args, is_cpu=is_cpu) is expected


def test_prepare_names_the_uni_executor_and_keeps_the_platform_from_undoing_it():
    args = {"model": "m", "max_model_len": 64}
    out = cpu_engine.prepare(args)
    assert out == {**args, "distributed_executor_backend": "uni"}
    assert "distributed_executor_backend" not in args  # the caller's dict is left alone
    assert os.environ[cpu_engine.MULTIPROCESSING_ENV] == "0"

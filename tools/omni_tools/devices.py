"""`omni-gen-repo --device gpu`: a spec's stages moved onto the GPU.

Runs in the `omni-gen-repo` process (and in tests). Takes the spec as data (what
the YAML holds) and returns a copy whose compute stages run on one GPU each
instance: torch stages (encoders, audio decoder, DiT) get `device: cuda` and
KIND_GPU; vLLM stages (thinker, talker) get KIND_GPU and a share of the GPU's
memory, so that every vLLM engine of a server fits on one GPU beside the others.
The orchestrator stays where it is (it computes nothing on a GPU).
"""
from __future__ import annotations

import copy
from typing import Literal

from .spec import PARALLEL_ENGINE_ARGS, TORCH_DEVICE_BACKENDS

Device = Literal["cpu", "gpu"]
DEVICES: tuple[Device, ...] = ("cpu", "gpu")
VLLM_BACKENDS = ("omni_llm", "omni_talker")
# What all vLLM engines of one server take together, when the spec sets no
# gpu_memory_utilization: the rest is for the torch stages and CUDA contexts.
VLLM_MEMORY_SHARE = 0.6
CPU_ONLY_ENV_PREFIX = "VLLM_CPU_"


def _multi_gpu(stage: dict) -> bool:
    args = stage.get("engine_args") or {}
    return any(isinstance(args.get(k), int) and args[k] > 1 for k in PARALLEL_ENGINE_ARGS)


def on_gpu(data: dict) -> dict:
    """A copy of spec `data` with its compute stages on the GPU (see the module docstring).

    A vLLM stage that spreads over several GPUs (tensor/pipeline parallel) keeps
    KIND_MODEL, which lets vLLM place its workers; settings the spec already
    gives (gpu_memory_utilization) are kept.
    """
    out = copy.deepcopy(data)
    stages: dict = out.get("stages") or {}
    vllm_per_server: dict[str | None, int] = {}
    for stage in stages.values():
        if stage.get("backend") in VLLM_BACKENDS:
            server = stage.get("server")
            vllm_per_server[server] = vllm_per_server.get(server, 0) + 1
    for stage in stages.values():
        backend = stage.get("backend")
        if backend not in TORCH_DEVICE_BACKENDS and backend not in VLLM_BACKENDS:
            continue
        env = {k: v for k, v in (stage.get("env") or {}).items()
               if not k.startswith(CPU_ONLY_ENV_PREFIX)}
        if env:
            stage["env"] = env
        else:
            stage.pop("env", None)
        instances = dict(stage.get("instances") or {})
        instances.setdefault("count", 1)
        args = stage.setdefault("engine_args", {})
        if backend in TORCH_DEVICE_BACKENDS:
            args["device"] = "cuda"
            instances["kind"] = "KIND_GPU"
        else:
            share = VLLM_MEMORY_SHARE / vllm_per_server[stage.get("server")]
            args.setdefault("gpu_memory_utilization", round(share / instances["count"], 3))
            instances["kind"] = "KIND_MODEL" if _multi_gpu(stage) else "KIND_GPU"
        stage["instances"] = instances
    return out

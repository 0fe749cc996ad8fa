"""Where a vLLM-hosted model's engine arguments come from (runs in its Triton stub at load).

Two layouts, one model each: the generator's `engine.json` beside config.pbtxt
(`omni-gen-repo`), or Triton vllm_backend's `<version>/model.json`, so a vllm_backend
repository serves with only `backend: "vllm"` changed to `backend: "omni_llm"`. Its
multi_lora.json lives beside whichever file it is (llm/lora.py). vllm_backend's
model.json may write booleans as strings ("enforce_eager": "true", as its LoRA
tutorial does); those become booleans here, "false" included.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from omni_serve.contract import ENGINE_ARGS_FILE, VLLM_ENGINE_ARGS_FILE

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def locate(model_dir: str, version: str | int) -> str:
    """The engine-arguments file of the model in `model_dir` (version `version`)."""
    ours = os.path.join(model_dir, ENGINE_ARGS_FILE)
    theirs = os.path.join(model_dir, str(version), VLLM_ENGINE_ARGS_FILE)
    have_ours, have_theirs = os.path.isfile(ours), os.path.isfile(theirs)
    if have_ours and have_theirs:
        raise ValueError(f"both {ours} and {theirs} exist: keep one (engine.json is what "
                         f"omni-gen-repo writes, {VLLM_ENGINE_ARGS_FILE} a vllm_backend model's)")
    if not (have_ours or have_theirs):
        raise FileNotFoundError(f"no engine arguments for this model: write {theirs} (vLLM "
                                f"engine arguments, as for vllm_backend) or generate the "
                                f"repository with omni-gen-repo ({ours})")
    return ours if have_ours else theirs


def read(model_dir: str, version: str | int) -> tuple[dict[str, Any], str]:
    """(engine arguments, the folder they came from) of the model in `model_dir`."""
    path = locate(model_dir, version)
    with open(path) as f:
        try:
            args = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(args, dict):
        raise ValueError(f"{path}: must be a JSON object of vLLM engine arguments")
    if os.path.basename(path) == VLLM_ENGINE_ARGS_FILE:
        args = string_booleans(args)
    return args, os.path.dirname(path)


def _bool_fields() -> set[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)
            if f.type in (bool, bool | None, "bool", "bool | None")}


def string_booleans(args: dict[str, Any], bool_fields: set[str] | None = None) -> dict[str, Any]:
    """`args` with "true"/"false" strings of boolean engine arguments made booleans."""
    fields = _bool_fields() if bool_fields is None else bool_fields
    out = dict(args)
    for key, value in args.items():
        if key in fields and isinstance(value, str):
            low = value.strip().lower()
            if low not in _TRUE + _FALSE:
                raise ValueError(f"engine argument {key}: must be true or false, got {value!r}")
            out[key] = low in _TRUE
    return out


def check_instance_kind(args: dict[str, Any], instance_kind: str) -> None:
    """vllm_backend's refusal of a multi-GPU engine in a KIND_GPU instance (Triton places a
    KIND_GPU instance on one device; KIND_MODEL leaves the devices to the engine)."""
    parallel = int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))
    if parallel > 1 and str(instance_kind).upper() == "GPU":
        raise ValueError("KIND_GPU is currently for single-GPU models, please specify "
                         "KIND_MODEL in the model's config.pbtxt for multi-GPU models")

"""Requests and responses of the omni_llm stage (runs inside the Triton stub and in tests).

`parse_request` turns the named input tensors (already numpy) plus the Triton
request parameters into an `LLMRequest`, validating everything before the
engine sees it. It is the only place that knows the wire shapes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_serve.contract import LLM
from omni_serve.errors import RequestError
from omni_serve.fields import scalar, text
from omni_serve.llm import sampling


@dataclass
class LLMRequest:
    """One generation request as the stage sees it."""

    request_id: str
    prompt: str
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    # vllm_backend semantics: non-streaming responses carry the prompt unless
    # this is true; streaming responses never do.
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


@dataclass
class LLMOutput:
    """One response: a delta (stream) or the whole text (non-stream)."""

    text: str
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int
    final: bool


def merge_outputs(outputs: list[LLMOutput]) -> LLMOutput:
    """Several consecutive deltas of one request as one (texts joined, last counts)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return LLMOutput(text="".join(o.text for o in outputs), finish_reason=last.finish_reason,
                     num_input_tokens=last.num_input_tokens,
                     num_output_tokens=last.num_output_tokens, final=last.final)


_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise RequestError(name, f"must be a boolean (true/false), got {value!r}")


def parse_request(
    request_id: str,
    tensors: dict[str, np.ndarray | None],
    parameters: str | dict[str, Any] | None = None,
) -> LLMRequest:
    """Validate the tensors and request parameters of one request.

    Request parameters may carry the boolean flags and any sampling field (as
    in vllm_backend); the `sampling_parameters` tensor wins on conflicts.
    """
    prompt = text(LLM.TEXT_INPUT, scalar(tensors, LLM.TEXT_INPUT))
    if prompt is None:
        raise RequestError(LLM.TEXT_INPUT, "is required")
    if not prompt:
        raise RequestError(LLM.TEXT_INPUT, "must not be empty")

    params = _parameters_dict(parameters)
    flags: dict[str, bool] = {}
    for flag in LLM.FLAGS:
        value = scalar(tensors, flag)
        if value is None and flag in params:
            value = params.pop(flag)
        else:
            params.pop(flag, None)
        if value is not None:
            flags[flag] = _as_bool(flag, value)

    from_params = sampling.coerce(params, source="parameters")
    from_tensor = sampling.coerce(
        sampling.parse_json(scalar(tensors, LLM.SAMPLING_PARAMETERS))
    )
    return LLMRequest(request_id=request_id, prompt=prompt,
                      sampling={**from_params, **from_tensor}, **flags)


def _parameters_dict(parameters: str | dict[str, Any] | None) -> dict[str, Any]:
    if not parameters:
        return {}
    if isinstance(parameters, dict):
        return dict(parameters)
    try:
        value = json.loads(parameters)
    except json.JSONDecodeError as e:
        raise RequestError("parameters", f"invalid JSON ({e.msg})") from e
    return dict(value) if isinstance(value, dict) else {}

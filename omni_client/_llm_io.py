"""Tensors of one LLM-stage request and its responses, to and from plain Python values.

Runs in the caller's process, with no network I/O: `build_inputs()` turns a
prompt and sampling parameters into tritonclient `InferInput`s and
`parse_response()` turns one streamed `InferResult` into a `TextDelta`.
Tensor names, dtypes and shapes come from omni_serve.contract only.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from omni_client._tensor import ArrayInput
from omni_client.errors import BadRequestError
from omni_client.types import TextDelta
from omni_serve.contract import LLM, LLM_CONTRACT, TensorSpec

# Triton protocol parameter (not a tensor) set on a decoupled model's last
# response when the request asks for enable_empty_final_response.
FINAL_RESPONSE_PARAMETER = "triton_final_response"


# --- request ---------------------------------------------------------------------

def merge_sampling_parameters(
    sampling_parameters: Mapping[str, Any] | None, **shortcuts: Any
) -> dict[str, Any]:
    """Return `sampling_parameters` updated with the shortcuts that are not None.

    Keyword shortcuts (max_tokens=..., temperature=...) win over the same key
    in the mapping.

    Raises:
        BadRequestError: `sampling_parameters` is not a mapping.
    """
    if sampling_parameters is not None and not isinstance(sampling_parameters, Mapping):
        raise BadRequestError(
            f"sampling_parameters must be a dict, got {type(sampling_parameters).__name__}")
    merged = dict(sampling_parameters or {})
    merged.update({key: value for key, value in shortcuts.items() if value is not None})
    return merged


def encode_sampling_parameters(sampling_parameters: Mapping[str, Any]) -> str:
    """JSON-encode sampling parameters for the `sampling_parameters` tensor.

    Raises:
        BadRequestError: a value is not JSON-serialisable (or is NaN/inf).
    """
    try:
        return json.dumps(dict(sampling_parameters), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(f"sampling_parameters must be JSON-serialisable: {exc}") from exc


def _tensor(spec: TensorSpec, value: Any) -> grpcclient.InferInput:
    if spec.np_dtype is np.object_ and isinstance(value, str):
        value = value.encode("utf-8")
    array = np.array([value], dtype=spec.np_dtype).reshape(spec.dims)
    return ArrayInput(spec.name, array, spec.wire_dtype)


def history_json(history: Sequence[Mapping[str, Any]], new_turn: str | None = None) -> str:
    """Earlier turns as JSON (and, given `new_turn`, the user's new message after them)."""
    if isinstance(history, str | bytes) or not all(isinstance(t, Mapping) for t in history):
        raise BadRequestError("history must be a list of {'role': 'user'|'assistant', "
                              "'content': str} turns")
    turns = [dict(turn) for turn in history]
    if new_turn is not None:
        turns.append({"role": "user", "content": new_turn})
    return json.dumps(turns)


def build_inputs(
    prompt: str, *, stream: bool, sampling_parameters: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]] | None = None,
) -> list[grpcclient.InferInput]:
    """Build the LLM-stage input tensors of one request (shape [1] each, no batch dim).

    Without `history`, `prompt` is the prompt text itself. With it (even empty), `prompt`
    is the user's new message: history + it go as `messages`, a chat the server renders
    with the model's chat template (as vLLM's OpenAI server does). Asks for the prompt to
    be left out of the output and for the finish reason and token counts to be returned.

    Raises:
        BadRequestError: `prompt` is not a str or the sampling parameters
            cannot be JSON-encoded.
    """
    if not isinstance(prompt, str):
        raise BadRequestError(f"prompt must be a str, got {type(prompt).__name__}")
    chat = None if history is None else history_json(history, prompt)
    values: dict[str, Any] = {
        **({LLM.TEXT_INPUT: prompt} if chat is None else {LLM.MESSAGES: chat}),
        LLM.STREAM: stream,
        LLM.SAMPLING_PARAMETERS: encode_sampling_parameters(sampling_parameters),
        LLM.EXCLUDE_INPUT_IN_OUTPUT: True,
        LLM.RETURN_FINISH_REASON: True,
        LLM.RETURN_NUM_INPUT_TOKENS: True,
        LLM.RETURN_NUM_OUTPUT_TOKENS: True,
    }
    return [_tensor(LLM_CONTRACT.input(name), value) for name, value in values.items()]


def requested_outputs() -> list[grpcclient.InferRequestedOutput]:
    """The outputs a text request reads (so stage extras such as hidden states are not sent)."""
    names = (LLM.TEXT_OUTPUT, LLM.FINISH_REASON, LLM.NUM_INPUT_TOKENS, LLM.NUM_OUTPUT_TOKENS)
    return [grpcclient.InferRequestedOutput(LLM_CONTRACT.output(name).name) for name in names]


# --- response --------------------------------------------------------------------

def _strings(array: np.ndarray | None) -> list[str] | None:
    if array is None:
        return None
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
            for v in array.reshape(-1)]


def _first_int(array: np.ndarray | None) -> int | None:
    if array is None or array.size == 0:
        return None
    return int(array.reshape(-1)[0])


def _finish_reason(array: np.ndarray | None) -> str | None:
    reasons = _strings(array)
    if not reasons or reasons[0] in ("", "None"):
        return None
    return reasons[0]


def is_final(result: grpcclient.InferResult) -> bool:
    """Whether this is the last response of its request."""
    parameters = result.get_response().parameters
    return FINAL_RESPONSE_PARAMETER in parameters and parameters[
        FINAL_RESPONSE_PARAMETER].bool_param


def parse_response(result: grpcclient.InferResult) -> TextDelta | None:
    """Turn one LLM-stage response into a TextDelta; None for an output-less (final) response."""
    text = _strings(result.as_numpy(LLM.TEXT_OUTPUT))
    finish_reason = result.as_numpy(LLM.FINISH_REASON)
    num_input = result.as_numpy(LLM.NUM_INPUT_TOKENS)
    num_output = result.as_numpy(LLM.NUM_OUTPUT_TOKENS)
    if text is None and finish_reason is None and num_input is None and num_output is None:
        return None
    return TextDelta(
        text="".join(text or ()),
        finish_reason=_finish_reason(finish_reason),
        num_input_tokens=_first_int(num_input),
        num_output_tokens=_first_int(num_output),
    )

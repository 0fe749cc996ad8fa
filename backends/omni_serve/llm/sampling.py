"""vLLM SamplingParams from request JSON (runs in the omni_llm stage).

Values arrive as JSON from the `sampling_parameters` tensor or as Triton
request parameters (which carry only bool/int/string), so every field is
coerced to the type vLLM declares for it ("0.7" -> 0.7, "true" -> True,
{"50256": -100} -> {50256: -100.0}). Unknown fields, fields that make no sense
over this interface, and values vLLM rejects become `RequestError`s naming the
field.
"""
from __future__ import annotations

import functools
import json
import typing
from typing import Any

from omni_serve.errors import RequestError

FIELD = "sampling_parameters"

# The engine's request serializer (msgspec) carries integers in this range only; a
# larger one would fail inside vLLM, after validation, as an anonymous engine error.
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1

# SamplingParams fields the stage owns or that would break the text interface.
_NOT_SETTABLE = {
    "output_kind",  # the stage chooses DELTA/FINAL_ONLY from `stream`
    "detokenize",  # text_output needs detokenized text
    "skip_clone",
    "output_text_buffer_length",
    "prompt_logprob_token_ids",
    "trace_decode_token_ids",
    "routed_experts_prompt_start",
    # prompt logprobs are not part of this stage's outputs (`logprobs` is: return_logprobs)
    "prompt_logprobs",
    "flat_logprobs",
    "logprob_token_ids",
    "prompt_logprob_start",
}


@functools.cache
def _field_adapters() -> dict[str, Any]:
    """Field name -> pydantic TypeAdapter for every settable SamplingParams field."""
    import msgspec
    from pydantic import TypeAdapter
    from vllm import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    adapters = {}
    for f in msgspec.structs.fields(SamplingParams):
        if f.name.startswith("_") or f.name in _NOT_SETTABLE:
            continue
        try:
            adapters[f.name] = TypeAdapter(hints[f.name])
        except Exception:  # a type pydantic cannot validate is not settable over JSON
            continue
    return adapters


def settable_fields() -> list[str]:
    """The SamplingParams fields a request may set, sorted."""
    return sorted(_field_adapters())


def parse_json(text: str | bytes | None) -> dict[str, Any]:
    """Parse the `sampling_parameters` tensor value into a dict ({} if empty)."""
    if text is None:
        return {}
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(FIELD, f"not valid UTF-8 ({e})") from e
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"at line {e.lineno} column {e.colno}"
        raise RequestError(FIELD, f"invalid JSON ({e.msg} {where})") from e
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, deep nesting
        raise RequestError(FIELD, f"invalid JSON ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(value, dict):
        raise RequestError(FIELD, f"must be a JSON object, got {type(value).__name__}")
    return value


def coerce(raw: dict[str, Any], *, source: str = FIELD) -> dict[str, Any]:
    """Coerce each value to its SamplingParams type; reject unknown fields."""
    import pydantic

    adapters = _field_adapters()
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "structured_outputs" and isinstance(value, str):
            value = _json_field(f"{source}.{key}", value)  # vllm_backend sends it JSON-encoded
        adapter = adapters.get(key)
        if adapter is None:
            raise RequestError(f"{source}.{key}", _unknown_field_message(key))
        try:
            out[key] = adapter.validate_python(value)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            raise RequestError(f"{source}.{key}", f"{first['msg']} (got {value!r})") from e
        _check_ints(f"{source}.{key}", out[key])
    return out


def _json_field(where: str, text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise RequestError(where, f"a string here must be a JSON object ({e})") from e


def _check_ints(where: str, value: Any) -> None:
    """Every integer in `value` (nested lists and dict keys included) fits the engine's range."""
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        items = [value]
    for item in items:
        if isinstance(item, (dict, list, tuple, set, frozenset)):
            _check_ints(where, item)
        elif isinstance(item, int) and not isinstance(item, bool) and not INT_MIN <= item <= INT_MAX:
            shown = str(item) if item.bit_length() <= 128 else f"a {item.bit_length()}-bit integer"
            raise RequestError(where, f"integers must be between -2**63 and 2**64 - 1, got {shown}")


def _unknown_field_message(key: str) -> str:
    import difflib

    fields = settable_fields()
    close = difflib.get_close_matches(key, fields, n=3)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"unknown sampling parameter{hint}; allowed: {', '.join(fields)}"


def build(fields: dict[str, Any], *, stream: bool, default_max_tokens: int | None = None,
          max_n: tuple[int, str] = (1, "this stage generates one sequence per request")):
    """Build vLLM SamplingParams; vLLM's own range checks become RequestErrors.

    `n` (sequences per prompt) must be within 1 and `max_n` = (limit, why).
    """
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind

    fields = dict(fields)
    n, (limit, why) = fields.get("n", 1), max_n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestError(f"{FIELD}.n", f"must be a positive integer, got {n!r}")
    if n > limit:
        allowed = "1" if limit == 1 else f"between 1 and {limit}"
        raise RequestError(f"{FIELD}.n", f"must be {allowed} ({why}), got {n}")
    if default_max_tokens is not None and "max_tokens" not in fields:
        fields["max_tokens"] = default_max_tokens
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**fields, output_kind=kind)
    except (VLLMClientError, ValueError, TypeError) as e:
        raise client_error(e, FIELD) from e


def client_error(e: Exception, field: str) -> RequestError:
    """A RequestError from a vLLM validation error, naming its parameter when known."""
    param = getattr(e, "parameter", None)
    msg = e.args[0] if e.args else str(e)
    return RequestError(f"{field}.{param}" if param else field, str(msg))

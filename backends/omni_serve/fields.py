"""Reading one request's scalar input tensors, shared by the stages' request parsers.

Runs inside the Triton stub and in tests. Every failure is a `RequestError`
naming the tensor, so a bad value answers that request alone.
"""
from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np

from omni_serve.errors import RequestError


def scalar(tensors: dict[str, np.ndarray | None], name: str) -> Any:
    """The single element of input `name` (None when the request did not send it)."""
    arr = tensors.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise RequestError(name, f"expected exactly one element, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def text(name: str, value: Any) -> str | None:
    """A BYTES element as UTF-8 text."""
    if value is None:
        return None
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(name, f"not valid UTF-8 ({e})") from e
    if isinstance(value, (str, np.str_)):
        return str(value)
    raise RequestError(name, f"must be a string, got {type(value).__name__}")


def boolean(name: str, value: Any) -> bool | None:
    """A BOOL element (None when not sent)."""
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(name, f"must be a boolean (true/false), got {value!r}")
    return bool(value)


def integer(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise RequestError(name, f"must be an integer, got {value!r}")
    return int(value)


def number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise RequestError(name, f"must be a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise RequestError(name, f"must be finite, got {value!r}")
    return float(value)


SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


def seed(tensors: dict[str, np.ndarray | None], name: str) -> int:
    """A 64-bit signed seed input; a random one when the request did not send it."""
    value = integer(name, scalar(tensors, name))
    if value is None:
        return secrets.randbelow(2**63)  # not reproducible: the caller did not pin it
    if not SEED_MIN <= value <= SEED_MAX:
        raise RequestError(name, f"must be a 64-bit signed integer, got {value}")
    return value

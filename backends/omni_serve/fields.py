"""Reading one request's scalar input tensors, shared by the stages' request parsers.

Runs inside the Triton stub and in tests. Scalars (text, booleans, numbers,
seeds) and JSON chats (the llm stage's `messages`, the orchestrator's
`history`) come in as tensor elements and go out as Python values. Every
failure is a `RequestError` naming the tensor, so a bad value answers that
request alone.
"""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ChatRules:
    """What a JSON chat input accepts; `json_chat`'s errors are worded from it."""

    shape: str  # what the whole input must be, as an error says it
    roles: tuple[str, ...] | None = None  # None: any string role
    keys: tuple[str, ...] | None = None  # the keys a message may have; None: any
    text_parts: bool = False  # content may also be a list of {"type": "text"} parts
    # content may also be a list of text parts and parts of these types (the caller checks
    # each such part's value)
    media_parts: tuple[str, ...] = ()
    non_empty: bool = False  # else blank text or [] is a chat without messages
    json_position: bool = False  # an invalid-JSON error quotes line and column


def json_chat(name: str, value: Any, rules: ChatRules) -> list[dict[str, Any]] | None:
    """A BYTES element holding a JSON array of {"role", "content"} messages.

    None when the request did not send it (or, without `rules.non_empty`,
    sent blank text). Messages are returned as decoded.
    """
    raw = text(name, value)
    if raw is None or (not rules.non_empty and not raw.strip()):
        return None
    try:
        chat = json.loads(raw)
    except ValueError as e:
        detail = f": {e}" if rules.json_position else f" ({getattr(e, 'msg', e)})"
        raise RequestError(name, f"invalid JSON{detail}") from e
    if not isinstance(chat, list) or (rules.non_empty and not chat):
        raise RequestError(name, f"must be {rules.shape}")
    for i, message in enumerate(chat):
        _chat_message(f"{name}[{i}]", message, name, rules)
    return chat


def _chat_message(where: str, message: Any, name: str, rules: ChatRules) -> None:
    # role: any string is one check with the object's; a closed set is its own field
    if rules.roles is None:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(where, 'must be an object with a string "role"')
    elif not isinstance(message, dict):
        raise RequestError(where, f"must be an object; {name} must be {rules.shape}")
    if rules.keys is not None:
        extra = sorted(set(message) - set(rules.keys))
        if extra:
            raise RequestError(where, f"unknown key {extra[0]!r}; allowed: {', '.join(rules.keys)}")
    role = message.get("role")
    if rules.roles is not None and role not in rules.roles:
        raise RequestError(f"{where}.role", f"must be one of {list(rules.roles)}, got {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return
    if rules.media_parts:
        _content_parts(f"{where}.content", content, rules.media_parts)
        return
    if not rules.text_parts:
        raise RequestError(f"{where}.content", f"must be a string, got {content!r}"[:200])
    if not isinstance(content, list) or not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        raise RequestError(f"{where}.content",
                           'must be a string or a list of {"type": "text", "text": ...} parts')


def _content_parts(where: str, content: Any, media: tuple[str, ...]) -> None:
    kinds = ", ".join(f'{{"type": "{kind}", "{kind}": ...}}' for kind in media)
    if not isinstance(content, list) or not content:
        raise RequestError(where, f'must be a string or a non-empty list of {{"type": "text", '
                                  f'"text": ...}} and {kinds} parts, got {content!r}'[:300])
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", *media):
            raise RequestError(f"{where}[{j}]", f'must be a {{"type": "text", "text": ...}} or '
                                                f"{kinds} part")
        extra = sorted(set(part) - {"type", kind})
        if extra:
            raise RequestError(f"{where}[{j}]", f"unknown key {extra[0]!r}; allowed: type, {kind}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}].text", "must be a string")

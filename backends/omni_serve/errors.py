"""The error taxonomy shared by every stage (runs inside the Triton stub and in tests).

A `RequestError` is one request's fault: the adapter answers that request with
Triton INVALID_ARG and keeps serving. Anything else escaping stage logic is a
server fault (INTERNAL). Never `assert` on user input.
"""
from __future__ import annotations

import re


class RequestError(ValueError):
    """A bad request; `field` names the offending input (tensor, parameter or key)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class VerbatimRequestError(RequestError):
    """A RequestError whose text is another server's, verbatim (Triton's vllm_backend):
    that server's clients match on it. `field` still names the input."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.args = (message,)


class StageUnavailableError(RuntimeError):
    """The stage cannot serve now (engine dead, shutting down); maps to UNAVAILABLE."""


class StageOverloadedError(StageUnavailableError):
    """The stage's queue is full (its `queue.max_queue_size`): UNAVAILABLE, retry later.
    Its message says "is overloaded", as Triton's own full queue says "Exceeds maximum
    queue size": the orchestrator tries another engine but does not pass this one over."""


OVERLOADED_MESSAGES = ("is overloaded", "exceeds maximum queue size")


def is_overloaded(message: str) -> bool:
    lowered = message.lower()
    return any(m in lowered for m in OVERLOADED_MESSAGES)


class RequestCancelledError(RuntimeError):
    """The client cancelled the request before its stage computed it; maps to CANCELLED."""


ErrorCode = str  # "INVALID_ARG" | "UNAVAILABLE" | "INTERNAL" | "CANCELLED"


class StageFailedError(RuntimeError):
    """A stage the orchestrator called failed; the message names the stage.

    `code` is the Triton error code the client gets: the stage's own code for
    a rejected request (INVALID_ARG), UNAVAILABLE when the stage is down or
    silent past its timeout, INTERNAL otherwise.
    """

    def __init__(self, role: str, model: str, message: str, code: ErrorCode = "INTERNAL"):
        super().__init__(f"stage '{role}' (model {model}) failed: {message}")
        self.role = role
        self.model = model
        self.code = code


# --- codes on the wire -----------------------------------------------------------------
#
# An error response on a Triton gRPC stream reaches the caller as its message only
# (the code is lost) unless the stream was opened with the `triton_grpc_error: true`
# header. Triton before 2.53 (NGC 24.12, server PR #7840) can crash with that header
# when streams end in errors (`omni-bench stream-errors`: Signal 11 after ~4000
# such streams on 2.51), so on those releases nothing of this project sends it and
# the code is read back from the message by `code_of_message`.

STRICT_STREAM_ERRORS_SINCE = (2, 53)
STRICT_STREAM_ERRORS_HEADER = "triton_grpc_error"

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)")
_CODE_TAG = re.compile(r"^\s*\[(?:StatusCode\.)?([A-Z_]+)\]\s*")
# StageFailedError's prefix; what follows is the stage's own message.
_STAGE_PREFIX = re.compile(r"^stage '[^']*' \(model [^)]*\) failed: ")
# RequestError's form: a lower-case field name (unlike exception type names of
# internal errors, "RuntimeError: ..."), a colon and the message.
_REQUEST_ERROR = re.compile(r"^[a-z_][a-z0-9_.\[\]]*: ")
# gRPC status names and Triton core codes -> this taxonomy (anything else is INTERNAL).
_CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "INVALID_ARG": "INVALID_ARG",
          "OUT_OF_RANGE": "INVALID_ARG", "UNIMPLEMENTED": "INVALID_ARG",
          "UNSUPPORTED": "INVALID_ARG", "UNAVAILABLE": "UNAVAILABLE", "NOT_FOUND": "UNAVAILABLE",
          "CANCELLED": "CANCELLED", "DEADLINE_EXCEEDED": "DEADLINE_EXCEEDED"}
# Lower-cased message fragments of status-less errors, checked in order.
_BY_MESSAGE: tuple[tuple[tuple[str, ...], ErrorCode], ...] = (
    (("cancelled", "canceled"), "CANCELLED"),
    (("deadline exceeded",), "DEADLINE_EXCEEDED"),
    (("no available versions", "not at ready state", "is not ready", "is not serving",
      "shutting down", "stopped accepting new", "request timeout expired", "failed to connect",
      "connection refused", "socket closed", "no answer within", "no response for",
      "is not healthy", *OVERLOADED_MESSAGES, "unavailable"), "UNAVAILABLE"),
    (("request for unknown model", "invalid argument", "invalid_arg",
      "unexpected inference input", "unexpected shape for input", "data-type is",
      "inputs but got", "expected number of inputs", "does not exist in request",
      "input byte size mismatch",
      # vllm_backend's texts (llm/request.py, llm/lora.py, llm/stage.py): verbatim, with no
      # field prefix
      "= false is not allowed", "lora feature is not enabled",
      "is not supported, we currently support", "does not support 'embed' request",
      "does not support 'generate' request"), "INVALID_ARG"),
)


def normalise_code(status: str) -> str:
    """INVALID_ARG, UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED or INTERNAL for a gRPC
    status name ("INVALID_ARGUMENT", "StatusCode.NOT_FOUND") or a Triton core code."""
    return _CODES.get(status.strip().upper().removeprefix("STATUSCODE."), "INTERNAL")


def strict_stream_errors_safe(server_version: str) -> bool:
    """Whether a Triton of this version ("2.51.0") may be sent the strict-errors header."""
    m = _VERSION.match(server_version or "")
    return m is not None and (int(m[1]), int(m[2])) >= STRICT_STREAM_ERRORS_SINCE


def code_of_message(message: str) -> str:
    """The code of a status-less error message: INVALID_ARG, UNAVAILABLE, CANCELLED,
    DEADLINE_EXCEEDED or INTERNAL.

    Reads a leading "[CODE] " tag (what str(InferenceServerException) writes),
    looks through StageFailedError's prefix at the stage's own message, takes
    RequestError's "field: message" form as INVALID_ARG, and otherwise knows the
    messages Triton core, gRPC and the orchestrator use for the other codes.
    A stage's model that is unknown to its server is UNAVAILABLE (the stage is
    not loaded); for a caller naming a model itself it is INVALID_ARG.
    """
    tag = _CODE_TAG.match(message)
    if tag:
        return normalise_code(tag[1])
    inner = _STAGE_PREFIX.sub("", message)
    staged = inner != message
    while _STAGE_PREFIX.match(inner):
        inner = _STAGE_PREFIX.sub("", inner)
    if _REQUEST_ERROR.match(inner):
        return "INVALID_ARG"
    lowered = inner.lower()
    if staged and "unknown model" in lowered:
        return "UNAVAILABLE"
    for fragments, code in _BY_MESSAGE:
        if any(f in lowered for f in fragments):
            return code
    return "INTERNAL"


def call_code(status: str | None, message: str) -> ErrorCode:
    """The code a failed stage call is reported with: its gRPC status when it has one, else
    read from its message; a deadline is UNAVAILABLE (the stage did not answer in time)."""
    code = normalise_code(status) if status else code_of_message(message)
    return "UNAVAILABLE" if code == "DEADLINE_EXCEEDED" else code


def exc_code(e) -> ErrorCode:
    """call_code of a tritonclient InferenceServerException."""
    return call_code(e.status(), e.message() or "")

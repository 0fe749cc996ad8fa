"""The client's error taxonomy and the mapping from tritonclient exceptions onto it.

Runs in the caller's process. Every failure an `OmniClient` call can raise is
an `OmniClientError`; tritonclient's `InferenceServerException` is mapped by
`from_triton()` and chained (`raise from_triton(exc) from exc`).

Where the status comes from:
- unary RPCs and broken gRPC streams: tritonclient puts the gRPC code in
  `exc.status()` as a string such as "StatusCode.INVALID_ARGUMENT"
  (`str(grpc.StatusCode.X)`); a locally cancelled stream gives
  "StatusCode.CANCELLED" with "Locally cancelled by application!";
- an error response on a gRPC stream (a decoupled model's
  `TritonError(msg, INVALID_ARG)`, or Triton core rejecting the request) is
  built by tritonclient as `InferenceServerException(msg=error_message)`:
  status is None and the Triton error code is lost; only the message
  arrives. The stream then stays open;
- with the `triton_grpc_error: true` stream header (Triton >= 24.09) the
  server instead closes the stream with the real gRPC code, which arrives as
  a broken-stream error above (see OmniClient's strict_stream_errors).

A stage that wants its code to survive the default path can start the
message with a tag: "[INVALID_ARG] max_tokens must be positive".

For a None status the mapper reads a leading "[CODE] " tag (what
`str(InferenceServerException)` writes, so errors forwarded by a BLS model
keep their code) and otherwise recognises a few messages Triton core and the
vLLM backend are known to use. Anything else is a `ServerError` that keeps
the message.
"""
from __future__ import annotations

import builtins
import re

from tritonclient.utils import InferenceServerException

__all__ = [
    "BadRequestError",
    "CancelledError",
    "OmniClientError",
    "RequestTimeoutError",
    "ServerError",
    "UnavailableError",
    "from_triton",
]


class OmniClientError(Exception):
    """Base of every error raised by omni_client.

    Attributes:
        message: the server's (or client's) description of the failure.
        status: the raw status string tritonclient reported
            (e.g. "StatusCode.INVALID_ARGUMENT"), or None when it had none.
    """

    def __init__(self, message: str, *, status: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message if self.status is None else f"[{self.status}] {self.message}"


class BadRequestError(OmniClientError):
    """The request was rejected as invalid (INVALID_ARG); retrying it unchanged will fail again."""


class UnavailableError(OmniClientError):
    """The server cannot be reached, is shutting down, or the model is unknown or not ready."""


class CancelledError(OmniClientError):
    """The request was cancelled (by this client or by the server).

    Unlike asyncio.CancelledError this is an ordinary Exception.
    """


class RequestTimeoutError(OmniClientError, builtins.TimeoutError):
    """No response arrived in time (client-side timeout or DEADLINE_EXCEEDED)."""


class ServerError(OmniClientError):
    """Any other failure reported by the server or the transport (INTERNAL, UNKNOWN, ...)."""


# gRPC codes (without the "StatusCode." prefix) and Triton core codes.
_BY_CODE: dict[str, type[OmniClientError]] = {
    "INVALID_ARGUMENT": BadRequestError,
    "INVALID_ARG": BadRequestError,
    "OUT_OF_RANGE": BadRequestError,
    "UNIMPLEMENTED": BadRequestError,
    "UNSUPPORTED": BadRequestError,
    "UNAVAILABLE": UnavailableError,
    "NOT_FOUND": UnavailableError,
    "CANCELLED": CancelledError,
    "DEADLINE_EXCEEDED": RequestTimeoutError,
}

_CODE_TAG = re.compile(r"^\s*\[(?:StatusCode\.)?([A-Z_]+)\]\s*")

# Lower-cased message fragments for status-less stream errors, checked in order;
# each group follows the code Triton core gives the same message.
_BY_MESSAGE: tuple[tuple[tuple[str, ...], type[OmniClientError]], ...] = (
    (("cancelled", "canceled"), CancelledError),
    (("deadline exceeded",), RequestTimeoutError),
    (("no available versions", "not at ready state", "is not ready", "shutting down",
      "stopped accepting new", "request timeout expired", "failed to connect",
      "connection refused"), UnavailableError),
    (("request for unknown model", "invalid argument", "invalid_arg",
      "unexpected inference input", "unexpected shape for input", "data-type is",
      "inputs but got", "expected number of inputs", "does not exist in request",
      "input byte size mismatch"), BadRequestError),
)


def _normalise(status: str) -> str:
    return status.strip().upper().removeprefix("STATUSCODE.")


def _class_for(status: str | None, message: str) -> type[OmniClientError]:
    if status:
        return _BY_CODE.get(_normalise(status), ServerError)
    tag = _CODE_TAG.match(message)
    if tag:
        return _BY_CODE.get(tag.group(1), ServerError)
    lowered = message.lower()
    for fragments, cls in _BY_MESSAGE:
        if any(f in lowered for f in fragments):
            return cls
    return ServerError


def from_triton(exc: InferenceServerException) -> OmniClientError:
    """Map a tritonclient exception onto the omni_client taxonomy.

    Uses `exc.status()` when tritonclient set one, else the message (see the
    module docstring). The message is kept verbatim. Callers chain it:
    `raise from_triton(exc) from exc`.
    """
    message = exc.message()
    if message is None:
        message = str(exc)
    status = exc.status()
    return _class_for(status, message)(message, status=status)

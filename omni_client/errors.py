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
- with the `triton_grpc_error: true` stream header the server instead
  closes the stream with the real gRPC code, which arrives as a
  broken-stream error above (see OmniClient's strict_stream_errors; only
  sent to Triton >= 2.53, where it cannot crash the server).

For a None status the code is read from the message by the server's own
table (`omni_serve.errors.code_of_message`): a leading "[CODE] " tag, an
omni stage's "field: message" form (a bad request), and the messages Triton
core, gRPC and the orchestrator use for the other codes. Anything else is a
`ServerError` that keeps the message.
"""
from __future__ import annotations

import builtins

from tritonclient.utils import InferenceServerException

from omni_serve.errors import code_of_message, normalise_code

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


# The taxonomy's codes (omni_serve.errors, shared with the server) -> exception classes.
_BY_CODE: dict[str, type[OmniClientError]] = {
    "INVALID_ARG": BadRequestError,
    "UNAVAILABLE": UnavailableError,
    "CANCELLED": CancelledError,
    "DEADLINE_EXCEEDED": RequestTimeoutError,
}


def _class_for(status: str | None, message: str) -> type[OmniClientError]:
    code = normalise_code(status) if status else code_of_message(message)
    return _BY_CODE.get(code, ServerError)


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

"""The error taxonomy shared by every stage (runs inside the Triton stub and in tests).

A `RequestError` is one request's fault: the adapter answers that request with
Triton INVALID_ARG and keeps serving. Anything else escaping stage logic is a
server fault (INTERNAL). Never `assert` on user input.
"""
from __future__ import annotations


class RequestError(ValueError):
    """A bad request; `field` names the offending input (tensor, parameter or key)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class StageUnavailableError(RuntimeError):
    """The stage cannot serve now (engine dead, shutting down); maps to UNAVAILABLE."""


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

"""The one table that reads an error's code back from its message (omni_serve.errors).

Triton 2.51 streams lose the code of an error response unless the strict-errors header
is sent, and that header can crash it; these are the messages the server really sends.
"""
from __future__ import annotations

import pytest

from omni_serve.errors import (
    RequestError,
    StageFailedError,
    code_of_message,
    normalise_code,
    strict_stream_errors_safe,
)


@pytest.mark.parametrize("message,code", [
    (str(RequestError("text_input", "is required")), "INVALID_ARG"),
    (str(RequestError("history[0].role", "must be one of system, user")), "INVALID_ARG"),
    (str(StageFailedError("thinker", "llm", "sampling_parameters.max_tokenz: unknown",
                          "INVALID_ARG")), "INVALID_ARG"),
    (str(StageFailedError("image_encoder", "image_encoder", "media: not an image")),
     "INVALID_ARG"),
    (str(StageFailedError("thinker", "llm", "failed to connect to all addresses")),
     "UNAVAILABLE"),
    (str(StageFailedError("thinker", "llm", "Socket closed")), "UNAVAILABLE"),
    (str(StageFailedError("talker", "talker", "no answer within 300 s")), "UNAVAILABLE"),
    (str(StageFailedError("thinker", "llm", "Request for unknown model: 'llm' is not found")),
     "UNAVAILABLE"),
    (str(StageFailedError("dit", "dit", "RuntimeError: boom")), "INTERNAL"),
    ("Request for unknown model: 'nope' is not found", "INVALID_ARG"),
    ("Request for unknown model: 'llm' has no available versions", "UNAVAILABLE"),
    ("[StatusCode.INVALID_ARGUMENT] max_tokens must be positive", "INVALID_ARG"),
    ("[UNAVAILABLE] engine dead", "UNAVAILABLE"),
    ("Request was cancelled", "CANCELLED"),
    ("RuntimeError: boom", "INTERNAL"),
    ("unexpected shape for input 'text_input' for model 'llm'", "INVALID_ARG"),
])
def test_the_code_is_read_back_from_the_message(message, code):
    assert code_of_message(message) == code


@pytest.mark.parametrize("status,code", [
    ("StatusCode.INVALID_ARGUMENT", "INVALID_ARG"), ("INVALID_ARG", "INVALID_ARG"),
    ("NOT_FOUND", "UNAVAILABLE"), ("StatusCode.DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"),
    ("StatusCode.UNKNOWN", "INTERNAL"), ("CANCELLED", "CANCELLED"),
])
def test_grpc_status_names_map_onto_the_taxonomy(status, code):
    assert normalise_code(status) == code


@pytest.mark.parametrize("version,safe", [
    ("2.51.0", False), ("2.52", False), ("2.53.0", True), ("2.59.1", True), ("3.0.0", True),
    ("", False), ("unknown", False),
])
def test_strict_errors_only_from_the_release_that_fixed_the_crash(version, safe):
    assert strict_stream_errors_safe(version) is safe

"""A stage's Python logging goes to Triton's log at the matching level (omni_serve.triton_log)."""
from __future__ import annotations

import logging
import sys
import types

import pytest

from omni_serve import triton_log

NAME = "omni_test_adapter"


@pytest.fixture
def loggers():
    """The loggers log_to_triton changes, put back as they were afterwards."""
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers))
             for name in (NAME, "omni_serve")}
    for name in saved:
        logging.getLogger(name).handlers[:] = []
    yield
    for name, (level, handlers) in saved.items():
        logging.getLogger(name).handlers[:] = handlers
        logging.getLogger(name).setLevel(level)


def _fake_pb_utils(lines: list):
    logger = types.SimpleNamespace(**{
        f"log_{level}": (lambda message, level=level: lines.append((level, message)))
        for level in ("error", "warn", "info", "verbose")})
    return types.SimpleNamespace(Logger=logger)


def test_records_go_to_triton_at_their_level_and_debug_only_when_asked(monkeypatch, loggers):
    lines: list = []
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils(lines))
    triton_log.log_to_triton(NAME)
    log = logging.getLogger(NAME)
    log.error("boom %d", 1)
    log.warning("careful")
    log.info("ready")
    log.debug("detail")
    logging.getLogger("omni_serve.llm.stage").warning("from the stage")
    assert lines == [("error", f"{NAME}: boom 1"), ("warn", f"{NAME}: careful"),
                     ("info", f"{NAME}: ready"), ("warn", "omni_serve.llm.stage: from the stage")]

    lines.clear()
    monkeypatch.setenv(triton_log.LOG_LEVEL_ENV, "debug")
    triton_log.log_to_triton(NAME)  # again: no second handler
    log.debug("detail")
    assert lines == [("verbose", f"{NAME}: detail")]

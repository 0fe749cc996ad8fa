"""Python logging of a stage's stub into Triton's log (runs in every omni Triton stub).

Each adapter's initialize calls `log_to_triton`: the `omni_serve` logger and the
adapter's own then write through pb_utils.Logger, so their lines carry Triton's
prefix, go where `--log-file` says, and debug lines (OMNI_LOG_LEVEL=DEBUG) show
under `--log-verbose=1`. Without it only warnings reached stderr, unprefixed.
"""
from __future__ import annotations

import logging
import os
import sys

from omni_serve import env
from omni_serve.tritonio import pb


class TritonLogHandler(logging.Handler):
    """Python logging records -> Triton's log (pb_utils.Logger): they carry Triton's
    prefix and land where `--log-file` says; DEBUG goes out as VERBOSE, which Triton
    prints under `--log-verbose=1`."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            logger = pb().Logger
            if record.levelno >= logging.ERROR:
                logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                logger.log_warn(message)
            elif record.levelno >= logging.INFO:
                logger.log_info(message)
            else:
                logger.log_verbose(message)
        except Exception:  # the stub is shutting down: say it on stderr as before
            print(record.getMessage(), file=sys.stderr)


LOG_LEVEL_ENV = env.LOG_LEVEL.name  # DEBUG: also the debug lines (shown with --log-verbose=1)


def log_to_triton(*names: str) -> None:
    """Route the `omni_serve` logger and the adapter's own (`names`) to Triton's log, at
    INFO or OMNI_LOG_LEVEL (debug lines cost a message to the server each: opt in)."""
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper() or "INFO"
    handler = TritonLogHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    for name in ("omni_serve", *names):
        logger = logging.getLogger(name)
        if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
            logger.addHandler(handler)
        logger.setLevel(level)

"""Why a vLLM engine failed to start, in one line (vLLM plugin + the stage that starts it).

vLLM builds the model in its engine-core (or worker) process; when that fails,
the stage's `AsyncLLM.from_engine_args` only raises "Engine core initialization
failed. See root cause above", and the root cause is a traceback dozens of
lines up in the server log. So:

- `register` (a `vllm.general_plugins` entry point, run in every process vLLM
  starts) adds a handler to the "vllm" logger when `ENV` names a file: the
  first error logged with an exception (vLLM logs "EngineCore failed to start"
  and "WorkerProc failed to start" that way) is written there as one line, the
  exception and the innermost frame that raised it. Exclusive creation keeps
  the first (deepest) cause when several processes fail in turn.
- the stage sets `ENV` in its own environment before it starts the engine
  (`watch`), and on failure raises `EngineStartError` quoting that line, so
  Triton's "failed to load" line names the stage and the cause.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

from omni_serve import env

ENV = env.VLLM_STARTUP_FAILURE_FILE.name


class EngineStartError(RuntimeError):
    """A stage's vLLM engine did not start; the message names the stage and the root cause."""


def summarize(exc: BaseException) -> str:
    """`Type: message (file:line in function)` of the frame that raised `exc`."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" ({Path(last.filename).name}:{last.lineno} in {last.name}: {last.line or ''})"
    message = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {message}{where}".strip()


class _FirstFailure(logging.Handler):
    def __init__(self, path: str):
        super().__init__(level=logging.ERROR)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if not record.exc_info or record.exc_info[1] is None or os.environ.get(ENV) != self.path:
            return  # no exception, or no engine start is being watched any more
        try:
            with open(self.path, "x", encoding="utf-8") as f:
                f.write(summarize(record.exc_info[1]))
        except OSError:  # an earlier (deeper) failure is already written
            pass


def register() -> None:
    """Entry point (vllm.general_plugins): record this process's first startup failure."""
    path = os.environ.get(ENV)
    if not path:
        return
    logger = logging.getLogger("vllm")
    if not any(isinstance(h, _FirstFailure) for h in logger.handlers):
        logger.addHandler(_FirstFailure(path))


@contextlib.contextmanager
def watch(stage: str) -> Iterator[None]:
    """Around an engine start in the stage's process: a failure becomes EngineStartError
    naming `stage` and the root cause the engine's processes logged."""
    fd, path = tempfile.mkstemp(prefix="omni-vllm-start-", suffix=".txt")
    os.close(fd)
    os.unlink(path)  # the handler creates it exclusively
    try:
        with env.set_while(ENV, path):  # inherited by the engine processes started inside
            yield
    except Exception as e:
        try:
            cause = Path(path).read_text(encoding="utf-8")
        except OSError:
            cause = summarize(e)
        raise EngineStartError(f"stage {stage}: its vLLM engine failed to start: {cause}") from e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)

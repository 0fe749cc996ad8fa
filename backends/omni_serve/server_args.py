"""This tritonserver's own flags, read from inside one of its Python stubs.

A stub's parent process is the tritonserver that started it, so
`/proc/<parent>/cmdline` says how the server runs. The orchestrator reads its
gRPC endpoint from it (orchestrator/locality.py); a stage that loses its
engine reads the model-control mode, which decides whether it may unload
itself (only `explicit` allows it; see `may_unload_itself`).

Read once, at model load: the flags of a running server do not change.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

# tritonserver --model-control-mode: none (its default), poll, explicit
MODEL_CONTROL_DEFAULT = "none"


def server_argv(parent_pid: int | None = None) -> list[str]:
    """The command line of the tritonserver that runs this stub (its parent process);
    empty when it cannot be read."""
    pid = os.getppid() if parent_pid is None else parent_pid
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def known_args(argv: Sequence[str], parser: argparse.ArgumentParser) -> argparse.Namespace:
    """`parser`'s options among tritonserver's arguments `argv` (argv[0] the program).

    tritonserver takes `--grpc_port` as well as `--grpc-port`: underscores in
    option names become dashes before parsing. ValueError for a malformed value.
    """
    try:
        opts, _ = parser.parse_known_args([_dashed(a) for a in argv[1:]])
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from e
    return opts


def model_control_mode(argv: Sequence[str] | None = None) -> str:
    """This server's `--model-control-mode` ("none" when not given), lower case.

    `argv` defaults to this stub's parent's command line; a process that is not
    a tritonserver stub reads "none", which never unloads anything.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--model-control-mode", default=MODEL_CONTROL_DEFAULT)
    try:
        opts = known_args(server_argv() if argv is None else argv, parser)
    except ValueError:
        return MODEL_CONTROL_DEFAULT
    return opts.model_control_mode.strip().lower()


def may_unload_itself(mode: str) -> bool:
    """Whether a model of a server in model-control `mode` may ask to unload itself.

    Only under `explicit`: elsewhere Triton refuses the request, and on Triton 2.51
    the refused `pb_utils.unload_model` from a stub raced the stub's shared memory
    and crashed it (a segfault in ModelLoader::SendUnloadModelRequest), leaving its
    requests unanswered.
    """
    return mode == "explicit"


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg[2:].partition("=")
    return f"--{key.replace('_', '-')}{eq}{value}"

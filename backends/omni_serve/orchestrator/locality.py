"""Where the stages are (runs in the orchestrator's stub): this server's gRPC endpoint,
whether a URL is this host, and the remote stages of an OrchestratorConfig.

Which URL a stage call goes to and whether it may use system shared memory follow
from here; the calls themselves are grpc_client's.
"""
from __future__ import annotations

import argparse
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from omni_serve import env
from omni_serve.orchestrator.config import SHM_MIN_BYTES_DEFAULT
from omni_serve.server_args import known_args, server_argv


def local_grpc_url(parent_pid: int | None = None) -> str:
    """This tritonserver's gRPC endpoint, from its command line (the stub's parent process).

    `OMNI_TRITON_GRPC_URL` overrides it. Raises ValueError when gRPC is off.
    """
    if url := env.TRITON_GRPC_URL.get():
        return url
    return grpc_url_from_args(server_argv(parent_pid))


def grpc_url_from_args(argv: Sequence[str]) -> str:
    """The gRPC endpoint tritonserver serves with these arguments (127.0.0.1:8001 by default)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--allow-grpc", default="true")
    parser.add_argument("--grpc-address", default="0.0.0.0")
    parser.add_argument("--grpc-port", default="8001")
    try:
        opts = known_args(argv, parser)
    except ValueError as e:
        raise ValueError(f"cannot read the gRPC endpoint from the tritonserver command line: "
                         f"{e}") from e
    if opts.allow_grpc.lower() in ("false", "0", "no"):
        raise ValueError("tritonserver runs with --allow-grpc=false; the orchestrator's grpc "
                         "transport needs it (or set triton_url / OMNI_TRITON_GRPC_URL)")
    host = "127.0.0.1" if opts.grpc_address in ("", "0.0.0.0", "::") else opts.grpc_address
    return f"{host}:{opts.grpc_port}"


def url_host(url: str) -> str:
    """The host part of a gRPC URL: `h:1`, `[::1]:8001`, `grpc://h:1` -> `h`, `::1`."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def is_local_host(host: str) -> bool:
    """True when `host` is this machine: loopback, `localhost`, this host's name or address."""
    host = host.strip().lower().rstrip(".")
    if not host:
        return False
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
        literal = True
    except ValueError:
        literal = False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    names = {socket.gethostname().lower()}
    if not literal:
        names.add(socket.getfqdn().lower())
        return host in names
    try:  # an address of this host's name (no lookup of arbitrary names)
        return host in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def use_shared_memory(mode: str, url: str) -> bool:
    """Whether calls to the server at `url` send large inputs through system shared memory."""
    if mode == "system":
        return True
    if mode == "none":
        return False
    return is_local_host(url_host(url))


@dataclass(frozen=True)
class RemoteEndpoint:
    """How to reach a stage on another server (from the orchestrator's `remote` entry)."""

    url: str
    shared_memory: str = "none"  # "auto", "system" or "none"
    shared_memory_min_bytes: int = SHM_MIN_BYTES_DEFAULT


def remote_endpoints(cfg) -> dict[str, RemoteEndpoint]:
    """The remote stages of an OrchestratorConfig, environment overrides applied."""
    return {model: RemoteEndpoint(cfg.remote_url(model), stage.shared_memory_mode(),
                                  stage.shared_memory_min_bytes)
            for model, stage in cfg.remote.items()}



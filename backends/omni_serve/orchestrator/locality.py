"""Where the stages are (runs in the orchestrator's stub): this server's gRPC endpoint,
whether a URL is this host, the remote stages of an OrchestratorConfig, and the
replicas a server's URL names.

Which URL a stage call goes to and whether it may use system shared memory follow
from here; the calls themselves are grpc_client's, the spreading over replicas
replicas.py's.

A server's URL (`OMNI_SERVER_<NAME>_URL`, its spec's `grpc_url`) is one of:

    host:port                    one server (gRPC resolves the name, one connection)
    dns:///host:port             a replica per address the name resolves to (a headless
                                 Service's pods), resolved anew while it runs
    ipv4:a:p,b:p  ipv6:[a]:p,..  gRPC's address lists: a replica per address
    host:port,host:port          a list: a replica per entry (each entry one server)
"""
from __future__ import annotations

import argparse
import asyncio
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
    """The remote stages of an OrchestratorConfig, environment overrides applied.

    ValueError naming the variable (or the spec's grpc_url) for a URL that is none of
    the forms above."""
    out = {}
    for model, stage in cfg.remote.items():
        url = cfg.remote_url(model)
        try:
            parse_target(url)
        except ValueError as e:
            where = (env.SERVER_URL.named(name=stage.server)
                     if env.SERVER_URL.get(name=stage.server) else
                     f"servers.{stage.server}.grpc_url")
            raise ValueError(f"{where}={url!r}: {e}") from None
        out[model] = RemoteEndpoint(url, stage.shared_memory_mode(),
                                    stage.shared_memory_min_bytes)
    return out


# --- replicas behind one name --------------------------------------------------------------

@dataclass(frozen=True)
class ReplicaTarget:
    """The replicas a URL names: fixed `addresses` (`host:port` each), or a `dns` name and
    port to resolve."""

    url: str
    addresses: tuple[str, ...] = ()
    dns: tuple[str, int] | None = None


def _host_port(entry: str, what: str) -> tuple[str, int]:
    """`h:1`, `[::1]:8001` -> (host, port); ValueError without a port."""
    entry = entry.strip()
    if entry.startswith("["):
        host, sep, port = entry[1:].partition("]:")
    else:
        host, sep, port = entry.rpartition(":")
        if ":" in host:
            raise ValueError(f"{what} {entry!r}: write an IPv6 address in brackets, "
                             "[::1]:8001")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {entry!r}: write host:port (the server's gRPC port)")
    return host, int(port)


def address(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_target(url: str) -> ReplicaTarget | None:
    """The replicas `url` names, or None for one server (`host:port`, as gRPC takes it).

    ValueError saying what is wrong for a malformed list or `dns:` name.
    """
    text = url.strip()
    scheme = text.split(":", 1)[0].lower()
    if scheme == "dns":
        rest = text[4:]
        if rest.startswith("//"):
            authority, slash, rest = rest[2:].partition("/")
            if authority or not slash:
                raise ValueError("a DNS server of its own (dns://SERVER/...) is not supported: "
                                 "write dns:///host:port (the system's resolver)")
        host, port = _host_port(rest, "dns: name")
        return ReplicaTarget(url, dns=(host, port))
    if scheme in ("ipv4", "ipv6"):
        entries = [e for e in text[5:].split(",")]
        addresses = []
        for entry in entries:
            host, port = _host_port(entry, f"{scheme}: address")
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"{scheme}: address {entry.strip()!r}: not an IP address") from None
            if ip.version != int(scheme[-1]):
                raise ValueError(f"{scheme}: address {entry.strip()!r}: not IPv{scheme[-1]}")
            addresses.append(address(host, port))
        return ReplicaTarget(url, addresses=_distinct(addresses))
    if "," in text:
        addresses = [address(*_host_port(e, "list entry")) for e in text.split(",")]
        return ReplicaTarget(url, addresses=_distinct(addresses))
    return None


def _distinct(addresses: list[str]) -> tuple[str, ...]:
    if len(set(addresses)) != len(addresses):
        raise ValueError("an address is listed twice")
    return tuple(addresses)


async def resolve(target: ReplicaTarget) -> tuple[str, ...]:
    """The replicas' addresses now: the fixed list, or every address the system's resolver
    gives for the `dns` name (getaddrinfo, as gRPC's native resolver asks), sorted.

    OSError (socket.gaierror) when the name does not resolve."""
    if target.dns is None:
        return target.addresses
    host, port = target.dns
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = {address(info[4][0], port) for info in infos}
    return tuple(sorted(found))



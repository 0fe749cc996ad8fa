"""`omni-soak`: the load-and-soak tool's command line.

Runs in the caller's process. Either starts a tritonserver for a preset
(the embedded default, omni-chat, unless told otherwise; generated with
omni-gen-repo into a temporary folder, stopped at the end) or targets a
running one with --url, which must be on this machine (loopback only: the
tool reads the RSS of the server's processes). Then it runs the soak (see
omni_tools.soak.runner), writes the JSON report and the RSS plot, prints
the figures and exits 1 when anything was lost or duplicated, a stream did
not end with exactly one final response, a response carried another
request's id, requests errored, a server process exited, or RSS grew past
the limit after warm-up; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from .mix import KINDS
from .runner import LIMITS, SoakConfig, SoakResult, run_soak

log = logging.getLogger(__name__)


def loopback_target(url: str) -> tuple[str, int]:
    """(host, port) of a `host:port` gRPC address; ValueError unless every address the host
    resolves to is a loopback one."""
    if "://" in url:
        raise ValueError(f"--url {url!r}: give host:port (the gRPC endpoint), no scheme")
    host, _, port = url.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"--url {url!r}: expected host:port, e.g. 127.0.0.1:8001")
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)}
    except socket.gaierror as e:
        raise ValueError(f"--url {url!r}: cannot resolve {host!r} ({e})") from e
    remote = sorted(a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if remote:
        raise ValueError(f"--url {url!r}: the soak only targets this machine's loopback "
                         f"(127.0.0.0/8, ::1, localhost); {host} resolves to {', '.join(remote)}")
    return host, int(port)


def listening_pid(port: int) -> int | None:
    """The process listening on TCP `port` of this machine, if it can be seen."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return c.pid
    return None


@contextlib.contextmanager
def started_server(preset: str, log_path: Path | None) -> Iterator[tuple[str, int, str]]:
    """A tritonserver for `preset` on free ports, its log at `log_path` (default: a temporary
    folder's): yields (grpc url, pid, log path)."""
    from omni_tools import gen_repo, spec
    from omni_tools.server import TritonServer

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine; vLLM's default is large
    with tempfile.TemporaryDirectory(prefix="omni-soak-") as tmp:
        repo = Path(tmp) / "repo"
        gen_repo.generate(spec.load_preset(preset), repo, force=True)
        log_path = log_path or Path(tmp) / "tritonserver.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        server = TritonServer(repo, log_path=log_path)
        log.info("starting tritonserver for %s (log %s)", preset, log_path)
        server.start(timeout=600)
        try:
            yield server.grpc_url, server.proc.pid, str(log_path)
        finally:
            server.stop()


def _bounded(name: str, kind: type):
    lo, hi = LIMITS[name]

    def parse(text: str):
        value = kind(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo:g} and {hi:g}, got {text}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    from omni_tools.spec import list_presets

    ap = argparse.ArgumentParser(
        prog="omni-soak",
        description="Load and soak an omni server (this machine only): mixed requests at a set "
                    "concurrency for a set time, every stream checked for exactly one final "
                    "response, the RSS of every server process recorded and plotted.",
        epilog="Kinds: " + "; ".join(f"{k.name} ({k.doc})" for k in KINDS.values()))
    target = ap.add_argument_group("target")
    target.add_argument("--url", help="a running server's gRPC host:port (loopback only); "
                                      "default: start one for --preset")
    target.add_argument("--server-pid", type=int,
                        help="with --url: the tritonserver's pid (default: who listens on the port)")
    target.add_argument("--preset", default="omni-chat", choices=list_presets(),
                        help="the preset to start (default omni-chat: every kind of request)")
    load = ap.add_argument_group("load (bounded)")
    load.add_argument("--concurrency", type=_bounded("concurrency", int), default=16,
                      help="requests in flight, each on its own stream (1-64; default 16)")
    load.add_argument("--duration-s", type=_bounded("duration_s", float), default=600.0,
                      help="no request is sent after this (1-3600; default 600)")
    load.add_argument("--max-requests", type=_bounded("max_requests", int), default=100_000,
                      help="nor beyond this many (default 100000)")
    load.add_argument("--kinds", default=",".join(KINDS),
                      help="comma-separated request kinds, taken in turn (default: all)")
    load.add_argument("--request-timeout-s", type=_bounded("request_timeout_s", float),
                      default=120.0, help="a request without a final response by then is lost")
    mem = ap.add_argument_group("memory")
    mem.add_argument("--warmup-s", type=_bounded("warmup_s", float), default=60.0,
                     help="RSS growth is measured from here (default 60)")
    mem.add_argument("--window-s", type=_bounded("window_s", float), default=60.0,
                     help="RSS medians of the first window after warm-up and the last one compared")
    mem.add_argument("--rss-interval-s", type=_bounded("rss_interval_s", float), default=2.0,
                     help="seconds between RSS samples (default 2)")
    mem.add_argument("--max-rss-growth-pct", type=float, default=10.0,
                     help="fail above this growth, in total or of a process (negative: report only)")
    verdict = ap.add_argument_group("verdict and output")
    verdict.add_argument("--max-errors", type=int, default=0,
                         help="errored requests allowed before the soak fails (default 0)")
    verdict.add_argument("--out", type=Path, default=Path("omni-soak.json"), help="JSON report")
    verdict.add_argument("--plot", type=Path,
                         help="RSS plot (PNG; default: the report's name with _rss.png)")
    verdict.add_argument("--server-log", type=Path, help="with a started server: write its log to this file")
    return ap


def _growth_text(row: dict) -> str:
    if row["growth_pct"] is None:
        return "(not enough samples)"
    trend = row["trend_mib_per_min"] or 0.0
    return (f"{row['start_mib']:7.1f} -> {row['end_mib']:7.1f} MiB ({row['growth_pct']:+5.1f}%, "
            f"{trend:+.2f} MiB/min)")


def _print_summary(result: SoakResult) -> None:
    r = result.report
    s = r["summary"]
    print(f"soak: {r['elapsed_s']:.0f} s at concurrency {r['config']['concurrency']}: "
          f"sent {s['sent']}, completed {s['completed']}, errored {s['errored']}, lost {s['lost']}, "
          f"duplicated {s['duplicated']}, streams without exactly one final "
          f"{s['streams_not_one_final']}, wrong ids {s['wrong_id']}; "
          f"{r['requests_per_s']:.2f} requests/s")
    for kind, row in s["by_kind"].items():
        print(f"  {kind:14s} sent {row['sent']:5d} completed {row['completed']:5d} "
              f"errored {row['errored']:3d} lost {row['lost']:3d}  p50 {row['latency_p50_s'] or 0:.2f} s "
              f"p99 {row['latency_p99_s'] or 0:.2f} s")
    g, anon = r["rss"]["growth"], r["rss"]["anon_growth"]
    print(f"RSS after warm-up (median of {g['baseline_window_s'][0]:.0f}-{g['baseline_window_s'][1]:.0f} s "
          f"vs {g['final_window_s'][0]:.0f}-{g['final_window_s'][1]:.0f} s; trend of the last half), "
          f"and of it anonymous memory:")
    rows = sorted(g["processes"], key=lambda label: -(g["processes"][label]["start_mib"] or 0))
    for label in [*rows, "total"]:
        row, arow = (g["total"], anon["total"]) if label == "total" else (
            g["processes"][label], anon["processes"][label])
        print(f"  {label:30s} {_growth_text(row)} | anon {_growth_text(arow)}")
    shm = "/dev/shm (the server's files)"
    print(f"  {shm:30s} {_growth_text(r['shm']['growth'])} | {r['shm']['files_seen']} files")
    for line in r["failures"]:
        print(f"FAIL: {line}")
    print(f"report: {r.get('report')}  plot: {r.get('plot')}")


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        config = SoakConfig(
            concurrency=args.concurrency, duration_s=args.duration_s,
            max_requests=args.max_requests, warmup_s=args.warmup_s, window_s=args.window_s,
            rss_interval_s=args.rss_interval_s, request_timeout_s=args.request_timeout_s,
            kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
            max_errors=args.max_errors,
            max_rss_growth_pct=None if args.max_rss_growth_pct < 0 else args.max_rss_growth_pct)
        if args.url:
            _, port = loopback_target(args.url)
            pid = args.server_pid or listening_pid(port)
            if pid is None:
                raise ValueError(f"--url {args.url}: no process of this machine seen listening on "
                                 f"port {port}; give --server-pid")
    except ValueError as e:
        ap.error(str(e))
    command = " ".join(["omni-soak", *(argv if argv is not None else sys.argv[1:])])
    with contextlib.ExitStack() as stack:
        if args.url:
            url, server_log = args.url, None
        else:
            url, pid, server_log = stack.enter_context(started_server(args.preset, args.server_log))
        result = run_soak(url, pid, config)
    result.report.update(command=command, preset=None if args.url else args.preset,
                         server_log=server_log, report=str(args.out))
    result.write(args.out, args.plot or args.out.with_name(args.out.stem + "_rss.png"))
    _print_summary(result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())


"""A process that sleeps in a loop and records how late each wake-up comes (its own process).

Run it beside a server to see whether the host starves other work: it sleeps
`interval` seconds at a time for `seconds`, and records each wake-up's delay past
the interval. For a late one it also records how much of the delay this process
spent runnable but not on a core (its runqueue wait, /proc/thread-self/schedstat on
Linux): equal to the delay, the scheduler kept it off every core; near zero, the
timer fired late. docs/benchmarks-notes.md uses it for the worker-inside stall:

    python -m omni_tools.bench.wakeup_probe --seconds 150 --out probe.json
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_tools.bench.stats import pct


def runqueue_wait_ms() -> float | None:
    """This thread's time spent runnable but not running, in ms (None off Linux)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def probe(seconds: float, interval: float = 0.02, *, late_ms: float = 300.0,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
          rq_wait: Callable[[], float | None] = runqueue_wait_ms) -> dict[str, Any]:
    """Wake-up delays (ms) of `seconds` of `interval` sleeps: p50, p99, max, how many
    exceeded 1 s, and each one over `late_ms` with when it began and its runqueue wait."""
    start = clock()
    delays: list[float] = []
    late: list[dict[str, float | None]] = []
    wait_before = rq_wait()
    while (before := clock()) - start < seconds:
        sleep(interval)
        delay = (clock() - before - interval) * 1e3
        wait_after = rq_wait()
        delays.append(delay)
        if delay > late_ms:
            waited = (None if wait_before is None or wait_after is None
                      else round(wait_after - wait_before, 1))
            late.append({"at_s": round(before - start, 3), "late_ms": round(delay, 1),
                         "runqueue_wait_ms": waited})
        wait_before = wait_after
    return {"seconds": seconds, "interval_s": interval, "wakeups": len(delays),
            "late_ms_p50": pct(delays, 50), "late_ms_p99": pct(delays, 99),
            "late_ms_max": max(delays, default=None),
            "over_1s": sum(d > 1000 for d in delays), "late": late}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds per sleep")
    parser.add_argument("--late-ms", type=float, default=300.0,
                        help="list every wake-up later than this")
    parser.add_argument("--out", type=Path, help="write the result here as JSON")
    args = parser.parse_args(argv)
    result = probe(args.seconds, args.interval, late_ms=args.late_ms)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

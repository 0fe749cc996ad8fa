"""`omni-bench`: run benchmark scenarios and write docs/benchmarks.md.

Runs in the user's shell. `omni-bench <scenario> [args]` runs one scenario and keeps
its JSON results; `omni-bench all` runs every scenario with its quick arguments (one
after another, nothing else running beside them), then the report; `omni-bench report`
only rewrites the page from the results files there are. On-demand scenarios
(`omni-bench spin`, ...) run only when named.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from omni_tools.bench import (
    openai_chat,
    openai_images,
    profile,
    realtime,
    report,
    timeline,
    transformers_baseline,
    vllm_omni,
)
from omni_tools.bench import subprocess_scenarios as child
from omni_tools.bench.scenario import Scenario

SCENARIOS: tuple[Scenario, ...] = (
    openai_chat.SCENARIO, transformers_baseline.SCENARIO, child.LLM, child.DIT,
    child.DIT_CACHE, child.PIPELINING, profile.SCENARIO, vllm_omni.SCENARIO,
    openai_images.SCENARIO, realtime.SCENARIO, timeline.SCENARIO,
    # on demand
    child.SPLIT, child.SPIN, child.COLD_START, child.HIDDEN_STATES, child.STREAM_ERRORS,
    child.UNARY_CANCEL, child.FIRST_CHUNK, child.DECODER, child.SERVER_START)


def _by_name() -> dict[str, Scenario]:
    return {s.name: s for s in SCENARIOS}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="omni-bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="scenario", required=True)
    for s in SCENARIOS:
        s.add_arguments(sub.add_parser(s.name, help=s.title))
    every = sub.add_parser("all", help="every scenario but the on-demand ones (quick "
                                       "arguments), then the report")
    every.add_argument("--skip", nargs="*", default=[],
                       choices=[s.name for s in SCENARIOS if s.in_all])
    sub.add_parser("report", help="rewrite docs/benchmarks.md from the results files")
    return ap


def _run(s: Scenario, argv: Sequence[str]) -> None:
    sub = argparse.ArgumentParser(prog=f"omni-bench {s.name}")
    s.add_arguments(sub)
    args = sub.parse_args(list(argv))
    t0 = time.monotonic()
    results = s.run(args)
    results.setdefault("command", " ".join(["omni-bench", s.name, *argv]))
    results["wall_s"] = time.monotonic() - t0
    path = s.save(results)
    print(f"{s.name}: {results['wall_s']:.0f} s, results in {path}", flush=True)
    for r in s.ratios(results):
        value = "not measured" if r.value is None else f"{r.value:.2f}"
        print(f"  {r.name}: {value} (target {r.op} {r.target:g})", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.scenario == "all":
        t0 = time.monotonic()
        for s in SCENARIOS:
            if s.in_all and s.name not in args.skip:
                _run(s, s.quick)
        print(f"all: {time.monotonic() - t0:.0f} s", flush=True)
        command = "omni-bench all"
    elif args.scenario == "report":
        command = "omni-bench all"
    else:
        _run(_by_name()[args.scenario], argv[1:])
        return 0
    print(f"wrote {report.write(SCENARIOS, command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

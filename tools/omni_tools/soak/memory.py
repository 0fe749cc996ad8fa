"""RSS of a tritonserver and every process under it, sampled over a soak, and its plot.

Runs in the soak tool's process: `RssSampler` is a thread that reads, every
interval, the resident set size of the server process and of each of its
descendants (the Python backend stubs, one per model instance, and the vLLM
engine-core processes the LLM stubs spawn) with psutil. Processes are named
by what they serve (`stub:llm_0_0`, `llm_0_0/EngineCore`), so a series can be
traced to its model. `growth()` compares the median RSS of a window right
after warm-up with that of the run's last window, per process and in total,
and fits the trend of the last half (a plateau or a steady leak); `plot()`
writes the series and their sum as a PNG (matplotlib, Agg backend).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import psutil

from omni_serve import env

Metric = Literal["rss", "anon"]
STUB = "triton_python_backend_stub"
SHM = "/dev/shm/"
CAPTURE_DIR_ENV = env.HIDDEN_STATES_DIR.name


@dataclass
class Series:
    """The RSS samples of one process."""

    pid: int
    label: str
    t: list[float] = field(default_factory=list)  # seconds since the sampler started
    rss: list[int] = field(default_factory=list)  # bytes
    # of it, anonymous memory (RSS less file-backed and shared pages): what a leak grows, and
    # what stays when the kernel drops clean file pages (mapped libraries) under memory pressure
    anon: list[int] = field(default_factory=list)

    def values(self, metric: Metric) -> list[int]:
        return self.anon if metric == "anon" else self.rss


def _stub_instance(cmdline: list[str]) -> str | None:
    """The instance name (`llm_0_0`) of a Python backend stub's command line."""
    if not cmdline or not cmdline[0].endswith(STUB):
        return None
    # stub model.py shm_region shm_default shm_growth parent_pid backend_dir ipc_size instance ...
    if len(cmdline) > 8:
        return cmdline[8]
    return Path(cmdline[1]).parent.parent.name if len(cmdline) > 1 else "?"


def _label(proc: psutil.Process, labels: dict[int, str]) -> str:
    try:
        cmdline = proc.cmdline()
        name = proc.name()
        ppid = proc.ppid()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {proc.pid}"
    instance = _stub_instance(cmdline)
    if instance:
        return f"stub:{instance}"
    if "tritonserver" in name or (cmdline and cmdline[0].endswith("tritonserver")):
        return "tritonserver"
    # a stub's children: vLLM titles its processes VLLM::EngineCore, VLLM::Worker
    # (setproctitle); multiprocessing starts a resource tracker
    if name.startswith("VLLM::") or (cmdline and cmdline[0].startswith("VLLM::")):
        title = (cmdline[0] if cmdline and cmdline[0].startswith("VLLM::") else name)[len("VLLM::"):]
    elif any("resource_tracker" in arg for arg in cmdline):
        title = "resource_tracker"
    else:
        title = name
    parent = labels.get(ppid, f"pid {ppid}").removeprefix("stub:")
    return f"{parent}/{title}"


def _mapped_shm(pid: int) -> set[str]:
    """Files under /dev/shm that process `pid` has mapped (Triton's stub regions, vLLM's
    message queues), from /proc/<pid>/maps."""
    paths = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                i = line.find(SHM)
                if i >= 0 and not line.endswith("(deleted)\n"):
                    paths.add(line[i:].rstrip("\n"))
    except OSError:
        pass
    return paths


def _allocated(path: str) -> int:
    """Bytes of tmpfs a file holds (its blocks: vLLM's queues are sparse)."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def _capture_dir(proc: psutil.Process) -> str | None:
    """The hidden-states capture directory an LLM stage named in its engine's environment."""
    try:
        directory = proc.environ().get(CAPTURE_DIR_ENV)
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return None
    return directory if directory and directory.startswith(SHM) else None


class RssSampler:
    """Samples the RSS of `root_pid` and its descendants every `interval_s` on a thread.

    Also samples the tmpfs the server holds in /dev/shm (`shm`), which no RSS shows until a
    process touches it: every file its processes map, plus the files in the LLM stages'
    hidden-states capture directories (written and read with file calls, not mapped).
    """

    def __init__(self, root_pid: int, interval_s: float = 2.0):
        self.root = psutil.Process(root_pid)
        self.interval_s = interval_s
        self.series: dict[int, Series] = {}
        self.shm = Series(0, "/dev/shm (the server's files)")
        self.shm_files: set[str] = set()  # every file counted at some point
        self.t0 = time.monotonic()
        self._labels: dict[int, str] = {}
        self._capture_dirs: dict[int, str | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self.t0 = time.monotonic()
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def processes(self) -> list[psutil.Process]:
        """The server and its descendants now, parents before children."""
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sample(self) -> None:
        t = time.monotonic() - self.t0
        procs = self.processes()
        self._sample_shm(t, procs)
        for proc in procs:
            try:
                mem = proc.memory_info()  # Linux: shared = RssFile + RssShmem
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            series = self.series.get(proc.pid)
            if series is None:
                label = _label(proc, self._labels)
                taken = {s.label for s in self.series.values()}
                label = label if label not in taken else f"{label} ({proc.pid})"
                self._labels[proc.pid] = label
                series = self.series[proc.pid] = Series(proc.pid, label)
            series.t.append(t)
            series.rss.append(mem.rss)
            series.anon.append(max(0, mem.rss - mem.shared))

    def _sample_shm(self, t: float, procs: list[psutil.Process]) -> None:
        files: set[str] = set()
        for proc in procs:
            files |= _mapped_shm(proc.pid)
            if proc.pid not in self._capture_dirs:
                self._capture_dirs[proc.pid] = _capture_dir(proc)
        for directory in {d for d in self._capture_dirs.values() if d}:
            try:
                files |= {e.path for e in os.scandir(directory)}
            except OSError:
                pass
        self.shm_files |= files
        self.shm.t.append(t)
        self.shm.rss.append(sum(_allocated(f) for f in files))
        self.shm.anon.append(self.shm.rss[-1])

    def totals(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, summed RSS) over the sampling rounds."""
        return total_series(list(self.series.values()))


def total_series(series: list[Series], metric: Metric = "rss") -> tuple[np.ndarray, np.ndarray]:
    """Sum the processes' samples round by round (a round's samples share one time)."""
    sums: dict[float, int] = {}
    for s in series:
        for t, r in zip(s.t, s.values(metric)):
            sums[t] = sums.get(t, 0) + r
    times = sorted(sums)
    return np.array(times), np.array([sums[t] for t in times], dtype=np.int64)


def _window_median(t: np.ndarray, rss: np.ndarray, lo: float, hi: float) -> float | None:
    sel = rss[(t >= lo) & (t <= hi)]
    return float(np.median(sel)) if sel.size else None


def windows(end_s: float, warmup_s: float, window_s: float) -> tuple[tuple[float, float],
                                                                      tuple[float, float]]:
    """(baseline, final) windows: the first `window_s` after warm-up and the last `window_s`
    of the run; shortened to a third of the post-warm-up time each when the run is short."""
    window_s = min(window_s, max(end_s - warmup_s, 0.0) / 3)
    return (warmup_s, warmup_s + window_s), (end_s - window_s, end_s)


def _trend_mib_per_min(t: np.ndarray, rss: np.ndarray, lo: float, hi: float) -> float | None:
    sel = (t >= lo) & (t <= hi)
    if sel.sum() < 3 or np.ptp(t[sel]) == 0:
        return None
    return float(np.polyfit(t[sel], rss[sel], 1)[0]) * 60 / 2**20


def growth(series: list[Series], *, end_s: float, warmup_s: float, window_s: float,
           metric: Metric = "rss") -> dict:
    """Median RSS (or its anonymous part) in the baseline and final windows and the growth
    between them (% and MiB), per process (by label) and in total; plus the trend
    (least-squares slope, MiB/min) over the second half of the time after warm-up, which
    tells a plateau from a steady leak."""
    (b0, b1), (e0, e1) = windows(end_s, warmup_s, window_s)
    half = (warmup_s + end_s) / 2

    def row(t, rss) -> dict:
        t, rss = np.asarray(t, float), np.asarray(rss, float)
        base, last = _window_median(t, rss, b0, b1), _window_median(t, rss, e0, e1)
        trend = _trend_mib_per_min(t, rss, half, end_s)
        if base is None or last is None:
            return {"start_mib": base and base / 2**20, "end_mib": last and last / 2**20,
                    "growth_mib": None, "growth_pct": None, "trend_mib_per_min": trend}
        return {"start_mib": base / 2**20, "end_mib": last / 2**20,
                "growth_mib": (last - base) / 2**20, "growth_pct": 100 * (last - base) / base,
                "trend_mib_per_min": trend}

    out = {"baseline_window_s": [b0, b1], "final_window_s": [e0, e1], "trend_window_s": [half, end_s],
           "processes": {s.label: {"pid": s.pid, **row(s.t, s.values(metric))} for s in series}}
    out["total"] = row(*total_series(series, metric))
    return out


def plot(series: list[Series], path: Path, *, warmup_s: float,
         windows_s: tuple[tuple[float, float], tuple[float, float]], title: str,
         shm: Series | None = None) -> Path:
    """PNG of RSS per process over time (top), their sum and its anonymous part (middle) and
    the server's /dev/shm (bottom, when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [3, 1.3] + ([1] if shm is not None else [])
    fig, axes = plt.subplots(len(ratios), 1, figsize=(11, 8 + 1.5 * (shm is not None)), sharex=True,
                             gridspec_kw={"height_ratios": ratios})
    top, bottom = axes[0], axes[1]
    colors = plt.get_cmap("tab20").colors
    for n, s in enumerate(sorted(series, key=lambda s: -max(s.rss, default=0))):
        top.plot(s.t, np.asarray(s.rss) / 2**20, label=s.label, linewidth=1.2,
                 color=colors[n % len(colors)], linestyle="-" if n < len(colors) else "--")
    t, total = total_series(series)
    bottom.plot(t, total / 2**30, color="black", linewidth=1.4, label="RSS")
    t, anon = total_series(series, "anon")
    bottom.plot(t, anon / 2**30, color="tab:red", linewidth=1.2, label="anonymous")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if shm is not None:
        axes[2].plot(shm.t, np.asarray(shm.rss) / 2**20, color="tab:purple", linewidth=1.2)
        axes[2].set_ylabel("/dev/shm (MiB)")
    for ax in axes:
        ax.axvline(warmup_s, color="grey", linestyle="--", linewidth=0.8)
        for lo, hi in windows_s:
            ax.axvspan(lo, hi, color="tab:blue", alpha=0.08)
        ax.grid(alpha=0.3)
    top.set_ylabel("RSS (MiB)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bottom.set_ylabel("total (GiB)")
    axes[-1].set_xlabel("seconds (dashed: end of warm-up; shaded: the windows compared)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

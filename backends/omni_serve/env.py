"""Every `OMNI_*` environment variable the project reads, declared once.

Plain data, importable anywhere (the Triton stubs, the engine processes, the
client SDK, the tools): no Triton, vLLM or torch. Code reads a variable
through its `EnvVar` here (`LOG_LEVEL.get()`), never by a literal name;
docs/environment.md's table is `markdown_table()` (tests/unit/test_env.py
checks both).

    python -m omni_serve.env    # prints the table of docs/environment.md
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name (`<NAME>` where a spec's name goes), default, meaning, reader."""

    name: str
    default: str | None
    meaning: str
    read_by: str

    def get(self, environ: Mapping[str, str] | None = None, **names: str) -> str | None:
        """The value set in `environ` (default os.environ), else the default.

        A templated name takes its placeholders as keywords: `SERVER_URL.get(name="engine")`."""
        environ = os.environ if environ is None else environ
        return environ.get(self.named(**names)) or self.default

    def named(self, **names: str) -> str:
        """The concrete name: `OMNI_SERVER_<NAME>_URL` with name="engine" -> OMNI_SERVER_ENGINE_URL."""
        name = self.name
        for key, value in names.items():
            name = name.replace(f"<{key.upper()}>", value.upper().replace("-", "_"))
        if "<" in name:
            raise ValueError(f"{self.name}: give a value for each <PLACEHOLDER>")
        return name


# --- Triton stubs (every stage) ---------------------------------------------------------
LOG_LEVEL = EnvVar(
    "OMNI_LOG_LEVEL", "INFO",
    "Level of the `omni_serve` logs sent to Triton's log; `DEBUG` adds the debug lines "
    "(shown with `--log-verbose=1`)", "every stage (omni_serve.triton_log)")
CANCEL_POLL_S = EnvVar(
    "OMNI_CANCEL_POLL_S", "0.1",
    "Seconds between a decoupled stage's checks for cancelled requests",
    "decoupled stages (omni_serve.adapter)")

# --- vLLM-hosted stages (omni_llm, omni_talker) ------------------------------------------
GIL_SWITCH_INTERVAL_S = EnvVar(
    "OMNI_GIL_SWITCH_INTERVAL_S", "0.0005",
    "`sys.setswitchinterval` of the stage's stub (how soon the engine loop's thread gets "
    "the GIL back)", "omni_llm, omni_talker (omni_serve.engine_adapter)")
LLM_WARMUP = EnvVar(
    "OMNI_LLM_WARMUP", "1",
    "`0` skips the warm-up request at load (a faster start while developing)",
    "omni_llm, omni_talker (omni_serve.llm.warmup)")
VLLM_SPIN_SLEEP_US = EnvVar(
    "OMNI_VLLM_SPIN_SLEEP_US", None,
    "Microseconds the vLLM engine processes sleep at the start of a wait between polls "
    "(default 50 on CPU, 0 on GPU; 0 = vLLM's own spin)",
    "vLLM engine processes (omni_serve.llm.vllm_plugin)")
VLLM_SPIN_SLEEP_MAX_US = EnvVar(
    "OMNI_VLLM_SPIN_SLEEP_MAX_US", None,
    "Longest such sleep: each sleep of a wait doubles up to it (default 1000 on CPU, 0 on GPU)",
    "vLLM engine processes (omni_serve.llm.vllm_plugin)")
VLLM_SPIN_FINE_MS = EnvVar(
    "OMNI_VLLM_SPIN_FINE_MS", None,
    "For this many milliseconds of a wait its sleeps double only up to 4x the first one, "
    "then up to the longest (default 0: double up to the longest at once; e.g. 20 on a "
    "host with spare cores)",
    "vLLM engine processes (omni_serve.llm.vllm_plugin)")
VLLM_SHM_WAKE = EnvVar(
    "OMNI_VLLM_SHM_WAKE", "0",
    "`1`: a vLLM engine core and its worker wake each other through a FIFO when a step's "
    "message is written, instead of polling for it: up to 1.3x the tokens at concurrency "
    "8-32, but on a busy 2-core host (Linux 6.18.44) other processes then went unscheduled "
    "for up to 0.6 s (benchmarks-notes.md); `0` keeps the polls",
    "vLLM engine processes (omni_serve.llm.shm_wake)")
VLLM_WORKER_IN_ENGINE = EnvVar(
    "OMNI_VLLM_WORKER_IN_ENGINE", "0",
    "`1`: on the CPU platform a one-worker vLLM engine runs its worker inside the "
    "engine-core process (vLLM's `uni` executor, as on one GPU): faster steps, but on a "
    "busy 2-core host (Linux 6.18.44) the kernel then kept the client's session off both "
    "cores for seconds (benchmarks-notes.md); `0` keeps vLLM's worker process",
    "omni_llm, omni_talker (omni_serve.llm.cpu_engine)")
VLLM_WORKER_FORK = EnvVar(
    "OMNI_VLLM_WORKER_FORK", "1",
    "`1`: on the CPU platform a vLLM engine core forks its worker process, with the "
    "worker's OpenMP threads and cores, instead of spawning it (about 6 s less per engine "
    "start on 2 cores); `0` keeps vLLM's spawn",
    "vLLM engine processes (omni_serve.llm.worker_fork)")
VLLM_ENGINE_FORK = EnvVar(
    "OMNI_VLLM_ENGINE_FORK", "1",
    "`1`: on the CPU platform a stage forks its vLLM engine core from its stub, which has "
    "imported vLLM and torch already, instead of spawning it (about 6 s less per engine "
    "start); `0` keeps vLLM's spawn. A worker inside the engine core keeps the spawn",
    "omni_llm, omni_talker (omni_serve.llm.engine_fork)")
HIDDEN_STATES_DIR = EnvVar(
    "OMNI_HIDDEN_STATES_DIR", None,
    "Set by the stage, not by users: the /dev/shm folder its engine writes captured hidden "
    "states to", "vLLM engine processes (omni_serve.llm.hidden_states), omni-soak")
HIDDEN_ROWS_CACHE_MB = EnvVar(
    "OMNI_HIDDEN_ROWS_CACHE_MB", "512",
    "MiB of hidden-state rows an LLM engine keeps so that a spoken reply (its talker reads "
    "a row per prompt position) can read the prefix cache; 0: such requests skip it",
    "omni_llm and its vLLM engine processes (omni_serve.llm.row_cache)")
VLLM_STARTUP_FAILURE_FILE = EnvVar(
    "OMNI_VLLM_STARTUP_FAILURE_FILE", None,
    "Set by the stage, not by users: the file an engine process records why it failed to "
    "start in", "vLLM engine processes (omni_serve.llm.startup_failure)")

# --- orchestrator ------------------------------------------------------------------------
TRITON_GRPC_URL = EnvVar(
    "OMNI_TRITON_GRPC_URL", None,
    "host:port of this server's own gRPC endpoint, when the command line does not say it",
    "omni_orchestrator (omni_serve.orchestrator.locality)")
SERVER_URL = EnvVar(
    "OMNI_SERVER_<NAME>_URL", None,
    "gRPC address of the spec's server `<NAME>` (upper case, `-` as `_`), overriding the spec; "
    "`dns:///name:port`, `ipv4:a:p,b:p` or `host:p,host:p` name its replicas (docs/deploy.md)",
    "omni_orchestrator (omni_serve.orchestrator.config)")
SERVER_SHM = EnvVar(
    "OMNI_SERVER_<NAME>_SHM", None,
    "`auto`, `system` or `none`: shared memory with the spec's server `<NAME>`, overriding "
    "the spec", "omni_orchestrator (omni_serve.orchestrator.config)")

# --- client and tools --------------------------------------------------------------------
URL = EnvVar("OMNI_URL", "localhost:8001", "Triton gRPC endpoint of the `omni` CLI",
             "omni CLI (omni_client.cli)")
MODEL_CACHE = EnvVar(
    "OMNI_MODEL_CACHE", "~/.cache/omni-triton/models",
    "Where the tiny models of the embedded defaults are built",
    "omni-gen-repo, the tests (omni_tools.model_cache)")
TEST_DEVICE = EnvVar(
    "OMNI_TEST_DEVICE", "cpu",
    "`cpu` or `gpu`: where the integration tests serve their repositories (tools/gpu_smoke.sh "
    "sets gpu)", "the integration tests (tests/integration/servers.py)")
VLLM_OMNI_SHIM = EnvVar(
    "OMNI_VLLM_OMNI_SHIM", None,
    "Set by the vLLM-Omni comparison benchmark: the folder of its CPU shim",
    "tools/bench/vllm_omni_* (in vLLM-Omni's own virtualenv)")

ALL: tuple[EnvVar, ...] = tuple(v for v in globals().values() if isinstance(v, EnvVar))


def declared(name: str) -> bool:
    """Whether `name` (concrete, `OMNI_SERVER_ENGINE_URL`, or a template) is declared here."""
    for var in ALL:
        head, _, tail = var.name.partition("<")
        tail = tail.partition(">")[2]
        if name == var.name or (tail and name.startswith(head) and name.endswith(tail)
                                and len(name) > len(head) + len(tail)):
            return True
    return False


@contextlib.contextmanager
def set_while(name: str, value: str) -> Iterator[None]:
    """`os.environ[name] = value` while the block runs (processes started in it inherit
    it); afterwards its earlier value, or none, again."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def markdown_table() -> str:
    """The table of docs/environment.md."""
    rows = ["| Variable | Default | Meaning | Read by |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {f'`{v.default}`' if v.default else '-'} | {v.meaning} | "
             f"{v.read_by} |" for v in ALL]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")

"""Which Triton release a generated repository targets, and what each release accepts.

Runs in the `omni-gen-repo` process (and in tests), never inside tritonserver.

Triton reads config.pbtxt with the model_config.proto it was built with and
refuses a model whose config names a field it does not know ("Message type
inference.ModelConfig has no field named ..."). The tritonclient that
`omni-gen-repo` builds configs with is newer than the tritonserver this
project installs (nvidia-pytriton 0.7.0 carries Triton 2.51.0), so every
spec key that produces a newer field, or asks for a behaviour only newer
releases have, is gated here on the target version (`--triton-version`).

Sources (checked against the release branches of the Triton repositories):
- Triton version of each NGC release: the TRITON_VERSION file of the
  branch rYY.MM of github.com/triton-inference-server/server. One minor
  per month, except 25.07 = 2.59.1 (a patch release), so 25.08 = 2.60.
- model_config.proto of Triton 2.51: extracted from the installed
  libtritonserver (tests/integration/test_triton_version_gates.py diffs
  it against tritonclient's copy).
- The better paths of newer releases (RELEASE_PATHS): the python_backend
  and server sources of the release branches, as each entry says.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from google.protobuf.message import Message

from omni_serve.contract import CONTRACTS


class TritonVersion(NamedTuple):
    """A Triton release as major.minor (patch releases accept the same configs)."""

    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def label(self) -> str:
        """`2.52 (NGC 24.11)`: the version, and the container release when known."""
        ngc = ngc_release(self)
        return f"{self}" + (f" (NGC {ngc})" if ngc else "")


# NGC container release YY.MM -> Triton version (TRITON_VERSION of server branch rYY.MM).
NGC_RELEASES: dict[str, TritonVersion] = {
    "24.10": TritonVersion(2, 51), "24.11": TritonVersion(2, 52), "24.12": TritonVersion(2, 53),
    "25.01": TritonVersion(2, 54), "25.02": TritonVersion(2, 55), "25.03": TritonVersion(2, 56),
    "25.04": TritonVersion(2, 57), "25.05": TritonVersion(2, 58), "25.06": TritonVersion(2, 59),
    "25.07": TritonVersion(2, 59),  # 2.59.1
    "25.08": TritonVersion(2, 60), "25.09": TritonVersion(2, 61), "25.10": TritonVersion(2, 62),
    "25.11": TritonVersion(2, 63), "25.12": TritonVersion(2, 64), "26.01": TritonVersion(2, 65),
    "26.02": TritonVersion(2, 66), "26.03": TritonVersion(2, 67), "26.04": TritonVersion(2, 68),
    "26.05": TritonVersion(2, 69), "26.06": TritonVersion(2, 70), "26.07": TritonVersion(2, 71),
    "26.08": TritonVersion(2, 72),
}

# The tritonserver this project installs (nvidia-pytriton 0.7.0) and the oldest it supports.
DEFAULT_TRITON_VERSION = TritonVersion(2, 51)
OLDEST_TRITON_VERSION = TritonVersion(2, 51)

_VERSION_RE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def ngc_release(version: TritonVersion) -> str | None:
    """The first NGC release (YY.MM) that carries `version`, if known."""
    return next((ngc for ngc, v in NGC_RELEASES.items() if v == version), None)


def parse_triton_version(text: str) -> TritonVersion:
    """`2.52`, `2.52.0` (Triton) or `24.11` (NGC container release) -> TritonVersion(2, 52).

    ValueError, saying what is accepted, for anything else or a release
    older than this project supports.
    """
    match = _VERSION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a version; give a Triton version (2.51, 2.54.0) "
                         "or an NGC release (24.10, 25.01)")
    major, minor = int(match[1]), int(match[2])
    if major == 2:
        version = TritonVersion(major, minor)
    elif major >= 20 and match[3] is None:
        ngc = f"{major:02d}.{minor:02d}"
        if ngc not in NGC_RELEASES:
            first, last = next(iter(NGC_RELEASES)), list(NGC_RELEASES)[-1]
            raise ValueError(f"unknown NGC release {ngc} (known: {first} to {last}); give "
                             "the Triton version instead (tritonserver --version, or "
                             "`version` of GET /v2)")
        version = NGC_RELEASES[ngc]
    else:
        raise ValueError(f"{text!r} is neither a Triton 2.x version (2.51) nor an NGC "
                         "release YY.MM (24.10)")
    if version < OLDEST_TRITON_VERSION:
        raise ValueError(f"Triton {version.label} is older than this project supports; "
                         f"the oldest is {OLDEST_TRITON_VERSION.label}")
    return version


# --- spec keys that need a newer Triton ------------------------------------------

@dataclass(frozen=True)
class Gate:
    """A stage key that only `min_version` and later accept (or act on)."""

    key: str  # dotted, below `stages.<name>`
    min_version: TritonVersion
    applies: Callable[[object], bool]  # (StageSpec) -> is the key set, in this kind of stage
    why: str  # what older releases do with it
    source: str  # where the version comes from


def _has_histogram(stage) -> bool:
    return stage.metrics is not None and stage.metrics.first_response_histogram_ms is not None


def _decoupled(stage) -> bool:
    return CONTRACTS[stage.backend].decoupled


HISTOGRAM_KEY = "metrics.first_response_histogram_ms"
FIRST_RESPONSE_FAMILY = "nv_inference_first_response_histogram_ms"

GATES: tuple[Gate, ...] = (
    Gate(HISTOGRAM_KEY, TritonVersion(2, 52),
         lambda stage: _has_histogram(stage) and _decoupled(stage),
         "config.pbtxt field model_metrics is unknown to older releases: the model fails "
         "to load",
         "triton-inference-server/common#126, core#396 and core#405 (r24.11)"),
    Gate(HISTOGRAM_KEY, TritonVersion(2, 65),
         lambda stage: _has_histogram(stage) and not _decoupled(stage),
         "before 2.65 Triton keeps the first-response histogram for decoupled models only, "
         "so the buckets of this (non-decoupled) stage would be ignored",
         "triton-inference-server/core#464 (r26.01)"),
)


def version_problems(stages: dict, target: TritonVersion) -> list[str]:
    """One line per stage key the target release does not accept or act on."""
    problems = []
    for name, stage in stages.items():
        for gate in GATES:
            if gate.applies(stage) and target < gate.min_version:
                problems.append(
                    f"stages.{name}.{gate.key}: needs Triton >= {gate.min_version.label} "
                    f"({stage.backend} stage); the target is {target.label}: {gate.why}. "
                    f"Pass --triton-version {gate.min_version} (or newer) if your "
                    "tritonserver is, or remove the key")
    return problems


# --- better paths of newer releases ------------------------------------------------

@dataclass(frozen=True)
class ReleasePath:
    """What a release from `min_version` on does better, or needs, and where that is written."""

    name: str
    min_version: TritonVersion
    what: str
    source: str


NUMPY2_MIN_VERSION = TritonVersion(2, 52)
CLIENT_SHM_FLAG_MIN_VERSION = TritonVersion(2, 68)
CLIENT_SHM_FLAG = "--allow-client-shm=true"

RELEASE_PATHS: tuple[ReleasePath, ...] = (
    ReleasePath("numpy 2", NUMPY2_MIN_VERSION,
                "the Python backend stub takes numpy 2 (the 2.51 stub corrupts BYTES tensors "
                "with it, so the CPU path pins numpy<2)",
                "python_backend#384 (pybind11 2.10 -> 2.12, r24.11) and server#7756 (CI "
                "with numpy>=2)"),
    ReleasePath("client shared memory", CLIENT_SHM_FLAG_MIN_VERSION,
                f"system shared memory from clients is refused unless the server runs with "
                f"{CLIENT_SHM_FLAG}; a server whose stages an orchestrator elsewhere sends "
                "shared memory gets the flag",
                "server r26.04 src/command_line_parser.cc (allow-client-shm, default false)"),
)


def numpy_problem(target: TritonVersion, numpy_version: str) -> str | None:
    """Why `numpy_version` must not be used with `target`'s Python stub, or None if it may."""
    major = int(numpy_version.split(".")[0])
    if major >= 2 and target < NUMPY2_MIN_VERSION:
        return (f"numpy {numpy_version} is installed, and the Python backend stub of Triton "
                f"{target.label} corrupts BYTES tensors with numpy 2: install numpy<2 "
                "(pip install --no-deps numpy==1.26.4) in the serving environment, or target "
                f"Triton >= {NUMPY2_MIN_VERSION.label}")
    return None


def servers_sent_shared_memory(spec) -> set[str]:
    """Servers of a (PipelineSpec) spec whose stages an orchestrator on another server sends
    inputs through system shared memory: `shared_memory: system`, or `auto` with a grpc_url
    (or a replica address of it) on this host, as the orchestrator decides at run time."""
    from omni_serve.orchestrator.locality import parse_target, use_shared_memory

    from .spec import role_targets

    out = set()
    for name, stage in spec.stages.items():
        if stage.model is not None:
            continue
        here = spec.server_of(name)
        for _, target, _ in role_targets(stage.engine_args.get("stages")):
            if not isinstance(target, str) or target not in spec.stages:
                continue
            there = spec.server_of(target)
            server = spec.servers.get(there) if there != here else None
            if server is None or server.grpc_url is None:
                continue
            replicas = parse_target(server.grpc_url)
            urls = [server.grpc_url] if replicas is None else list(replicas.addresses)
            if any(use_shared_memory(server.shared_memory, url) for url in urls) \
                    or (server.shared_memory == "system" and urls == []):
                out.add(there)
    return out


def client_shm_flags(target: TritonVersion, receives_shared_memory: bool) -> list[str]:
    """tritonserver flags a server needs when an orchestrator sends it shared memory."""
    if receives_shared_memory and target >= CLIENT_SHM_FLAG_MIN_VERSION:
        return [CLIENT_SHM_FLAG]
    return []


# --- the config.pbtxt fields each release knows ----------------------------------

# Fields of tritonclient's model_config.proto that Triton 2.51's does not have,
# and the first release that has them (protobuf/model_config.proto of
# triton-inference-server/common: #126 -> r24.11, #141 -> r25.11).
PROTO_FIELD_MIN_VERSIONS: dict[str, TritonVersion] = {
    "inference.ModelConfig.model_metrics": TritonVersion(2, 52),
    "inference.ModelEnsembling.max_inflight_requests": TritonVersion(2, 63),
}


def _set_fields(message: Message) -> Iterator[str]:
    """Full names of the fields set in `message` and in the messages below it."""
    for field, value in message.ListFields():
        yield field.full_name
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            values = [v for v in value.values() if isinstance(v, Message)]
        else:
            values = [value] if isinstance(value, Message) else list(value)
        for item in values:
            yield from _set_fields(item)


def fields_too_new(config: Message, target: TritonVersion) -> list[tuple[str, TritonVersion]]:
    """Fields set in a ModelConfig that `target` cannot parse: (full name, first version)."""
    found = dict.fromkeys(_set_fields(config))
    return [(name, PROTO_FIELD_MIN_VERSIONS[name]) for name in found
            if name in PROTO_FIELD_MIN_VERSIONS and target < PROTO_FIELD_MIN_VERSIONS[name]]

"""Pipeline specs: the YAML file that names a pipeline's stages, loaded into typed objects.

Runs in the `omni-gen-repo` process (and in tests), never inside tritonserver.
Flow: YAML text -> `parse_spec` (pydantic, plus checks against vLLM's engine
arguments, the built-in tiny models and the filesystem) -> `PipelineSpec`,
which `omni_tools.gen_repo` turns into a Triton model repository.

Every problem is reported at once as a `SpecError`, one line per problem,
each naming the dotted key (`stages.llm.instances.count`), what is wrong and
what is allowed. Unknown keys are errors, never ignored.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from omni_serve.contract import CONTRACTS, DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE_DELAY_US
from omni_serve.encoder.config import VIDEO_LIMITS_KEY, VideoLimits

# The orchestrator's roles: its own config is the one place their rules live.
from omni_serve.orchestrator.config import (
    MULTI_STAGE_ROLES,  # noqa: F401 (re-exported)
    ROLE_BACKENDS,
    SHM_MIN_BYTES_DEFAULT,
    role_problems,
)

logger = logging.getLogger(__name__)

# Backends a stage may name; each has a tensor contract in omni_serve.contract.
Backend = Literal["omni_llm", "omni_talker", "omni_dit", "omni_encoder", "omni_audio",
                  "omni_orchestrator"]
# Backends without a checkpoint of their own (they call the other stages).
MODELLESS_BACKENDS = frozenset({"omni_orchestrator"})
InstanceKind = Literal["KIND_MODEL", "KIND_CPU", "KIND_GPU", "KIND_AUTO"]

# Backends whose engine batches by itself: Triton must hand requests over one by one.
ENGINE_BATCHED_BACKENDS: frozenset[str] = frozenset(
    name for name, contract in CONTRACTS.items() if contract.batching == "engine")

TINY_PREFIX = "tiny:"
PIPELINE_NAME_RE = re.compile(r"[a-z0-9-]+")
STAGE_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
MODEL_IN_ENGINE_ARGS = "not allowed here: the checkpoint comes from the stage's `model` key"
TALKER_IS_A_BACKEND = ("not an omni_llm setting any more: a talker is a stage of its own; "
                       "write `backend: omni_talker` and drop `talker: true`")
VIDEO_LIMITS_AT_TOP = (f"not a stage setting: set the video limits once, in the spec's top-level "
                       f"`{VIDEO_LIMITS_KEY}` (omni-gen-repo writes them to every stage that "
                       "checks a clip)")
# The stages that check a clip: each gets the spec's video_limits in its engine.json.
VIDEO_CHECKING_BACKENDS = frozenset({"omni_orchestrator", "omni_llm"})
SPECS_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "specs"


class SpecError(ValueError):
    """A pipeline spec that cannot be used; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        super().__init__("\n  ".join([f"{source}: {count}", *problems]))


class _Problems(ValueError):
    """Raised inside validators: problems at key paths below the validated value."""

    def __init__(self, *problems: tuple[tuple[str | int, ...], str]):
        super().__init__("; ".join(message for _, message in problems))
        self.problems = problems


# --- lazily imported collaborators (tests replace these) -----------------------

@functools.lru_cache(maxsize=1)
def vllm_engine_arg_names() -> frozenset[str] | None:
    """Field names of vLLM's AsyncEngineArgs, or None when vLLM is not installed.

    Read from vLLM's source (`vllm/engine/arg_utils.py`) without importing it: the import
    takes 6-7 s of CPU, which every `omni-gen-repo` run paid for these names alone. Where
    the source does not hold the two dataclasses as expected, vLLM is imported after all.
    """
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        logger.warning("vLLM is not installed; engine_args are not checked")
        return None
    source = Path(spec.submodule_search_locations[0]) / "engine" / "arg_utils.py"
    try:
        names = dataclass_field_names(source.read_text(encoding="utf-8"), "AsyncEngineArgs")
    except (OSError, SyntaxError, KeyError):
        names = None
    if names:
        return names
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except Exception as e:  # any import failure means "cannot check"
        logger.warning("vLLM is not importable (%s); engine_args are not checked", e)
        return None
    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def dataclass_field_names(source: str, name: str) -> frozenset[str]:
    """The fields of dataclass `name` defined in module `source` with its bases from the same
    module: its and their annotated class attributes but ClassVar and InitVar ones
    (KeyError: `name` or one of its bases is not a class of that module)."""
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}

    def fields(cls: ast.ClassDef) -> set[str]:
        found: set[str] = set()
        for base in cls.bases:
            if not (isinstance(base, ast.Name) and base.id in classes):
                raise KeyError(ast.unparse(base))
            found |= fields(classes[base.id])
        for node in cls.body:
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and not re.search(r"\b(ClassVar|InitVar)\b", ast.unparse(node.annotation))):
                found.add(node.target.id)
        return found

    return frozenset(fields(classes[name]))


def tiny_models_module() -> ModuleType:
    """The built-in tiny-model builder (imported on first use: it may pull in torch)."""
    return importlib.import_module("omni_tools.tiny_models")


# --- model references ----------------------------------------------------------

def tiny_model_name(model: str) -> str | None:
    """`qwen2-tiny` for `tiny:qwen2-tiny`; None for a filesystem path."""
    return model[len(TINY_PREFIX):] if model.startswith(TINY_PREFIX) else None


def resolve_model_path(model: str, base_dir: Path, marker: str = "config.json") -> Path:
    """Absolute checkpoint directory of a path-valued `model`; ValueError if unusable.

    Environment variables and `~` are expanded; a relative path is taken
    relative to `base_dir` (the spec file's folder). `marker` is the file the
    stage kind needs in it (config.json for transformers/vLLM checkpoints,
    model_index.json for diffusers pipelines).
    """
    expanded = os.path.expanduser(os.path.expandvars(model))
    path = (base_dir / expanded).resolve()
    hint = (f"give a Hugging Face checkpoint directory (holding {marker}) "
            f"or {TINY_PREFIX}<name> for a built-in tiny model")
    if not path.exists():
        unset = re.findall(r"\$\{?(\w+)", expanded)
        if unset:
            raise ValueError(f"environment variable {', '.join(unset)} is not set "
                             f"(model {model!r}); {hint}")
        raise ValueError(f"model directory {path} does not exist; {hint}")
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory; {hint}")
    if not (path / marker).is_file():
        raise ValueError(f"model directory {path} has no {marker}; {hint}")
    return path


def check_tiny_name(name: str) -> None:
    try:
        known = tiny_models_module().TINY_MODELS
    except ImportError as e:
        raise ValueError(f"built-in tiny models are unavailable ({e})") from e
    name, _, sub = name.partition("/")
    if sub and (sub.startswith(("/", ".")) or ".." in sub.split("/")):
        raise ValueError(f"invalid part {sub!r} of a tiny model; use tiny:<name>/<folder>")
    if name not in known:
        raise ValueError(f"unknown built-in tiny model {name!r}; known: "
                         f"{', '.join(TINY_PREFIX + n for n in sorted(known))}")


# --- the spec ------------------------------------------------------------------

# Backends whose engine_args.device picks torch's device (cpu or cuda).
TORCH_DEVICE_BACKENDS = ("omni_dit", "omni_audio", "omni_encoder")

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InstancesSpec(_Strict):
    """Triton `instance_group` of a stage."""

    count: Annotated[int, Field(ge=1)] = 1
    kind: InstanceKind = "KIND_MODEL"
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)

    @field_validator("gpus")
    @classmethod
    def _gpus_need_kind_gpu(cls, gpus: list[int], info: ValidationInfo) -> list[int]:
        kind = info.data.get("kind")
        if gpus and kind is not None and kind != "KIND_GPU":
            raise ValueError(f"only allowed with kind KIND_GPU (kind is {kind}); "
                             "set kind: KIND_GPU or remove gpus")
        return gpus


TimeoutAction = Literal["REJECT", "DELAY"]
DEFAULT_SERVER = "default"


class ServerSpec(_Strict):
    """One tritonserver of a disaggregated pipeline."""

    # host:port of its gRPC endpoint, as the other servers reach it (needed
    # when an orchestrator elsewhere calls a stage here; OMNI_SERVER_<NAME>_URL
    # overrides it at run time).
    grpc_url: str | None = None
    # How an orchestrator on another server sends this server's stages inputs
    # of at least `shared_memory_min_bytes` (the thinker's mm_embeds): through
    # Triton system shared memory ("system"), inside the gRPC message ("none"),
    # or shared memory when grpc_url's host is the orchestrator's own ("auto").
    # OMNI_SERVER_<NAME>_SHM overrides it at run time.
    shared_memory: Literal["auto", "system", "none"] = "auto"
    shared_memory_min_bytes: Annotated[int, Field(ge=1)] = SHM_MIN_BYTES_DEFAULT

    @field_validator("grpc_url")
    @classmethod
    def _replicas(cls, value: str | None) -> str | None:
        """host:port, or its replicas: dns:///name:port, ipv4:a:p,b:p, host:p,host:p."""
        if value is not None:
            from omni_serve.orchestrator.locality import parse_target

            parse_target(value)  # ValueError saying what to write
        return value


class QueuePolicySpec(_Strict):
    """Triton's `default_queue_policy` of a dynamically batched stage."""

    max_queue_size: Annotated[int, Field(ge=0)] = 0  # 0: unbounded
    default_timeout_us: Annotated[int, Field(ge=0)] = 0  # 0: no timeout
    timeout_action: TimeoutAction = "REJECT"  # what happens to a request that timed out
    allow_timeout_override: bool = False  # may a request ask for its own timeout


class MetricsSpec(_Strict):
    """Triton's per-model metric options (`model_metrics`: Triton 2.52 and later, see
    omni_tools.triton_versions)."""

    # Upper bounds (ms) of the buckets of nv_inference_first_response_histogram_ms
    # (time to first response; reported with --metrics-config histogram_latencies=true).
    first_response_histogram_ms: list[float] | None = None

    @field_validator("first_response_histogram_ms")
    @classmethod
    def _buckets_increase(cls, buckets: list[float] | None) -> list[float] | None:
        if buckets is None:
            return None
        if not buckets:
            raise ValueError("give at least one bucket bound (ms), or remove the key")
        if any(not math.isfinite(b) or b < 0 for b in buckets):
            raise ValueError(f"bucket bounds must be finite and >= 0 (got {buckets})")
        if any(lower >= upper for lower, upper in zip(buckets, buckets[1:])):
            raise ValueError(f"bucket bounds must increase strictly (got {buckets})")
        return buckets


# vLLM engine arguments that spread one engine over several devices.
PARALLEL_ENGINE_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


class StageSpec(_Strict):
    """One stage: a Triton model served by one of the omni backends."""

    backend: Backend
    model: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    instances: InstancesSpec = Field(default_factory=InstancesSpec)
    max_batch_size: Annotated[int, Field(ge=0)] | None = None
    # Triton's dynamic batcher (backends whose contract batches in Triton).
    max_queue_delay_us: Annotated[int, Field(ge=0)] | None = None
    preserve_ordering: bool = False  # responses leave in arrival order
    queue: QueuePolicySpec | None = None
    # Which tritonserver serves this stage (a key of the spec's `servers`).
    server: str | None = None
    # Environment of this stage's stub process (and the engine processes it
    # starts), e.g. VLLM_CPU_OMP_THREADS_BIND to give two vLLM engines their
    # own cores. Written as config.pbtxt parameters `env.<NAME>`.
    env: dict[str, str] = Field(default_factory=dict)
    # Triton per-model metric options (config.pbtxt model_metrics).
    metrics: MetricsSpec | None = None

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [k for k in env if not ENV_NAME_RE.fullmatch(k)]
        if bad:
            raise _Problems(*[((k,), "not an environment variable name ([A-Z_][A-Z0-9_]*)")
                              for k in bad])
        return env

    @property
    def tiny_model(self) -> str | None:
        return None if self.model is None else tiny_model_name(self.model)

    @property
    def triton_batched(self) -> bool:
        return self.backend not in ENGINE_BATCHED_BACKENDS

    @property
    def effective_max_batch_size(self) -> int:
        """The config.pbtxt max_batch_size (0 = Triton does not batch)."""
        if self.max_batch_size is not None:
            return self.max_batch_size
        return DEFAULT_MAX_BATCH_SIZE if self.triton_batched else 0

    @property
    def effective_max_queue_delay_us(self) -> int:
        return DEFAULT_MAX_QUEUE_DELAY_US if self.max_queue_delay_us is None \
            else self.max_queue_delay_us

    @field_validator("model")
    @classmethod
    def _model_usable(cls, model: str | None, info: ValidationInfo) -> str | None:
        backend = info.data.get("backend")
        if backend in MODELLESS_BACKENDS:
            if model is not None:
                raise ValueError(f"not used by backend {backend} (it only calls the other "
                                 "stages); remove the key")
            return model
        if model is None:
            raise ValueError("required: a checkpoint directory or tiny:<name>")
        name = tiny_model_name(model)
        if name is not None:
            check_tiny_name(name)
        elif (info.context or {}).get("check_paths", True):
            backend = info.data.get("backend")
            marker = CONTRACTS[backend].checkpoint_marker if backend in CONTRACTS else "config.json"
            resolve_model_path(model, _base_dir(info), marker)
        return model

    @field_validator("engine_args")
    @classmethod
    def _engine_args_known(cls, engine_args: dict[str, Any],
                           info: ValidationInfo) -> dict[str, Any]:
        backend = info.data.get("backend", "omni_llm")
        problems = []
        known = None
        removed = removed_engine_args(backend)
        for key, value in engine_args.items():
            if key == "model":
                problems.append(((key,), MODEL_IN_ENGINE_ARGS))
                continue
            if key in removed:
                problems.append(((key,), removed[key]))
                continue
            if key == VIDEO_LIMITS_KEY:
                problems.append(((key,), VIDEO_LIMITS_AT_TOP))
                continue
            if key == "talker" and backend == "omni_llm":
                problems.append(((key,), TALKER_IS_A_BACKEND))
                continue
            known = known if known is not None else engine_arg_names(backend)
            if known is not None and key not in known:
                problems.append(((key,), _unknown_engine_arg(key, known, backend)))
                continue
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                message = (f"value of type {type(value).__name__} is not JSON-serializable; "
                           "use a string, number, bool, list or mapping")
                problems.append(((key,), message))
        if problems:
            raise _Problems(*problems)
        return engine_args

    @field_validator("max_batch_size")
    @classmethod
    def _batching_fits_backend(cls, size: int | None, info: ValidationInfo) -> int | None:
        backend = info.data.get("backend")
        if backend in ENGINE_BATCHED_BACKENDS and size not in (None, 0):
            raise ValueError(f"must be 0 for backend {backend} (got {size}): its engine batches "
                             "requests continuously, so Triton hands them over one by one; "
                             "remove the key or set 0")
        if backend not in ENGINE_BATCHED_BACKENDS and size == 0:
            raise ValueError(f"must be at least 1 for backend {backend} (got 0): Triton's "
                             "dynamic batcher forms its batches; 1 disables batching")
        return size

    @field_validator("queue")
    @classmethod
    def _queue_fits_backend(cls, value: QueuePolicySpec | None,
                            info: ValidationInfo) -> QueuePolicySpec | None:
        backend = info.data.get("backend")
        if value is None or backend not in ENGINE_BATCHED_BACKENDS:
            return value
        if backend not in ("omni_llm", "omni_talker"):
            raise ValueError(f"not used by backend {backend}: it queues nothing itself (its "
                             "stages do); remove the key")
        others = sorted(k for k, f in QueuePolicySpec.model_fields.items()
                        if k != "max_queue_size" and getattr(value, k) != f.default)
        if others:
            raise ValueError(f"backend {backend} takes only max_queue_size (requests waiting "
                             f"beyond the engine's max_num_seqs running ones; 0: unbounded): "
                             f"its engine queues, not Triton's dynamic batcher; remove "
                             f"{', '.join(others)}")
        return value

    @field_validator("max_queue_delay_us")
    @classmethod
    def _queue_delay_fits_backend(cls, value: Any, info: ValidationInfo) -> Any:
        backend = info.data.get("backend")
        if value is not None and backend in ENGINE_BATCHED_BACKENDS:
            raise ValueError(f"not used by backend {backend}: its engine batches and queues by "
                             "itself; remove the key")
        return value

    @field_validator("preserve_ordering")
    @classmethod
    def _ordering_fits_backend(cls, value: bool, info: ValidationInfo) -> bool:
        backend = info.data.get("backend")
        if value and backend in ENGINE_BATCHED_BACKENDS:
            raise ValueError(f"not used by backend {backend}: Triton's dynamic batcher is off "
                             "for it; remove the key")
        return value

    @model_validator(mode="after")
    def _placement_fits_backend(self) -> StageSpec:
        """KIND_GPU: Triton gives each instance one GPU and the adapter makes it the only
        one the instance sees (omni_serve.tritonio.apply_stage_env)."""
        if self.instances.kind != "KIND_GPU":
            return self
        if "CUDA_VISIBLE_DEVICES" in self.env:
            raise _Problems((("env", "CUDA_VISIBLE_DEVICES"),
                             "KIND_GPU instances each get the GPU Triton gives them (choose them "
                             "with instances.gpus); remove it, or use KIND_MODEL to pick the GPUs "
                             "yourself"))
        if self.backend == "omni_orchestrator":
            raise _Problems((("instances", "kind"),
                             "the orchestrator computes nothing on a GPU; use KIND_CPU or "
                             "KIND_MODEL"))
        if self.backend in TORCH_DEVICE_BACKENDS and self.engine_args.get("device") != "cuda":
            raise _Problems((("engine_args", "device"),
                             f"KIND_GPU runs each {self.backend} instance on its GPU: set "
                             "device: cuda (or use KIND_CPU)"))
        return self

    @model_validator(mode="after")
    def _parallelism_fits_instances(self) -> StageSpec:
        devices = 1
        for key in PARALLEL_ENGINE_ARGS:
            value = self.engine_args.get(key, 1)
            if isinstance(value, int) and not isinstance(value, bool):
                devices *= max(value, 1)
        if devices == 1:
            return self
        kind = self.instances.kind
        parallel = ", ".join(f"{k}={self.engine_args[k]}" for k in PARALLEL_ENGINE_ARGS
                             if k in self.engine_args)
        if kind == "KIND_GPU":
            raise _Problems((("instances", "kind"),
                             f"KIND_GPU gives each instance exactly one GPU, but {parallel} needs "
                             f"{devices} per engine; use KIND_MODEL and let vLLM place its workers "
                             "(choose GPUs with CUDA_VISIBLE_DEVICES in env)"))
        if kind == "KIND_CPU":
            raise _Problems((("instances", "kind"),
                             f"{parallel} spreads the engine over {devices} GPUs; KIND_CPU "
                             "instances have none (use KIND_MODEL)"))
        if self.instances.count > 1:
            raise _Problems((("instances", "count"),
                             f"{self.instances.count} instances of an engine with {parallel} "
                             f"would need {self.instances.count * devices} devices placed by hand; "
                             "use count 1 (vLLM batches requests itself)"))
        return self


def _check_stage_name(name: str) -> str:
    if not STAGE_NAME_RE.fullmatch(name):
        raise ValueError("stage name must match [A-Za-z0-9_-]+ (it becomes the Triton model name)")
    return name


StageName = Annotated[str, AfterValidator(_check_stage_name)]


class PipelineSpec(_Strict):
    """A whole pipeline: its stages (key = Triton model name) and the entry stage."""

    pipeline: str
    description: str | None = None
    servers: dict[StageName, ServerSpec] = Field(default_factory=dict)
    stages: dict[StageName, StageSpec]
    entry: str | None = None
    # Limits on one video clip (omni_serve.encoder.config.VideoLimits), set once here:
    # omni-gen-repo writes them to the engine.json of every stage that checks a clip (each
    # orchestrator's probe, each omni_llm's decode); unset, those stages keep the defaults.
    video_limits: VideoLimits | None = None

    def server_of(self, stage: str) -> str:
        return self.stages[stage].server or DEFAULT_SERVER

    @property
    def server_names(self) -> list[str]:
        return list(dict.fromkeys(self.server_of(name) for name in self.stages))

    @model_validator(mode="after")
    def _servers_exist(self) -> PipelineSpec:
        problems = []
        known = ", ".join(self.servers) or "(none: add a top-level `servers` mapping)"
        for name, stage in self.stages.items():
            if stage.server is not None and stage.server not in self.servers:
                problems.append((("stages", name, "server"),
                                 f"no server named {stage.server!r}; servers: {known}"))
        if not problems:
            for name, stage in self.stages.items():
                if stage.backend != "omni_orchestrator":
                    continue
                for role, target, _ in role_targets(stage.engine_args.get("stages")):
                    if not isinstance(target, str) or target not in self.stages:
                        continue
                    there = self.server_of(target)
                    if there != self.server_of(name) and not (
                            there in self.servers and self.servers[there].grpc_url):
                        problems.append((("servers", there, "grpc_url"),
                                         f"required: stage {target!r} ({role}) on server {there!r} "
                                         f"is called by {name!r} on server "
                                         f"{self.server_of(name)!r}"))
        if problems:
            raise _Problems(*problems)
        return self

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source: str = PrivateAttr(default="<spec>")

    @property
    def base_dir(self) -> Path:
        """Folder relative model paths are resolved against (the spec file's folder)."""
        return self._base_dir

    @property
    def source(self) -> str:
        """Where the spec came from (file path or `preset <name>`), for messages."""
        return self._source

    @field_validator("pipeline")
    @classmethod
    def _pipeline_name(cls, name: str) -> str:
        if not PIPELINE_NAME_RE.fullmatch(name):
            raise ValueError(f"must match [a-z0-9-]+ (lowercase letters, digits, '-'), "
                             f"got {name!r}")
        return name

    @field_validator("stages")
    @classmethod
    def _some_stages(cls, stages: dict[str, StageSpec]) -> dict[str, StageSpec]:
        if not stages:
            raise ValueError("at least one stage is required")
        return stages

    @model_validator(mode="after")
    def _stage_models_given(self) -> PipelineSpec:
        missing = [((("stages", name, "model"), "required: a checkpoint directory or tiny:<name>"))
                   for name, stage in self.stages.items()
                   if stage.model is None and stage.backend not in MODELLESS_BACKENDS]
        if missing:
            raise _Problems(*missing)
        return self

    @model_validator(mode="after")
    def _orchestrator_roles_exist(self) -> PipelineSpec:
        """The orchestrator's own role rules (omni_serve.orchestrator.config.role_problems),
        then what only the spec can check: each name is a stage of the right backend."""
        problems = []
        for name, stage in self.stages.items():
            if stage.backend != "omni_orchestrator":
                continue
            roles = stage.engine_args.get("stages")
            base = ("stages", name, "engine_args", "stages")
            own = role_problems(roles)
            problems.extend(((*base, *where), message) for where, message in own)
            bad = {where[:1] for where, _ in own}
            for role, target, path in role_targets(roles):
                if role in ROLE_BACKENDS and (role,) not in bad and isinstance(target, str):
                    problems.extend(self._role_target_problems((*base, *path), role, target))
        if problems:
            raise _Problems(*problems)
        return self

    def _role_target_problems(self, where: tuple[str | int, ...], role: str,
                              target: Any) -> list[tuple[tuple[str | int, ...], str]]:
        """What is wrong with stage name `target` for `role` (nothing for None: role unused)."""
        if target is None:
            return []
        if not isinstance(target, str):
            return [(where, f"must be a stage name (got {_short(target)})")]
        if target not in self.stages:
            return [(where, f"no stage named {target!r}; stages: {', '.join(self.stages)}")]
        if self.stages[target].backend != ROLE_BACKENDS[role]:
            return [(where, f"stage {target!r} has backend {self.stages[target].backend}; the "
                            f"{role} role needs {ROLE_BACKENDS[role]}")]
        return []

    @model_validator(mode="after")
    def _entry_is_a_stage(self) -> PipelineSpec:
        names = ", ".join(self.stages)
        if self.entry is None:
            if len(self.stages) != 1:
                raise _Problems((("entry",), f"required with several stages; one of: {names}"))
            self.entry = next(iter(self.stages))
        elif self.entry not in self.stages:
            raise _Problems((("entry",), f"no stage named {self.entry!r}; stages: {names}"))
        return self


def role_targets(roles: Any) -> list[tuple[str, Any, tuple[str | int, ...]]]:
    """(role, stage name, key path below `stages`) for each stage an orchestrator's
    `engine_args.stages` names; a role naming a list (the thinker's engines) gives one
    entry per item."""
    out: list[tuple[str, Any, tuple[str | int, ...]]] = []
    for role, target in roles.items() if isinstance(roles, Mapping) else ():
        if isinstance(target, list):
            out.extend((role, item, (role, i)) for i, item in enumerate(target))
        else:
            out.append((role, target, (role,)))
    return out


def _base_dir(info: ValidationInfo) -> Path:
    context = info.context or {}
    return Path(context.get("base_dir") or Path.cwd())


_ENGINE_ARGS_DOC = {
    "omni_llm": ("vLLM engine argument", "the fields of vllm.engine.arg_utils.AsyncEngineArgs"),
    "omni_talker": ("vLLM engine argument",
                    "the fields of vllm.engine.arg_utils.AsyncEngineArgs"),
    "omni_dit": ("omni_dit pipeline argument", "the fields of omni_serve.dit.config.DitStageConfig"),
    "omni_encoder": ("omni_encoder argument",
                     "the fields of omni_serve.encoder.config.EncoderStageConfig"),
    "omni_audio": ("omni_audio argument", "the fields of omni_serve.audio.config.AudioStageConfig"),
    "omni_orchestrator": ("omni_orchestrator argument",
                          "the fields of omni_serve.orchestrator.config.OrchestratorConfig"),
}

# The typed config each non-vLLM backend validates its engine.json with.
STAGE_CONFIGS = {
    "omni_dit": "omni_serve.dit.config:DitStageConfig",
    "omni_encoder": "omni_serve.encoder.config:EncoderStageConfig",
    "omni_audio": "omni_serve.audio.config:AudioStageConfig",
    "omni_orchestrator": "omni_serve.orchestrator.config:OrchestratorConfig",
}


def stage_config_class(backend: str) -> type[BaseModel] | None:
    if backend not in STAGE_CONFIGS:
        return None
    module, name = STAGE_CONFIGS[backend].split(":")
    return getattr(importlib.import_module(module), name)


def engine_arg_names(backend: str) -> frozenset[str] | None:
    """The engine_args keys a backend accepts (None: cannot be checked here)."""
    config = stage_config_class(backend)
    if config is not None:
        return frozenset(config.model_fields) - {"model"}
    return vllm_engine_arg_names()


def removed_engine_args(backend: str) -> dict[str, str]:
    """engine_args keys the backend no longer has, each with what to do instead."""
    return getattr(stage_config_class(backend), "REMOVED_SETTINGS", {})


def _unknown_engine_arg(key: str, known: frozenset[str], backend: str = "omni_llm") -> str:
    what, where = _ENGINE_ARGS_DOC.get(backend, _ENGINE_ARGS_DOC["omni_llm"])
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
    if len(close) == 1:
        return f"unknown {what}; did you mean {close[0]}?"
    if close:
        return f"unknown {what}; did you mean one of: {', '.join(close)}?"
    return f"unknown {what}; allowed: {where} (except model)"


# --- ValidationError -> readable lines -----------------------------------------

def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The spec model class that validates the mapping at `loc`, if any."""
    ann: Any = PipelineSpec
    for part in loc:
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(str(part))
            if field is None:
                return None
            ann = field.annotation
            models = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
            if get_origin(ann) in (Union, UnionType) and len(models) == 1:
                ann = models[0]  # `QueuePolicySpec | None`
        elif get_origin(ann) is dict:
            ann = get_args(ann)[1]
        else:
            return None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _error_lines(error: dict[str, Any]) -> list[str]:
    loc = tuple(error["loc"])
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _Problems):
        return [f"{_dotted(loc + sub)}: {message}" for sub, message in cause.problems]
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        allowed = ", ".join(model.model_fields) if model else "?"
        return [f"{_dotted(loc)}: unknown key; allowed keys here: {allowed}"]
    if kind == "missing":
        return [f"{_dotted(loc)}: required key is missing"]
    msg = msg.removeprefix("Value error, ")
    if loc and loc[-1] == "[key]":
        return [f"{_dotted(loc[:-1])}: {msg}"]
    if kind == "value_error":
        return [f"{_dotted(loc)}: {msg}"]
    if kind == "model_type":
        return [f"{_dotted(loc)}: must be a mapping (got {_short(error['input'])})"]
    return [f"{_dotted(loc)}: {msg} (got {_short(error['input'])})"]


# --- loading -------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (YAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_spec(data: Any, *, base_dir: Path | None = None, source: str = "<spec>",
               check_paths: bool = True) -> PipelineSpec:
    """Validate already-parsed spec data; raises SpecError listing every problem.

    `check_paths=False` leaves checkpoint folders unchecked: they are paths on another
    machine (`omni-gen-repo --deploy` writes manifests for containers that mount them)."""
    if not isinstance(data, Mapping):
        message = f"the spec must be a mapping (pipeline, stages, ...), not {type(data).__name__}"
        raise SpecError(source, [message])
    base_dir = (base_dir or Path.cwd()).resolve()
    try:
        spec = PipelineSpec.model_validate(data, context={"base_dir": base_dir,
                                                          "check_paths": check_paths})
    except ValidationError as e:
        problems = [line for err in e.errors() for line in _error_lines(err)]
        raise SpecError(source, problems) from None
    spec._base_dir = base_dir
    spec._source = source
    return spec


def load_spec(path: str | os.PathLike[str], *, check_paths: bool = True) -> PipelineSpec:
    """Read and validate a spec file; relative model paths are relative to its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(str(path), [f"cannot read the spec: {e.strerror or e}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise SpecError(str(path), [_yaml_problem(e)]) from None
    return parse_spec(data, base_dir=path.parent, source=str(path), check_paths=check_paths)


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    what = " ".join(str(p) for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
    return f"{where}invalid YAML: {what or e}"


def list_presets() -> list[str]:
    """Names of the specs shipped in model_repository/specs/."""
    return sorted(p.stem for p in SPECS_DIR.glob("*.yaml"))


def load_preset(name: str) -> PipelineSpec:
    """Load model_repository/specs/<name>.yaml; unknown names list the presets."""
    presets = list_presets()
    if name not in presets:
        message = f"unknown preset {name!r}; presets: {', '.join(presets) or '(none)'}"
        raise SpecError(f"preset {name}", [message])
    spec = load_spec(SPECS_DIR / f"{name}.yaml")
    spec._source = f"preset {name}"
    return spec

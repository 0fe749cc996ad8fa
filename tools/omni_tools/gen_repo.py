"""`omni-gen-repo`: turn a pipeline spec into a Triton model repository.

Runs as a command-line process (or in tests), never inside tritonserver.
Flow: spec YAML -> `PipelineSpec` (omni_tools.spec) -> per stage a
`ModelConfig` proto built from the stage's tensor contract
(omni_serve.contract) plus the engine JSON -> files:

    OUT/<stage>/config.pbtxt     Triton model config (text-format protobuf)
    OUT/<stage>/engine.json      {"model": <absolute checkpoint dir>, **engine_args}
                                 (+ the spec's video_limits where a stage checks clips)
    OUT/<stage>/1/               version folder (the backend's model.py is not copied)
    OUT/.omni-gen-repo.json      manifest: which entries this tool owns

Everything is resolved and built before the first byte is written, and the
files are written into a temporary folder beside OUT and then moved in, so a
failure leaves OUT as it was.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml
from google.protobuf import json_format, text_format
from pydantic import ValidationError
from tritonclient.grpc import model_config_pb2

from omni_serve import families
from omni_serve.contract import (
    CONTRACTS,
    ENGINE_ARGS_FILE,
    ENTRY_PARAMETER,
    ENV_PARAMETER_PREFIX,
    MAX_QUEUED_ARG,
)
from omni_serve.encoder.config import VIDEO_LIMITS_KEY

from . import checkpoint, deploy
from .devices import DEVICES, on_gpu
from .spec import (
    SPECS_DIR,
    VIDEO_CHECKING_BACKENDS,
    InstancesSpec,
    PipelineSpec,
    SpecError,
    StageSpec,
    check_tiny_name,
    list_presets,
    load_preset,
    load_spec,
    parse_spec,
    resolve_model_path,
    role_targets,
    stage_config_class,
    tiny_model_name,
    tiny_models_module,
)
from .triton_versions import (
    DEFAULT_TRITON_VERSION,
    FIRST_RESPONSE_FAMILY,
    TritonVersion,
    client_shm_flags,
    fields_too_new,
    numpy_problem,
    parse_triton_version,
    servers_sent_shared_memory,
    version_problems,
)

logger = logging.getLogger(__name__)

PROG = "omni-gen-repo"
GENERATOR_VERSION = 1  # layout of the written repository
MANIFEST_FILE = ".omni-gen-repo.json"
CONFIG_FILE = "config.pbtxt"
VERSION_DIR = "1"


class RepoError(RuntimeError):
    """The output directory cannot be written as asked (the spec itself is fine)."""


@dataclass(frozen=True)
class StagePlan:
    """Everything written for one stage, built before anything is written."""

    name: str
    config: model_config_pb2.ModelConfig
    engine: dict


# --- config.pbtxt --------------------------------------------------------------

def _instance_group(instances: InstancesSpec) -> dict:
    group: dict = {"count": instances.count, "kind": instances.kind}
    if instances.gpus:
        group["gpus"] = list(instances.gpus)
    return group


def build_model_config(stage_name: str, stage: StageSpec) -> model_config_pb2.ModelConfig:
    """The Triton ModelConfig of one stage; tensors come from the backend's contract."""
    contract = CONTRACTS[stage.backend]
    config: dict = {
        "name": stage_name,
        "backend": contract.backend,
        "max_batch_size": stage.effective_max_batch_size,
        "input": [t.config_entry(is_input=True) for t in contract.inputs],
        "output": [t.config_entry(is_input=False) for t in contract.outputs],
        "instance_group": [_instance_group(stage.instances)],
    }
    if contract.decoupled:
        config["model_transaction_policy"] = {"decoupled": True}
    if stage.env:
        config["parameters"] = {f"{ENV_PARAMETER_PREFIX}{k}": {"string_value": v}
                                for k, v in stage.env.items()}
    if stage.triton_batched:
        batching: dict = {"max_queue_delay_microseconds": str(stage.effective_max_queue_delay_us)}
        if stage.preserve_ordering:
            batching["preserve_ordering"] = True
        if stage.queue is not None:
            q = stage.queue
            batching["default_queue_policy"] = {
                "timeout_action": q.timeout_action,
                "default_timeout_microseconds": str(q.default_timeout_us),
                "allow_timeout_override": q.allow_timeout_override,
                "max_queue_size": q.max_queue_size}
        config["dynamic_batching"] = batching
    if stage.metrics is not None and stage.metrics.first_response_histogram_ms is not None:
        # Triton >= 2.52 only: plan() refuses it for an older target.
        config["model_metrics"] = {"metric_control": [{
            "metric_identifier": {"family": FIRST_RESPONSE_FAMILY},
            "histogram_options": {"buckets": list(stage.metrics.first_response_histogram_ms)}}]}
    return json_format.ParseDict(config, model_config_pb2.ModelConfig())


def config_text(config: model_config_pb2.ModelConfig, *, source: str,
                triton_version: TritonVersion = DEFAULT_TRITON_VERSION) -> str:
    """config.pbtxt content: a header comment, then the proto in text format."""
    return (f"# Generated by {PROG} from {source} for Triton {triton_version.label}; "
            "edit the spec and regenerate.\n"
            + text_format.MessageToString(config))


# --- planning (no writes) ------------------------------------------------------

def _resolve_model(spec: PipelineSpec, name: str, stage: StageSpec) -> Path:
    tiny = stage.tiny_model
    marker = CONTRACTS[stage.backend].checkpoint_marker
    if tiny is None:
        try:
            return resolve_model_path(stage.model, spec.base_dir, marker)
        except ValueError as e:
            raise SpecError(spec.source, [f"stages.{name}.model: {e}"]) from None
    base, _, sub = tiny.partition("/")
    path = Path(tiny_models_module().ensure_model(base)).resolve() / sub
    if not (path / marker).is_file():
        raise RepoError(f"built-in tiny model {tiny} at {path} has no {marker}")
    return path


def _decoder_context(folder: Path) -> dict[str, int]:
    """The chunk context the audio decoder's checkpoint needs, as its model family computes it
    from config.json (`Family.decoder_context`); {} for a folder of no family or no decoder."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        family = families.for_config(config)
    except (OSError, ValueError):
        return {}
    if family.decoder_context is None:
        return {}
    ctx = families.load(family.decoder_context)(config)
    if ctx is None:
        return {}
    return {"left_context_codes": ctx.left, "right_context_codes": ctx.right,
            "align_codes": ctx.align}


def _orchestrator_engine(spec: PipelineSpec, name: str, stage: StageSpec,
                         models: dict[str, str]) -> dict:
    """The orchestrator's engine.json: its engine_args, plus what the stages' checkpoints say
    (the thinker's tokenizer, the decoder's chunk context, the voices)."""
    engine = dict(stage.engine_args)
    here = spec.server_of(name)
    remote = {}
    for _, target, _ in role_targets(engine.get("stages")):
        if isinstance(target, str) and target in spec.stages and spec.server_of(target) != here:
            there = spec.server_of(target)
            server = spec.servers[there]
            remote[target] = {"server": there, "url": server.grpc_url,
                              **server.model_dump(include={"shared_memory",
                                                           "shared_memory_min_bytes"},
                                                  exclude_defaults=True)}
    if remote:
        engine["remote"] = remote
    talker = (engine.get("stages") or {}).get("talker")
    thinker = (engine.get("stages") or {}).get("thinker")
    thinker = thinker[0] if isinstance(thinker, list) and thinker else thinker
    if "tokenizer" not in engine and isinstance(thinker, str) and thinker in models:
        # the thinker's chat template renders its prompts; task "speech" also
        # tokenizes the text to read with its tokenizer
        engine["tokenizer"] = models[thinker]
    if "family" not in engine and isinstance(thinker, str) and thinker in models:
        # the checkpoint's model family; one the registry does not know keeps the default
        family = _family_of(Path(models[thinker]))
        if family is not None:
            engine["family"] = family
    decoder = (engine.get("stages") or {}).get("audio_decoder")
    if decoder and decoder in models:
        for key, value in _decoder_context(Path(models[decoder])).items():
            engine.setdefault(key, value)
    if talker and "voices" not in engine:
        voices = _checkpoint_voices(spec, name, engine, models)
        if voices is not None:
            engine["voices"] = voices
    return engine


def _family_of(folder: Path) -> str | None:
    """The model family of the checkpoint in `folder` (omni_serve.families), if it has one."""
    try:
        return families.for_config(json.loads((folder / "config.json").read_text())).name
    except (OSError, ValueError):
        return None


def _checkpoint_voices(spec: PipelineSpec, name: str, engine: dict,
                         models: dict[str, str]) -> list[str] | None:
    """The voices the speech stages know: the audio decoder's checkpoint, else the talker's."""
    roles = engine.get("stages") or {}
    for role in ("audio_decoder", "talker"):
        stage = roles.get(role)
        if not isinstance(stage, str) or stage not in models:
            continue
        try:
            voices = checkpoint.voices(Path(models[stage]))
        except ValueError as e:
            raise SpecError(spec.source, [
                f"stages.{name}.engine_args.voices: {e}; fix the file or list the "
                "voices here"]) from None
        if voices is not None:
            return voices
    return None


def _check_stage_config(spec: PipelineSpec, name: str, backend: str, engine: dict) -> None:
    config = stage_config_class(backend)
    if config is None:
        return
    try:
        config.model_validate(engine)
    except ValidationError as e:
        raise SpecError(spec.source, [
            f"stages.{name}.engine_args{'.' + '.'.join(map(str, err['loc'])) if err['loc'] else ''}: "
            f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors()]) from None


def plan(spec: PipelineSpec, *, resolve_models: bool = True, check_paths: bool = True,
         triton_version: TritonVersion = DEFAULT_TRITON_VERSION) -> list[StagePlan]:
    """Validate `spec` again and build every stage's files in memory.

    With `resolve_models=False` tiny models are not built (engine "model" is
    then the spec's own reference); that is what `--check` uses, and it checks
    every stage's engine_args with the stage's own config class all the same. Keys the
    `triton_version` release does not accept are SpecErrors naming the stage,
    the key and the first release that has it (omni_tools.triton_versions).
    `check_paths=False` (with `resolve_models=False`) leaves checkpoint folders unchecked.
    """
    spec = parse_spec(spec.model_dump(exclude_none=True), base_dir=spec.base_dir,
                      source=spec.source, check_paths=check_paths or resolve_models)
    too_new = version_problems(spec.stages, triton_version)
    if too_new:
        raise SpecError(spec.source, too_new)
    models = {name: str(_resolve_model(spec, name, stage)) if resolve_models else stage.model
              for name, stage in spec.stages.items() if stage.model is not None}
    plans = []
    for name, stage in spec.stages.items():
        if stage.model is None:
            engine = _orchestrator_engine(spec, name, stage, models) if resolve_models \
                else dict(stage.engine_args)
        else:
            engine = {"model": models[name], **stage.engine_args}
            if stage.backend in ("omni_llm", "omni_talker") and stage.queue \
                    and stage.queue.max_queue_size:
                engine[MAX_QUEUED_ARG] = stage.queue.max_queue_size
        if spec.video_limits is not None and stage.backend in VIDEO_CHECKING_BACKENDS:
            engine[VIDEO_LIMITS_KEY] = spec.video_limits.model_dump()
        # the stage's own config class is the one validator, for --check as for generation
        _check_stage_config(spec, name, stage.backend, engine)
        plans.append(StagePlan(name, _config_for(spec, name, stage, triton_version), engine))
    return plans


# Orchestrator roles whose models make no sense to call on their own (a talker's
# "text" is codec tokens).
_INTERNAL_ROLES = ("talker",)


def _internal_stages(spec: PipelineSpec) -> set[str]:
    internal = set()
    for stage in spec.stages.values():
        roles = (stage.engine_args.get("stages") or {}) if stage.model is None else {}
        for role in _INTERNAL_ROLES:
            if isinstance(roles.get(role), str):
                internal.add(roles[role])
    return internal


def _config_for(spec: PipelineSpec, name: str, stage: StageSpec,
                triton_version: TritonVersion) -> model_config_pb2.ModelConfig:
    """build_model_config, checked field by field against what `triton_version` parses."""
    config = build_model_config(name, stage)
    if name in _internal_stages(spec):
        # clients (omni_client, omni-openai) do not offer it as a model of its own
        config.parameters[ENTRY_PARAMETER].string_value = "false"
    unknown = fields_too_new(config, triton_version)
    if unknown:  # a generator change that slipped past the gates of the spec keys
        raise SpecError(spec.source, [
            f"stages.{name}: config.pbtxt field {field} needs Triton >= {first.label}; the "
            f"target is {triton_version.label} (pass --triton-version)"
            for field, first in unknown])
    return config


# --- output directory ----------------------------------------------------------

def _read_manifest(out_dir: Path) -> dict | None:
    try:
        manifest = json.loads((out_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("generator") != PROG:
        return None
    return manifest if isinstance(manifest.get("stages"), list) else None


def _entries_to_replace(out_dir: Path, new: set[str], force: bool) -> set[str]:
    """Entries of an existing out_dir that the new output replaces; RepoError if not ours."""
    if not out_dir.exists():
        return set()
    if not out_dir.is_dir():
        raise RepoError(f"{out_dir} exists and is not a directory")
    entries = set(os.listdir(out_dir))
    manifest = _read_manifest(out_dir)
    ours = ({MANIFEST_FILE, *map(str, manifest["stages"])} & entries) if manifest else set()
    foreign = entries - ours
    if foreign and manifest is None and not force:
        raise RepoError(f"{out_dir} is not empty and was not written by {PROG} (no "
                        f"{MANIFEST_FILE}); choose an empty or new directory, or pass --force "
                        "to write into it (entries named like a stage are replaced, others kept)")
    clashes = sorted(foreign & new)
    if clashes and not force:
        raise RepoError(f"{', '.join(str(out_dir / c) for c in clashes)} exists and was not "
                        f"written by {PROG}; pass --force to replace it")
    return (ours | (new & entries) | ({MANIFEST_FILE} & entries))


def _write_tree(root: Path, plans: list[StagePlan], manifest: dict, source: str) -> None:
    triton_version = parse_triton_version(manifest["triton_version"])
    for p in plans:
        stage_dir = root / p.name
        (stage_dir / VERSION_DIR).mkdir(parents=True)
        (stage_dir / CONFIG_FILE).write_text(
            config_text(p.config, source=source, triton_version=triton_version),
            encoding="utf-8")
        (stage_dir / ENGINE_ARGS_FILE).write_text(json.dumps(p.engine, indent=2) + "\n",
                                                  encoding="utf-8")
    (root / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _swap_in(tmp: Path, out_dir: Path, replace: set[str]) -> None:
    """Move tmp's entries into out_dir, replacing `replace`; undo on failure."""
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
    moved_out: list[str] = []
    moved_in: list[str] = []
    # the manifest goes last: until it lands, the old manifest still describes the folder
    new = sorted(os.listdir(tmp), key=lambda n: n == MANIFEST_FILE)
    try:
        for name in sorted(replace):
            os.rename(out_dir / name, trash / name)
            moved_out.append(name)
        for name in new:
            os.rename(tmp / name, out_dir / name)
            moved_in.append(name)
    except OSError:
        for name in moved_in:
            shutil.rmtree(out_dir / name, ignore_errors=True)
        for name in moved_out:
            os.rename(trash / name, out_dir / name)
        raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _package_version() -> str:
    try:
        return metadata.version("omni-triton")
    except metadata.PackageNotFoundError:
        return "unknown"


def generate(spec: PipelineSpec, out_dir: str | os.PathLike[str], *, force: bool = False,
             triton_version: TritonVersion = DEFAULT_TRITON_VERSION) -> list[StagePlan]:
    """Write the model repository of `spec` into `out_dir`; returns what was written.

    A spec whose stages live on several servers gets one repository per
    server, `out_dir/<server>/`. Raises SpecError (spec or model paths
    unusable) or RepoError (out_dir is not empty and not a previous output,
    unless `force`) before writing anything. A previous output of this tool
    is replaced; with `force`, a foreign folder is written into (entries named
    like a stage are replaced, other entries are kept). The configs are
    written for Triton `triton_version` (see omni_tools.triton_versions).
    """
    out_dir = Path(out_dir).absolute()
    plans = plan(spec, triton_version=triton_version)
    servers = spec.server_names
    if len(servers) == 1:
        _write_repository(spec, plans, out_dir, force, triton_version)
        return plans
    for server in servers:  # check every folder before writing any
        _entries_to_replace(out_dir / server,
                            {p.name for p in plans if spec.server_of(p.name) == server}, force)
    for server in servers:
        _write_repository(spec, [p for p in plans if spec.server_of(p.name) == server],
                          out_dir / server, force, triton_version)
    return plans


def _write_repository(spec: PipelineSpec, plans: list[StagePlan], out_dir: Path,
                      force: bool, triton_version: TritonVersion) -> None:
    replace = _entries_to_replace(out_dir, {p.name for p in plans}, force)
    manifest = {"generator": PROG, "generator_version": GENERATOR_VERSION,
                "package_version": _package_version(), "pipeline": spec.pipeline,
                "spec": spec.source, "triton_version": str(triton_version),
                "stages": [p.name for p in plans]}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)
        _write_tree(tmp, plans, manifest, spec.source)
        _swap_in(tmp, out_dir, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- command line --------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Validate a pipeline spec and write the Triton model repository it describes.",
        epilog=f"Presets live in {SPECS_DIR}. Examples: {PROG} --preset text-chat -o repo; "
               f"{PROG} my-pipeline.yaml -o repo; {PROG} --check my-pipeline.yaml")
    parser.add_argument("spec", nargs="?", type=Path, help="pipeline spec (YAML)")
    parser.add_argument("--preset", metavar="NAME", help="use a shipped spec (see --list-presets)")
    parser.add_argument("--model", metavar="DIR", type=Path,
                        help="with --preset omni-chat: an omni checkpoint folder as the hub ships it "
                             "(Qwen2.5-Omni, Qwen3-Omni Instruct, Thinking or Captioner), or "
                             "tiny:<name> for a built-in one (tiny:qwen3-omni-tiny); every "
                             "stage reads its part of it")
    parser.add_argument("-o", "--output", metavar="DIR", type=Path,
                        help="model repository folder to write")
    parser.add_argument("--check", action="store_true", help="validate only; write nothing")
    parser.add_argument("--triton-version", metavar="X.Y", type=_triton_version_arg,
                        default=DEFAULT_TRITON_VERSION,
                        help="the tritonserver release the repository is for: a Triton version "
                             "(2.54) or an NGC container release (25.01); spec keys it does not "
                             f"accept are errors (default: {DEFAULT_TRITON_VERSION.label}, the "
                             "tritonserver this project installs)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="gpu: run the spec's encoders, decoders, DiT and vLLM engines on "
                             "the GPU (device: cuda, KIND_GPU, a share of GPU memory for each "
                             "vLLM engine); cpu (default): as the spec says")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty folder not made by this tool")
    parser.add_argument("--list-presets", action="store_true", help="list the shipped specs")
    parser.add_argument("--print-schema", action="store_true",
                        help="print the JSON schema of a pipeline spec and exit")
    deploy.add_arguments(parser)
    return parser


def _triton_version_arg(text: str) -> TritonVersion:
    try:
        return parse_triton_version(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.list_presets or args.print_schema:
        return None
    if (args.spec is None) == (args.preset is None):
        return "give either a spec file or --preset NAME (exactly one)"
    if args.model is not None and args.preset is None:
        return "--model goes with --preset (a spec file names its models itself)"
    if args.check and args.deploy:
        return "--check writes nothing; drop --deploy"
    if args.check and args.output is not None:
        return "--check writes nothing; drop -o/--output"
    if not args.check and args.output is None:
        return "-o/--output DIR is required (or --check to validate only)"
    return None


def _print_presets() -> None:
    for name in list_presets():
        try:
            data = yaml.safe_load((SPECS_DIR / f"{name}.yaml").read_text(encoding="utf-8"))
            description = data.get("description") or ""
        except (OSError, yaml.YAMLError, AttributeError):
            description = ""
        print(f"{name:20} {description}".rstrip())


def _describe(plans: list[StagePlan]) -> str:
    return "\n".join(f"  {p.name}: backend {p.config.backend}"
                     + (f", model {p.engine['model']}" if "model" in p.engine else "")
                     for p in plans)


def _log_to_stderr() -> None:
    """Show this package's warnings (e.g. engine_args left unchecked), not other libraries'."""
    package_logger = logging.getLogger(__package__)
    if not package_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `omni-gen-repo`; returns the exit status (2 on any error)."""
    _log_to_stderr()
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the error
        return int(e.code or 0)
    problem = _usage_problem(args)
    if problem:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    try:
        if args.list_presets:
            _print_presets()
            return 0
        if args.print_schema:
            print(json.dumps(PipelineSpec.model_json_schema(), indent=2))
            return 0
        if args.model is not None:
            spec = _preset_with_model(args.preset, args.model)
        else:
            # --deploy: the model paths are the containers', not this machine's
            spec = load_preset(args.preset) if args.preset \
                else load_spec(args.spec, check_paths=not args.deploy)
        if args.device == "gpu":
            spec = parse_spec(on_gpu(spec.model_dump(exclude_none=True)), base_dir=spec.base_dir,
                              source=f"{spec.source} --device gpu", check_paths=not args.deploy)
        if args.deploy:  # what the init containers' omni-gen-repo would refuse, refused here
            plan(spec, resolve_models=False, check_paths=False,
                 triton_version=args.triton_version)
            options = deploy.options_from_args(args)
            written = deploy.write(spec, args.deploy, args.output, options, force=args.force)
            print(deploy.describe(spec, args.deploy, written, options))
            return 0
        if args.check:
            plans = plan(spec, resolve_models=False, triton_version=args.triton_version)
            print(f"OK: {spec.source}: pipeline {spec.pipeline} for Triton "
                  f"{args.triton_version.label}\n{_describe(plans)}")
            return 0
        plans = generate(spec, args.output, force=args.force, triton_version=args.triton_version)
        _warn_numpy(args.triton_version)
    except (SpecError, RepoError, deploy.DeployError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.output).absolute()
    servers = spec.server_names
    if len(servers) == 1:
        flags = _flags(spec, plans, servers[0], args.triton_version)
        print(f"wrote {out} (pipeline {spec.pipeline})\n{_describe(plans)}\n"
              f"serve it with: tritonserver --model-repository={out}{flags}")
        return 0
    print(f"wrote {len(servers)} repositories under {out} (pipeline {spec.pipeline})")
    for server in servers:
        mine = [p for p in plans if spec.server_of(p.name) == server]
        flags = _flags(spec, mine, server, args.triton_version)
        print(f"{server}:\n{_describe(mine)}\n"
              f"  serve it with: tritonserver --model-repository={out / server}{flags}")
    return 0


def _preset_with_model(name: str, folder: Path) -> PipelineSpec:
    """The preset, its checkpoint replaced by `folder` (checked first)."""
    source = f"preset {name} --model {folder}"
    load_preset(name)  # an unknown name lists the presets
    tiny = tiny_model_name(str(folder))
    if tiny is not None:  # a built-in tiny checkpoint, e.g. tiny:qwen3-omni-tiny
        try:
            check_tiny_name(tiny)
        except ValueError as e:
            raise SpecError(source, [f"--model: {e}"]) from e
        folder = tiny_models_module().ensure_model(tiny)
    data = yaml.safe_load((SPECS_DIR / f"{name}.yaml").read_text(encoding="utf-8"))
    before = set(data["stages"])
    role_of = {target: role for stage in data["stages"].values()
               if stage["backend"] == "omni_orchestrator"
               for role, target in stage["engine_args"]["stages"].items()
               if isinstance(target, str)}
    data, problems = checkpoint.point_preset_at(data, folder.absolute())
    if problems:
        raise SpecError(source, problems)
    left_out = sorted(before - set(data["stages"]))
    speech = [n for n in left_out if role_of.get(n) in checkpoint.SPEECH_ROLES]
    raw = [n for n in left_out if n not in speech]
    if raw:  # a family whose thinker encodes these media itself
        print(f"{PROG}: note: {', '.join(raw)} left out: the thinker of "
              f"{families.for_checkpoint(str(folder)).title} takes those media itself",
              file=sys.stderr)
    if speech:  # e.g. a thinker-only export: say what is missing, not only what is left out
        missing = checkpoint.problems(folder.absolute(), list(checkpoint.SPEECH_ROLES))
        print(f"{PROG}: note: {', '.join(speech)} left out, the repository serves text"
              + "".join(f"\n  {m}" for m in missing), file=sys.stderr)
    return parse_spec(data, base_dir=SPECS_DIR, source=source)


def tritonserver_flags(spec: PipelineSpec, plans: list[StagePlan], server: str,
                       triton_version: TritonVersion) -> list[str]:
    """tritonserver flags one server's repository needs on `triton_version`: histograms are
    off unless asked for; from 2.68 client shared memory is refused unless allowed."""
    flags = []
    if any(p.config.HasField("model_metrics") for p in plans):
        flags.append("--metrics-config=histogram_latencies=true")
    flags += client_shm_flags(triton_version, server in servers_sent_shared_memory(spec))
    return flags


def _flags(spec: PipelineSpec, plans: list[StagePlan], server: str,
           triton_version: TritonVersion) -> str:
    return "".join(f" {f}" for f in tritonserver_flags(spec, plans, server, triton_version))


def _warn_numpy(triton_version: TritonVersion) -> None:
    """The serving environment is usually this one: say so if its numpy breaks the stub."""
    import numpy

    problem = numpy_problem(triton_version, numpy.__version__)
    if problem:
        logger.warning("%s", problem)


if __name__ == "__main__":
    sys.exit(main())

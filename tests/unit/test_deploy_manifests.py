"""omni-gen-repo --deploy: the manifests validate offline and follow the spec.

Runs in the pytest process: no tritonserver, no cluster, no network. Kubernetes
objects are checked with kubernetes-validate's Python API against the OpenAPI
schemas of two Kubernetes releases its wheel ships, strict (unknown fields are
errors) and with a missing schema an error; KServe's InferenceService (a CRD,
no schema there) against the minimal schema below plus its PodSpec part as a
core/v1 Pod; the compose file against the compose specification's JSON schema
(vendored in deploy_schemas/, see its README).
"""
from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate

from omni_serve import env
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.locality import parse_target
from omni_tools import deploy, gen_repo
from omni_tools import spec as spec_mod

# The oldest and the newest Kubernetes release whose schemas kubernetes-validate 1.37 ships
# and that the objects' API versions (apps/v1, policy/v1, autoscaling/v2) exist in.
K8S_VERSIONS = ("1.30.0", "1.37.0")
SCHEMAS = Path(__file__).parent / "deploy_schemas"
PRESETS = ("text-chat", "text-to-image", "omni-chat")


@pytest.fixture(autouse=True)
def no_vllm_import(monkeypatch):
    """vLLM's engine argument names are not needed here (importing vLLM takes seconds)."""
    monkeypatch.setattr(spec_mod, "vllm_engine_arg_names", lambda: None)


def preset_data(name: str) -> dict:
    return spec_mod.load_preset(name).model_dump(mode="json", exclude_defaults=True)


def three_servers() -> dict:
    """omni-chat over three servers: the thinker on `engine` (2 GPUs), the talker on `voice`
    (1 GPU), the rest on a CPU `front` that calls both."""
    data = preset_data("omni-chat")
    data["pipeline"] = "omni-split"
    data["servers"] = {"front": {}, "engine": {"grpc_url": "gpu-a:8001"},
                       "voice": {"grpc_url": "gpu-b:8001"}}
    place = {"llm": "engine", "talker": "voice"}
    for name, stage in data["stages"].items():
        stage["server"] = place.get(name, "front")
        stage.get("env", {}).pop("VLLM_CPU_OMP_THREADS_BIND", None)
    data["stages"]["llm"]["instances"] = {"kind": "KIND_GPU", "gpus": [0, 1]}
    data["stages"]["talker"]["env"] = {"CUDA_VISIBLE_DEVICES": "0"}
    return data


def parse(data: dict) -> spec_mod.PipelineSpec:
    return spec_mod.parse_spec(data, source="test spec")


SPECS = {**{name: (lambda name=name: preset_data(name)) for name in PRESETS},
         "omni-split": three_servers}


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict, name: str = "tritonserver") -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == name)


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def validate_k8s(doc: dict, version: str) -> None:
    """Strict validation; a schema that is missing raises SchemaNotFoundError (a failure)."""
    used = kubernetes_validate.validate(doc, version, strict=True)
    assert used == version.rsplit(".", 1)[0], f"validated against {used}, not {version}"


# --- Kubernetes: every object, two releases ------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_kubernetes_object_validates_strictly(name, version) -> None:
    docs = deploy.kubernetes_manifests(parse(SPECS[name]()))
    kinds = [d["kind"] for d in docs]
    servers = kinds.count("Deployment")
    assert servers == (3 if name == "omni-split" else 1)
    assert kinds.count("Service") == kinds.count("PodDisruptionBudget") == servers
    assert kinds.count("HorizontalPodAutoscaler") == servers and kinds[0] == "ConfigMap"
    for doc in docs:
        validate_k8s(doc, version)
    text = deploy.render(parse(SPECS[name]()), "k8s")
    assert not any("&id" in t for t in text.values())  # no YAML anchors: objects read alone


def test_the_check_refuses_an_unknown_field_a_wrong_type_and_an_unknown_api() -> None:
    docs = deploy.kubernetes_manifests(parse(preset_data("text-chat")))
    deployment = by_kind(docs, "Deployment")["text-chat"]
    unknown = copy.deepcopy(deployment)
    container(unknown)["startupProbes"] = container(unknown)["startupProbe"]
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for bad in (unknown, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate_k8s(bad, K8S_VERSIONS[0])
    hpa = copy.deepcopy(by_kind(docs, "HorizontalPodAutoscaler")["text-chat"])
    hpa["apiVersion"] = "autoscaling/v9"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate_k8s(hpa, K8S_VERSIONS[0])


def test_a_server_pod_has_probes_shutdown_shm_and_the_generated_repository() -> None:
    options = deploy.DeployOptions(exit_timeout_s=40, prestop_s=7, startup_timeout_s=1200)
    docs = deploy.kubernetes_manifests(parse(preset_data("omni-chat")), options)
    deployment = by_kind(docs, "Deployment")["omni-chat"]
    pod = deployment["spec"]["template"]["spec"]
    server = container(deployment)
    # the init container builds the repository from the mounted spec, for the same Triton
    init = pod["initContainers"][0]
    assert init["command"][:2] == ["omni-gen-repo", "/etc/omni/spec/spec.yaml"]
    assert init["command"][-2:] == ["--triton-version", "2.51"]
    assert "--model-repository=/var/lib/omni/repo" in server["args"]
    assert by_kind(docs, "ConfigMap")["omni-chat-spec"]["data"]["spec.yaml"] is not None
    # shutdown: preStop, then --exit-timeout-secs, inside the grace period
    assert "--exit-timeout-secs=40" in server["args"]
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    assert pod["terminationGracePeriodSeconds"] > 40 + 7
    # probes: ready (startup: 1200 s of vLLM load), live
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == server["readinessProbe"]["httpGet"]["path"] \
        == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    assert server["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    # /dev/shm in memory; the three ports; scraped by Prometheus
    shm = next(m for m in server["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in pod["volumes"] if v["name"] == shm["name"])["emptyDir"][
        "medium"] == "Memory"
    assert {p["name"]: p["containerPort"] for p in server["ports"]} == {
        "http": 8000, "grpc": 8001, "metrics": 8002}
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] \
        == "8002"
    assert by_kind(docs, "Service")["omni-chat"]["spec"]["clusterIP"] == "None"


def test_the_config_map_holds_the_spec_the_init_container_reads_back() -> None:
    spec = parse(three_servers())
    text = deploy.kubernetes_manifests(spec)[0]["data"]["spec.yaml"]
    again = spec_mod.parse_spec(yaml.safe_load(text), source="configmap")
    assert again.model_dump() == spec.model_dump()


def test_each_stage_scales_on_its_own_load_signal_and_the_adapter_exposes_it() -> None:
    docs = deploy.kubernetes_manifests(parse(preset_data("omni-chat")))
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["omni-chat"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "omni-chat"}
    signals = {m["pods"]["metric"]["selector"]["matchLabels"]["model"]:
               (m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"])
               for m in hpa["spec"]["metrics"]}
    assert signals["llm"] == signals["talker"] == ("omni_llm_engine_waiting_requests", "2")
    assert signals["omni"][0] == "omni_requests_in_flight"
    # batched stages: mean Triton queue time, at least 4x the batcher's own delay
    assert signals["text_to_image"] == ("omni_triton_queue_seconds", "50m")  # 5000 us
    assert signals["image_encoder"] == ("omni_triton_queue_seconds", "50m")
    slow = preset_data("text-to-image")
    slow["stages"]["text_to_image"]["max_queue_delay_us"] = 100_000
    (metric,) = by_kind(deploy.kubernetes_manifests(parse(slow)),
                        "HorizontalPodAutoscaler")["text-to-image"]["spec"]["metrics"]
    assert metric["pods"]["target"]["averageValue"] == "400m"
    rules = {r["name"]["as"]: r for r in deploy.prometheus_adapter_rules()}
    assert {name for name, _ in signals.values()} <= set(rules)
    assert "nv_inference_request_success" in rules["omni_triton_queue_seconds"]["metricsQuery"]


# --- KServe ---------------------------------------------------------------------------

def _pod_spec_fields(version: str) -> list[str]:
    root = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    definitions = json.loads((root / f"v{version}-local-strict" / "_definitions.json")
                             .read_text())["$defs"]
    return sorted(definitions["io.k8s.api.core.v1.PodSpec"]["properties"])


def kserve_schema(version: str) -> dict:
    """InferenceService (serving.kserve.io/v1beta1), as far as omni-gen-repo writes one:
    metadata, the annotations it sets, and a predictor of ComponentExtensionSpec's replica
    bounds plus PodSpec's fields (those are checked as a core/v1 Pod, strictly)."""
    strings = {"type": "object", "additionalProperties": {"type": "string"}}
    annotations = {"type": "object", "additionalProperties": {"type": "string"}, "properties": {
        "serving.kserve.io/deploymentMode": {"enum": ["Serverless", "RawDeployment"]},
        "serving.kserve.io/autoscalerClass": {"enum": ["hpa", "keda", "external"]},
        "serving.kserve.io/enable-prometheus-scraping": {"enum": ["true", "false"]},
        "prometheus.kserve.io/port": {"type": "string", "pattern": "^[0-9]+$"},
        "prometheus.kserve.io/path": {"type": "string", "pattern": "^/"}}}
    predictor = {"type": "object", "additionalProperties": False, "required": ["containers"],
                 "properties": {"minReplicas": {"type": "integer", "minimum": 0},
                                "maxReplicas": {"type": "integer", "minimum": 0},
                                **{name: {} for name in _pod_spec_fields(version)}}}
    return {
        "type": "object", "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "serving.kserve.io/v1beta1"},
            "kind": {"const": "InferenceService"},
            "metadata": {"type": "object", "additionalProperties": False, "required": ["name"],
                         "properties": {
                             "name": {"type": "string", "maxLength": 63,
                                      "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"},
                             "namespace": {"type": "string"}, "labels": strings,
                             "annotations": annotations}},
            "spec": {"type": "object", "additionalProperties": False, "required": ["predictor"],
                     "properties": {"predictor": predictor}}}}


@pytest.mark.parametrize("name", PRESETS)
def test_a_one_server_spec_gives_a_valid_inference_service(name) -> None:
    docs = deploy.kserve_manifests(parse(preset_data(name)),
                                   deploy.DeployOptions(namespace="serving", models="ckpt"))
    config_map, isvc = docs
    for version in K8S_VERSIONS:
        validate_k8s(config_map, version)
        jsonschema.Draft202012Validator(kserve_schema(version)).validate(isvc)
        predictor = isvc["spec"]["predictor"]
        pod = {k: v for k, v in predictor.items() if k not in ("minReplicas", "maxReplicas")}
        validate_k8s({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": isvc["metadata"]["name"]}, "spec": pod}, version)
    (main,) = isvc["spec"]["predictor"]["containers"]
    assert main["name"] == "kserve-container" and [p["containerPort"] for p in main["ports"]] \
        == [8000]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "ckpt", "readOnly": True}} \
        in isvc["spec"]["predictor"]["volumes"]


def test_the_kserve_schema_refuses_what_kserve_does_not_know() -> None:
    _, isvc = deploy.kserve_manifests(parse(preset_data("text-chat")))
    isvc["spec"]["predictor"]["scaleTargets"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(kserve_schema(K8S_VERSIONS[0])).validate(isvc)


def test_kserve_refuses_a_spec_of_several_servers() -> None:
    with pytest.raises(deploy.DeployError, match="serves one server.*--deploy k8s"):
        deploy.kserve_manifests(parse(three_servers()))


# --- docker compose -------------------------------------------------------------------

def compose_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((SCHEMAS / "compose-spec.json").read_text()))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_compose_file_validates_against_the_compose_spec(name) -> None:
    files = deploy.render(parse(SPECS[name]()), "compose")
    compose = yaml.safe_load(files["compose.yaml"])
    compose_validator().validate(compose)
    assert "&id" not in files["compose.yaml"]  # no YAML anchors: each service reads alone
    servers = [s for s in compose["services"] if s != "gen-repo"]
    assert len(servers) == (3 if name == "omni-split" else 1)
    for service in servers:
        assert compose["services"][service]["depends_on"] == {
            "gen-repo": {"condition": "service_completed_successfully"}}
    assert yaml.safe_load(files["spec.yaml"])["pipeline"] == compose["name"]


def test_the_compose_check_refuses_an_unknown_key() -> None:
    compose = deploy.compose_file(parse(preset_data("text-chat")))
    compose["services"]["text-chat"]["gpu_count"] = 1
    with pytest.raises(jsonschema.ValidationError):
        compose_validator().validate(compose)


# --- the manifests follow the spec ----------------------------------------------------

def test_moving_a_stage_changes_the_servers_and_the_urls_the_orchestrator_gets() -> None:
    data = three_servers()
    docs = deploy.kubernetes_manifests(parse(data))
    front = container(by_kind(docs, "Deployment")["omni-split-front"])
    url = env.SERVER_URL.named
    assert {k: v for k, v in env_of(front).items() if k.startswith("OMNI_SERVER_")} == {
        url(name="engine"): "dns:///omni-split-engine:8001",
        url(name="voice"): "dns:///omni-split-voice:8001"}
    assert set(by_kind(docs, "Deployment")) == {"omni-split-front", "omni-split-engine",
                                                "omni-split-voice"}
    # a dns:/// name: the orchestrator spreads over every ready pod of the headless Service
    assert parse_target(env_of(front)[url(name="engine")]).dns == ("omni-split-engine", 8001)

    data["stages"]["talker"]["server"] = "engine"  # the talker beside the thinker
    del data["servers"]["voice"]
    docs = deploy.kubernetes_manifests(parse(data))
    assert set(by_kind(docs, "Deployment")) == {"omni-split-front", "omni-split-engine"}
    front = container(by_kind(docs, "Deployment")["omni-split-front"])
    assert [k for k in env_of(front) if k.startswith("OMNI_SERVER_")] == [url(name="engine")]
    engine_hpa = by_kind(docs, "HorizontalPodAutoscaler")["omni-split-engine"]
    assert sorted(m["pods"]["metric"]["selector"]["matchLabels"]["model"]
                  for m in engine_hpa["spec"]["metrics"]) == ["llm", "talker"]
    compose = deploy.compose_file(parse(data))
    assert compose["services"]["omni-split-front"]["environment"][url(name="engine")] \
        == "dns:///omni-split-engine:8001"
    assert "ports" in compose["services"]["omni-split-front"]  # the entry's server publishes
    assert "ports" not in compose["services"]["omni-split-engine"]


def test_the_front_pods_startup_probe_outlasts_its_wait_for_the_remote_stages() -> None:
    # the orchestrator loads (and its server turns ready) only once its remote stages are
    # ready, failing its load after remote_ready_timeout_s: the startup probe must give it
    # that long, or a pod still waiting for a remote vLLM would be killed as dead
    docs = deploy.kubernetes_manifests(parse(three_servers()))
    front = container(by_kind(docs, "Deployment")["omni-split-front"])
    startup, ready = front["startupProbe"], front["readinessProbe"]
    waited = OrchestratorConfig.model_fields["remote_ready_timeout_s"].default
    assert startup["periodSeconds"] * startup["failureThreshold"] > waited
    assert startup["httpGet"]["path"] == ready["httpGet"]["path"] == "/v2/health/ready"


def test_replicas_set_the_deployment_the_hpa_floor_and_kserve() -> None:
    options = deploy.DeployOptions(replicas={"engine": 3}, max_replicas=5)
    docs = deploy.kubernetes_manifests(parse(three_servers()), options)
    assert by_kind(docs, "Deployment")["omni-split-engine"]["spec"]["replicas"] == 3
    assert by_kind(docs, "Deployment")["omni-split-front"]["spec"]["replicas"] == 1
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["omni-split-engine"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 5)
    _, isvc = deploy.kserve_manifests(parse(preset_data("text-chat")),
                                      deploy.DeployOptions(replicas={"default": 2}))
    assert isvc["spec"]["predictor"]["minReplicas"] == 2


def test_compose_runs_replicas_of_a_stage_server_but_one_of_the_entrys() -> None:
    options = deploy.DeployOptions(replicas={"engine": 2})
    compose = yaml.safe_load(deploy.render(parse(three_servers()), "compose", options)[
        "compose.yaml"])
    compose_validator().validate(compose)
    services = compose["services"]
    assert services["omni-split-engine"]["deploy"]["replicas"] == 2
    assert services["omni-split-engine"]["deploy"]["resources"]  # its GPUs kept, per container
    assert "replicas" not in services["omni-split-front"].get("deploy", {})
    assert services["omni-split-front"]["environment"]["OMNI_SERVER_ENGINE_URL"] \
        == "dns:///omni-split-engine:8001"
    with pytest.raises(deploy.DeployError, match="the entry's server publishes ports"):
        deploy.compose_file(parse(three_servers()), deploy.DeployOptions(replicas={"front": 2}))
    with pytest.raises(deploy.DeployError, match="--replicas gpu: no server"):
        deploy.kubernetes_manifests(parse(three_servers()),
                                    deploy.DeployOptions(replicas={"gpu": 2}))


def test_gpu_stages_give_their_server_gpus_a_gpu_node_and_the_gpu_image() -> None:
    data = three_servers()
    docs = deploy.kubernetes_manifests(parse(data))
    deployments = by_kind(docs, "Deployment")
    gpus = {name: container(d).get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)
            for name, d in deployments.items()}
    assert gpus == {"omni-split-front": 0, "omni-split-engine": 2, "omni-split-voice": 1}
    engine = deployments["omni-split-engine"]
    assert engine["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert container(engine)["image"] == "omni-triton:gpu"
    assert container(engine)["command"][0] == "/opt/nvidia/nvidia_entrypoint.sh"
    front = deployments["omni-split-front"]
    assert "nvidia.com/gpu.present" not in front["spec"]["template"]["spec"]["nodeSelector"]
    assert container(front)["image"] == "omni-triton:cpu"

    # a GPU image generator on the front: its server follows; the thinker on 4 GPUs (TP 4)
    data["stages"]["text_to_image"]["engine_args"]["device"] = "cuda"
    data["stages"]["llm"]["instances"] = {"kind": "KIND_MODEL"}
    data["stages"]["llm"]["engine_args"]["tensor_parallel_size"] = 4
    deployments = by_kind(deploy.kubernetes_manifests(parse(data)), "Deployment")
    assert container(deployments["omni-split-front"])["resources"]["limits"] == {
        "nvidia.com/gpu": 1}
    assert container(deployments["omni-split-engine"])["resources"]["limits"] == {
        "nvidia.com/gpu": 4}
    compose = deploy.compose_file(parse(data))
    assert compose["services"]["omni-split-engine"]["deploy"]["resources"]["reservations"][
        "devices"] == [{"driver": "nvidia", "count": 4, "capabilities": ["gpu"]}]


@pytest.mark.parametrize(("stage", "gpus"), [
    ({"backend": "omni_llm", "model": "tiny:qwen2-tiny"}, 0),  # vllm-cpu, as the presets
    ({"backend": "omni_llm", "model": "tiny:qwen2-tiny",
      "instances": {"kind": "KIND_GPU"}}, 1),
    ({"backend": "omni_llm", "model": "tiny:qwen2-tiny",
      "instances": {"kind": "KIND_GPU", "gpus": [1, 3]}}, 4),  # ids number the pod's GPUs
    ({"backend": "omni_llm", "model": "tiny:qwen2-tiny",
      "env": {"CUDA_VISIBLE_DEVICES": "2"}}, 3),
    ({"backend": "omni_llm", "model": "tiny:qwen2-tiny",
      "engine_args": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}, 4),
    ({"backend": "omni_dit", "model": "tiny:qwen-image-tiny",
      "engine_args": {"device": "cuda"}}, 1),
    ({"backend": "omni_dit", "model": "tiny:qwen-image-tiny",
      "instances": {"kind": "KIND_CPU"}}, 0),
])
def test_stage_gpus_reads_the_spec_placement(stage, gpus) -> None:
    spec = parse({"pipeline": "p", "stages": {"s": stage}})
    assert deploy.stage_gpus(spec.stages["s"]) == gpus


# --- the command ----------------------------------------------------------------------

def test_omni_gen_repo_deploy_writes_manifests_for_paths_inside_the_containers(
        tmp_path, capsys) -> None:
    spec_file = tmp_path / "chat.yaml"
    spec_file.write_text(yaml.safe_dump({
        "pipeline": "chat", "stages": {"llm": {
            "backend": "omni_llm", "model": "/models/Qwen2.5-7B-Instruct",  # not on this host
            "instances": {"kind": "KIND_GPU"}}}}))
    out = tmp_path / "out"
    args = [str(spec_file), "-o", str(out), "--models", "qwen-pvc", "--replicas", "default=2"]
    assert gen_repo.main([*args, "--deploy", "k8s"]) == 0
    docs = list(yaml.safe_load_all((out / "kubernetes.yaml").read_text()))
    deployment = by_kind(docs, "Deployment")["chat"]
    assert deployment["spec"]["replicas"] == 2
    assert container(deployment)["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert yaml.safe_load((out / "prometheus-adapter" / "values.yaml").read_text())["rules"][
        "custom"]
    # compose runs the entry's server once (it publishes the host's ports)
    assert gen_repo.main([*args, "--deploy", "compose"]) == 2
    assert "the entry's server publishes ports" in capsys.readouterr().err
    assert gen_repo.main([*args[:-2], "--deploy", "compose"]) == 0
    assert gen_repo.main([*args, "--deploy", "kserve"]) == 0
    assert {p.name for p in out.iterdir()} == {"kubernetes.yaml", "prometheus-adapter",
                                               "compose.yaml", "spec.yaml", "kserve.yaml"}
    assert "kubectl apply -f" in capsys.readouterr().out
    # the spec is still checked, and a file it did not write is kept
    (out / "compose.yaml").write_text("services: {}\n")
    assert gen_repo.main([*args[:-2], "--deploy", "compose"]) == 2
    assert "was not written by omni-gen-repo --deploy" in capsys.readouterr().err
    assert gen_repo.main([*args, "--deploy", "k8s", "--replicas", "engine=2"]) == 2
    assert gen_repo.main([str(spec_file), "--check", "--deploy", "k8s"]) == 2
    # without --deploy the checkpoint folder must exist here, as before
    assert gen_repo.main([str(spec_file), "--check"]) == 2
    assert "/models/Qwen2.5-7B-Instruct does not exist" in capsys.readouterr().err


def test_deploy_keeps_the_triton_version_gates_and_passes_the_version_on(tmp_path) -> None:
    data = preset_data("text-chat")
    data["stages"]["llm"]["metrics"] = {"first_response_histogram_ms": [10, 100]}
    spec_file = tmp_path / "chat.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    assert gen_repo.main([str(spec_file), "--deploy", "k8s", "-o", str(out)]) == 2  # 2.51
    assert not out.exists()
    assert gen_repo.main([str(spec_file), "--deploy", "k8s", "-o", str(out),
                          "--triton-version", "24.11"]) == 0
    deployment = by_kind(list(yaml.safe_load_all((out / "kubernetes.yaml").read_text())),
                         "Deployment")["text-chat"]
    assert "--metrics-config=histogram_latencies=true" in container(deployment)["args"]
    init = deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][-2:] == ["--triton-version", "2.52"]

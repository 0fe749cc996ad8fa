"""The installed tritonserver (2.51) really refuses what `--triton-version` gates.

The gate table of omni_tools.triton_versions rests on two facts checked here
against the real server: its model_config.proto lacks exactly the fields the
table gates (read from the descriptor compiled into libtritonserver), and a
config.pbtxt with such a field fails to load while the same model without it
loads. One bare server in explicit model-control mode: a second or two.

Its own server rather than a session one: a bare server (no vLLM engine) starts in
about as long as loading these models would take anywhere, and its refused loads and
the log lines read for their reason stay apart from the models other tests serve.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import tritonclient.http as httpclient
import yaml
from google.protobuf import descriptor_pb2, text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from omni_tools.gen_repo import CONFIG_FILE, generate
from omni_tools.server import TritonServer
from omni_tools.spec import load_spec
from omni_tools.triton_versions import (
    DEFAULT_TRITON_VERSION,
    PROTO_FIELD_MIN_VERSIONS,
    TritonVersion,
    parse_triton_version,
)

pytestmark = pytest.mark.integration

ECHO_MODEL = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", r.inputs()[0].as_numpy())])
                for r in requests]
'''
ECHO_CONFIG = '''\
backend: "python"
max_batch_size: 0
input { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }
output { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }
instance_group { count: 1 kind: KIND_CPU }
'''
MODEL_METRICS = '''\
model_metrics { metric_control { metric_identifier {
  family: "nv_inference_first_response_histogram_ms" }
  histogram_options { buckets: [ 10, 100, 1000 ] } } }
'''


def libtritonserver() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-pytriton is not installed")
    site = Path(next(iter(spec.submodule_search_locations))).parent
    found = sorted((site / "nvidia_pytriton.libs").glob("libtritonserver*.so*"))
    if not found:
        pytest.skip(f"no libtritonserver under {site / 'nvidia_pytriton.libs'}")
    return found[0]


def served_model_config_proto(lib: Path) -> descriptor_pb2.FileDescriptorProto:
    """model_config.proto as compiled into the server (protoc embeds it serialized)."""
    data = lib.read_bytes()
    start = data.find(b"\n\x12model_config.proto\x12\tinference")
    assert start >= 0, f"no model_config.proto descriptor in {lib}"
    syntax = b"b\x06proto3"  # field 12 (syntax), the last one protoc writes
    end = data.find(syntax, start) + len(syntax)
    proto = descriptor_pb2.FileDescriptorProto()
    proto.ParseFromString(data[start:end])
    assert proto.name == "model_config.proto" and proto.package == "inference"
    return proto


def field_names(proto: descriptor_pb2.FileDescriptorProto) -> set[str]:
    names: set[str] = set()

    def walk(message, prefix):
        for field in message.field:
            names.add(f"{prefix}{message.name}.{field.name}")
        for nested in message.nested_type:
            walk(nested, f"{prefix}{message.name}.")

    for message in proto.message_type:
        walk(message, f"{proto.package}.")
    return names


def test_the_servers_proto_lacks_exactly_the_gated_fields():
    served = field_names(served_model_config_proto(libtritonserver()))
    served_messages = {name.rpartition(".")[0] for name in served}
    client = descriptor_pb2.FileDescriptorProto()
    model_config_pb2.DESCRIPTOR.CopyToProto(client)
    # New fields of messages the server knows (those of new messages hang below them).
    missing = {name for name in field_names(client) - served
               if name.rpartition(".")[0] in served_messages}
    assert missing == set(PROTO_FIELD_MIN_VERSIONS), (
        "tritonclient's model_config.proto and the server's differ in other fields: "
        "gate them in omni_tools.triton_versions")
    assert served <= field_names(client)


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """A tritonserver on a repository of small models, none loaded yet."""
    root = tmp_path_factory.mktemp("gates")
    repo = root / "repo"
    checkpoint = root / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    # The gated option as omni-gen-repo writes it for a new enough target.
    spec_file = root / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"pipeline": "gates", "stages": {"llm": {
        "backend": "omni_llm", "model": str(checkpoint),
        "metrics": {"first_response_histogram_ms": [10.0, 100.0, 1000.0]}}}}))
    generate(load_spec(spec_file), repo, triton_version=TritonVersion(2, 52))
    # The same small Python model with and without the field.
    for name, extra in (("echo", ""), ("echo_with_model_metrics", MODEL_METRICS)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(ECHO_MODEL)
        (repo / name / CONFIG_FILE).write_text(ECHO_CONFIG + extra)
    server = TritonServer(repo, log_path=root / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", "--exit-timeout-secs=5"])
    server.start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


def test_the_installed_tritonserver_is_the_default_target(bare_server):
    with httpclient.InferenceServerClient(bare_server.http_url) as client:
        version = client.get_server_metadata()["version"]
    assert parse_triton_version(version) == DEFAULT_TRITON_VERSION


def load_error(server: TritonServer, model: str) -> str:
    with httpclient.InferenceServerClient(server.http_url) as client:
        try:
            client.load_model(model)
        except InferenceServerException as e:
            return str(e)
        assert client.is_model_ready(model)
    return ""


def test_2_51_loads_the_model_without_model_metrics(bare_server):
    assert load_error(bare_server, "echo") == ""


@pytest.mark.parametrize("model", ["echo_with_model_metrics", "llm"])
def test_2_51_refuses_a_config_with_model_metrics(bare_server, model):
    config = (bare_server.repository / model / CONFIG_FILE).read_text()
    assert "model_metrics" in config
    text_format.Parse(config, model_config_pb2.ModelConfig())  # valid for tritonclient's proto
    assert f"failed to load '{model}'" in load_error(bare_server, model)
    # Triton's own protobuf parser says why, on the line before its "Poll failed" line.
    lines = bare_server.log_path.read_text(errors="replace").splitlines()
    failed = [i for i, line in enumerate(lines)
              if f"Poll failed for model directory '{model}'" in line]
    assert failed, bare_server.log_tail()
    assert 'has no field named "model_metrics"' in lines[failed[-1] - 1], lines[failed[-1] - 1]

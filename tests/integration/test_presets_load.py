"""Every preset's generated repository loads in a real tritonserver as generated.

Parametrized over `omni_tools.spec.list_presets()`, so a new spec in
model_repository/specs/ is covered without touching this file. A preset
with a session server in conftest.py uses it (no second server start); any
other preset gets its own server here. For each model of the repository the
server must report READY and a config whose key fields (backend,
max_batch_size, decoupled, instance groups, dynamic batching) are those of
the generated config.pbtxt: Triton fills in defaults, but must not have
dropped or changed what the spec asked for.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from omni_tools.gen_repo import CONFIG_FILE, MANIFEST_FILE
from omni_tools.spec import list_presets

from .servers import gen_repo, serving

pytestmark = pytest.mark.integration

# Presets whose session server conftest.py already starts.
SERVER_FIXTURES = {
    "text-chat": "text_chat_server",
    "text-to-image": "text_to_image_server",
    "omni-chat": "omni_chat_server",
}
ModelConfig = model_config_pb2.ModelConfig
Kind = model_config_pb2.ModelInstanceGroup.Kind


@pytest.fixture
def preset_server(request, tmp_path):
    """The running server of `request.param`'s repository: the session one, or our own."""
    preset = request.param
    if preset in SERVER_FIXTURES:
        yield request.getfixturevalue(SERVER_FIXTURES[preset])
        return
    with serving(gen_repo(["--preset", preset], tmp_path / "repo"), tmp_path) as server:
        yield server


def generated_configs(repo: Path) -> dict[str, ModelConfig]:
    """The models of a generated repository (its manifest) and their config.pbtxt."""
    manifest = json.loads((repo / MANIFEST_FILE).read_text())
    names = sorted(p.parent.name for p in repo.glob(f"*/{CONFIG_FILE}"))
    assert sorted(manifest["stages"]) == names
    return {name: text_format.Parse((repo / name / CONFIG_FILE).read_text(), ModelConfig())
            for name in names}


def key_fields(config: ModelConfig) -> dict:
    """What the spec decided, in a form the server's (default-filled) config can match."""
    fields = {
        "backend": config.backend,
        "max_batch_size": config.max_batch_size,
        "decoupled": config.model_transaction_policy.decoupled,
        "instance_groups": [(g.count, Kind.Name(g.kind)) for g in config.instance_group],
        "dynamic_batching": config.HasField("dynamic_batching"),
    }
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        fields["max_queue_delay_us"] = batching.max_queue_delay_microseconds
        fields["preserve_ordering"] = batching.preserve_ordering
        if batching.HasField("default_queue_policy"):
            fields["queue_policy"] = json_format.MessageToDict(
                batching.default_queue_policy, preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True)
    return fields


def served_config(client: httpclient.InferenceServerClient, name: str) -> ModelConfig:
    reported = client.get_model_config(name)
    return json_format.ParseDict(reported, ModelConfig(), ignore_unknown_fields=True)


@pytest.mark.parametrize("preset_server", list_presets(), indirect=True)
def test_every_model_of_the_preset_is_ready_with_the_generated_config(preset_server):
    generated = generated_configs(preset_server.repository)
    assert generated, f"no models in {preset_server.repository}"
    with httpclient.InferenceServerClient(preset_server.http_url) as client:
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert sorted(index) == sorted(generated)
        for name, config in generated.items():
            assert index[name].get("state") == "READY", (name, index[name],
                                                          preset_server.log_tail())
            assert client.is_model_ready(name), name
            served = served_config(client, name)
            assert served.name == name
            want = key_fields(config)
            if any(kind == "KIND_AUTO" for _, kind in want["instance_groups"]):
                # Triton resolves KIND_AUTO to the device it found; compare counts only.
                want["instance_groups"] = [c for c, _ in want["instance_groups"]]
                got = key_fields(served)
                got["instance_groups"] = [c for c, _ in got["instance_groups"]]
            else:
                got = key_fields(served)
            assert got == want, name

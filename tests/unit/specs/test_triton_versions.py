"""`omni-gen-repo --triton-version`: version parsing and the spec keys gated on the release."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from omni_tools import gen_repo
from omni_tools.gen_repo import CONFIG_FILE, MANIFEST_FILE, build_model_config, generate, main, plan
from omni_tools.spec import SpecError, load_preset, load_spec
from omni_tools.triton_versions import (
    DEFAULT_TRITON_VERSION,
    FIRST_RESPONSE_FAMILY,
    GATES,
    NGC_RELEASES,
    PROTO_FIELD_MIN_VERSIONS,
    TritonVersion,
    fields_too_new,
    parse_triton_version,
)

BUCKETS = [5.0, 25.0, 100.0, 500.0, 2000.0]


def write_spec(folder: Path, stage: dict, name: str = "stage") -> Path:
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump({"pipeline": "gates", "stages": {name: stage}},
                                   sort_keys=False))
    return path


def llm_stage(**extra) -> dict:
    return {"backend": "omni_llm", "model": "tiny:qwen2-tiny",
            "engine_args": {"max_model_len": 256}, **extra}


def dit_stage(folder: Path, **extra) -> dict:
    checkpoint = folder / "dit"
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "model_index.json").write_text("{}")
    return {"backend": "omni_dit", "model": str(checkpoint), "max_batch_size": 4, **extra}


def histogram(buckets=BUCKETS) -> dict:
    return {"metrics": {"first_response_histogram_ms": list(buckets)}}


def written_config(repo: Path, stage: str) -> tuple[str, model_config_pb2.ModelConfig]:
    text = (repo / stage / CONFIG_FILE).read_text()
    return text, text_format.Parse(text, model_config_pb2.ModelConfig())


def assert_histogram(config: model_config_pb2.ModelConfig) -> None:
    (control,) = config.model_metrics.metric_control
    assert control.metric_identifier.family == FIRST_RESPONSE_FAMILY
    assert list(control.histogram_options.buckets) == BUCKETS


# --- --triton-version ------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("2.51", (2, 51)), ("2.51.0", (2, 51)), ("2.54", (2, 54)), (" 2.60.1 ", (2, 60)),
    ("24.10", (2, 51)), ("24.11", (2, 52)), ("25.01", (2, 54)),
    ("25.06", (2, 59)), ("25.07", (2, 59)), ("25.08", (2, 60)), ("26.01", (2, 65)),
])
def test_triton_and_ngc_versions_are_understood(text, expected):
    assert parse_triton_version(text) == TritonVersion(*expected)


@pytest.mark.parametrize(("text", "fragment"), [
    ("latest", "is not a version"),
    ("3.0", "neither a Triton 2.x version"),
    ("2.50", "older than this project supports; the oldest is 2.51 (NGC 24.10)"),
    ("24.09", "unknown NGC release 24.09"),
    ("99.01", "unknown NGC release 99.01"),
    ("24.10.1", "neither a Triton 2.x version"),
])
def test_bad_versions_say_what_is_accepted(text, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_triton_version(text)


def test_the_ngc_table_is_one_minor_a_month_except_the_2_59_1_patch_release():
    versions = list(NGC_RELEASES.values())
    steps = [b.minor - a.minor for a, b in zip(versions, versions[1:], strict=False)]
    assert steps.count(0) == 1 and NGC_RELEASES["25.07"] == NGC_RELEASES["25.06"]
    assert set(steps) == {0, 1}


def test_the_default_target_is_the_installed_2_51():
    assert DEFAULT_TRITON_VERSION == parse_triton_version("24.10") == (2, 51)
    assert DEFAULT_TRITON_VERSION.label == "2.51 (NGC 24.10)"


def test_the_written_repository_records_its_target(tmp_path):
    generate(load_preset("text-chat"), tmp_path / "repo", triton_version=TritonVersion(2, 54))
    manifest = json.loads((tmp_path / "repo" / MANIFEST_FILE).read_text())
    assert manifest["triton_version"] == "2.54"
    text, _ = written_config(tmp_path / "repo", "llm")
    assert text.splitlines()[0].endswith("for Triton 2.54 (NGC 25.01); edit the spec and "
                                         "regenerate.")


@pytest.mark.parametrize("version", [DEFAULT_TRITON_VERSION, TritonVersion(2, 72)])
def test_a_preset_plans_the_same_configs_for_old_and_new_targets(version):
    (llm,) = plan(load_preset("text-chat"), resolve_models=False, triton_version=version)
    assert llm.config == build_model_config("llm", load_preset("text-chat").stages["llm"])


# --- gated option 1: the first-response histogram of a decoupled stage (>= 2.52) ---

def test_histogram_buckets_of_a_decoupled_stage_are_written_for_2_52(tmp_path):
    spec = load_spec(write_spec(tmp_path, llm_stage(**histogram()), name="llm"))
    generate(spec, tmp_path / "repo", triton_version=parse_triton_version("24.11"))
    text, parsed = written_config(tmp_path / "repo", "llm")
    assert "model_metrics" in text and FIRST_RESPONSE_FAMILY in text
    assert_histogram(parsed)
    assert parsed == build_model_config("llm", spec.stages["llm"])


def test_histogram_buckets_of_a_decoupled_stage_are_refused_for_2_51(tmp_path):
    spec = load_spec(write_spec(tmp_path, llm_stage(**histogram()), name="llm"))
    with pytest.raises(SpecError) as err:
        generate(spec, tmp_path / "repo", triton_version=DEFAULT_TRITON_VERSION)
    (problem,) = err.value.problems
    assert problem.startswith("stages.llm.metrics.first_response_histogram_ms: needs Triton "
                              ">= 2.52 (NGC 24.11) (omni_llm stage); the target is 2.51 "
                              "(NGC 24.10)")
    assert "model_metrics is unknown to older releases" in problem
    assert not (tmp_path / "repo").exists()


def test_without_the_key_no_model_metrics_is_written(tmp_path):
    generate(load_preset("text-chat"), tmp_path / "repo", triton_version=TritonVersion(2, 72))
    _, parsed = written_config(tmp_path / "repo", "llm")
    assert not parsed.HasField("model_metrics")


# --- gated option 2: the same histogram on a non-decoupled stage (>= 2.65) ---------

def test_histogram_buckets_of_a_batched_stage_are_written_for_2_65(tmp_path):
    spec = load_spec(write_spec(tmp_path, dit_stage(tmp_path, **histogram()), name="t2i"))
    generate(spec, tmp_path / "repo", triton_version=parse_triton_version("26.01"))
    text, parsed = written_config(tmp_path / "repo", "t2i")
    assert "model_metrics" in text
    assert_histogram(parsed)
    assert parsed == build_model_config("t2i", spec.stages["t2i"])


@pytest.mark.parametrize("version", ["2.51", "2.52", "2.64"])
def test_histogram_buckets_of_a_batched_stage_are_refused_before_2_65(tmp_path, version):
    spec = load_spec(write_spec(tmp_path, dit_stage(tmp_path, **histogram()), name="t2i"))
    with pytest.raises(SpecError) as err:
        generate(spec, tmp_path / "repo", triton_version=parse_triton_version(version))
    (problem,) = err.value.problems
    assert problem.startswith("stages.t2i.metrics.first_response_histogram_ms: needs Triton "
                              ">= 2.65 (NGC 26.01) (omni_dit stage)")
    assert "decoupled models only" in problem
    assert not (tmp_path / "repo").exists()


# --- the command line -------------------------------------------------------------

def test_cli_check_names_stage_key_and_minimum_version(tmp_path, capsys):
    path = write_spec(tmp_path, llm_stage(**histogram()), name="llm")
    assert main(["--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "stages.llm.metrics.first_response_histogram_ms: needs Triton >= 2.52" in err
    assert main(["--check", str(path), "--triton-version", "24.11"]) == 0
    assert "for Triton 2.52 (NGC 24.11)" in capsys.readouterr().out


def test_cli_writes_the_gated_option_for_a_new_enough_target(tmp_path, capsys):
    path = write_spec(tmp_path, llm_stage(**histogram()), name="llm")
    assert main([str(path), "-o", str(tmp_path / "repo"), "--triton-version", "2.60"]) == 0
    assert_histogram(written_config(tmp_path / "repo", "llm")[1])
    # Triton keeps latency histograms off unless told: the hint says how.
    assert "--metrics-config=histogram_latencies=true" in capsys.readouterr().out


def test_cli_rejects_a_bad_triton_version(tmp_path, capsys):
    assert main(["--preset", "text-chat", "--check", "--triton-version", "2.40"]) == 2
    assert ("argument --triton-version: Triton 2.40 is older than this project supports"
            in capsys.readouterr().err)


# --- the spec key itself ----------------------------------------------------------

@pytest.mark.parametrize(("buckets", "fragment"), [
    ([], "give at least one bucket bound"),
    ([10, 5], "must increase strictly"),
    ([1, 1], "must increase strictly"),
    ([-1, 5], "finite and >= 0"),
])
def test_bad_buckets_are_refused(tmp_path, buckets, fragment):
    with pytest.raises(SpecError, match=fragment):
        load_spec(write_spec(tmp_path, llm_stage(**histogram(buckets))))


def test_an_unknown_metrics_key_is_refused(tmp_path):
    with pytest.raises(SpecError, match="stages.stage.metrics.buckets: unknown key; allowed keys "
                                        "here: first_response_histogram_ms"):
        load_spec(write_spec(tmp_path, llm_stage(metrics={"buckets": [1]})))


# --- the backstop: fields of the built config -------------------------------------

def test_every_gated_proto_field_exists_in_tritonclients_proto():
    for full_name in PROTO_FIELD_MIN_VERSIONS:
        package, message, field = full_name.split(".")
        assert package == "inference"
        assert field in getattr(model_config_pb2, message).DESCRIPTOR.fields_by_name


def test_a_too_new_field_from_the_generator_is_caught(tmp_path, monkeypatch):
    def sneaky(name, stage):  # a generator that forgot to gate a field
        config = model_config_pb2.ModelConfig(name=name, backend="omni_llm")
        config.ensemble_scheduling.max_inflight_requests = 4
        return config

    monkeypatch.setattr(gen_repo, "build_model_config", sneaky)
    with pytest.raises(SpecError, match=r"stages.llm: config.pbtxt field "
                                        r"inference.ModelEnsembling.max_inflight_requests needs "
                                        r"Triton >= 2.63 \(NGC 25.11\)"):
        plan(load_preset("text-chat"), resolve_models=False)
    assert plan(load_preset("text-chat"), resolve_models=False,
                triton_version=TritonVersion(2, 63))


def test_fields_too_new_looks_inside_nested_messages():
    config = model_config_pb2.ModelConfig()
    config.model_metrics.metric_control.add().histogram_options.buckets.append(1.0)
    assert fields_too_new(config, TritonVersion(2, 51)) == [
        ("inference.ModelConfig.model_metrics", TritonVersion(2, 52))]
    assert fields_too_new(config, TritonVersion(2, 52)) == []


def test_every_gate_names_its_source():
    assert all(gate.source and gate.why for gate in GATES)

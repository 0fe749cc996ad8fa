"""Specs with encoder, audio and orchestrator stages: roles, models, env, generated files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import omni_tools.tiny_models as REAL_TINY_MODELS  # the real one: the fixtures replace it
from omni_serve.contract import ENGINE_ARGS_FILE, ENTRY_PARAMETER, ENV_PARAMETER_PREFIX
from omni_tools import gen_repo
from omni_tools.spec import SpecError, load_preset, parse_spec
from tests.unit.specs.test_spec import problems_of as problems

from .conftest import REAL_ENGINE_ARG_NAMES


def checkpoint(root: Path, name: str, marker: str = "config.json", **files: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / marker).write_text("{}")
    for file, text in files.items():
        (path / file).write_text(text)
    return path


@pytest.fixture
def models(tmp_path) -> dict[str, str]:
    return {
        "thinker": str(checkpoint(tmp_path, "thinker")),
        "lm": str(checkpoint(tmp_path, "lm")),
        "talker": str(checkpoint(tmp_path, "talker")),
        "t2w": str(checkpoint(tmp_path, "t2w")),
    }


# The tiny default's Token2Wav parts that set the chunk context: the DiT's blocks and
# layers, BigVGAN's field (families/qwen2_5_omni/token2wav_context.py: 21, 32, 12).
TINY_DIT = {"repeats": 2, "block_size": 24, "num_hidden_layers": 2, "look_backward_layers": [0],
            "look_ahead_layers": [1]}
TINY_BIGVGAN = {"upsample_rates": [5, 3, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
                "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]]}


def omni_spec(models: dict[str, str], **roles) -> dict:
    return {
        "pipeline": "omni-test",
        "stages": {
            "llm": {"backend": "omni_llm", "model": models["lm"],
                    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
            "talker": {"backend": "omni_talker", "model": models["talker"]},
            "aenc": {"backend": "omni_encoder", "model": models["thinker"],
                     "engine_args": {"modality": "audio"}},
            "dec": {"backend": "omni_audio", "model": models["t2w"]},
            "omni": {"backend": "omni_orchestrator", "engine_args": {"stages": {
                "thinker": "llm", "talker": "talker", "audio_encoder": "aenc",
                "audio_decoder": "dec", **roles}}},
        },
        "entry": "omni",
    }


def test_the_omni_chat_preset_loads_with_an_orchestrator_entry(monkeypatch):
    import sys

    from omni_tools import spec as spec_mod

    monkeypatch.setitem(sys.modules, "omni_tools.tiny_models", REAL_TINY_MODELS)
    monkeypatch.setattr(spec_mod, "vllm_engine_arg_names", REAL_ENGINE_ARG_NAMES)
    spec = load_preset("omni-chat")
    assert spec.entry == "omni"
    assert spec.stages["omni"].backend == "omni_orchestrator" and spec.stages["omni"].model is None
    assert {s.backend for s in spec.stages.values()} == {
        "omni_llm", "omni_talker", "omni_encoder", "omni_audio", "omni_dit", "omni_orchestrator"}


def test_the_orchestrator_gets_the_decoders_chunk_context_and_no_model(tmp_path, models):
    (Path(models["t2w"]) / "config.json").write_text(json.dumps(  # a stand-alone Token2Wav's
        {"model_type": "qwen2_5_omni_token2wav", "dit_config": TINY_DIT, "bigvgan_config": TINY_BIGVGAN}))
    spec = parse_spec(omni_spec(models), base_dir=tmp_path)
    generated = tmp_path / "repo"
    gen_repo.generate(spec, generated)
    engine = json.loads((generated / "omni" / ENGINE_ARGS_FILE).read_text())
    assert "model" not in engine and "codec" not in engine
    assert (engine["left_context_codes"], engine["right_context_codes"],
            engine["align_codes"]) == (21, 32, 12)
    assert engine["stages"]["thinker"] == "llm"


def test_a_context_set_in_the_spec_wins_over_the_checkpoints(tmp_path, models):
    (Path(models["t2w"]) / "config.json").write_text(json.dumps(
        {"model_type": "qwen2_5_omni",
         "token2wav_config": {"dit_config": TINY_DIT, "bigvgan_config": TINY_BIGVGAN}}))
    data = omni_spec(models)
    data["stages"]["omni"]["engine_args"]["left_context_codes"] = 0
    gen_repo.generate(parse_spec(data, base_dir=tmp_path), tmp_path / "repo")
    engine = json.loads((tmp_path / "repo" / "omni" / ENGINE_ARGS_FILE).read_text())
    assert (engine["left_context_codes"], engine["right_context_codes"],
            engine["align_codes"]) == (0, 32, 12)


def test_a_decoder_checkpoint_without_a_dit_config_leaves_the_context_defaults(tmp_path, models):
    engine = _engine(tmp_path, models)  # t2w's config.json is {}
    assert not {"left_context_codes", "right_context_codes", "align_codes"} & set(engine)


def test_stage_env_becomes_config_parameters(tmp_path, models):
    generated = tmp_path / "r"
    gen_repo.generate(parse_spec(omni_spec(models), base_dir=tmp_path), generated)
    config = text_format.Parse((generated / "llm" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert config.parameters[f"{ENV_PARAMETER_PREFIX}VLLM_CPU_OMP_THREADS_BIND"].string_value == "0"
    talker = text_format.Parse((generated / "talker" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    # no env for the talker; it is marked as a stage clients do not offer on its own
    assert dict(talker.parameters) == {ENTRY_PARAMETER: talker.parameters[ENTRY_PARAMETER]}
    assert talker.parameters[ENTRY_PARAMETER].string_value == "false"
    assert ENTRY_PARAMETER not in config.parameters


def test_ragged_audio_inputs_allow_ragged_batches(tmp_path, models):
    generated = tmp_path / "r"
    gen_repo.generate(parse_spec(omni_spec(models), base_dir=tmp_path), generated)
    config = text_format.Parse((generated / "dec" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    ragged = {i.name for i in config.input if i.allow_ragged_batch}
    assert ragged == {"codec_ids"}
    assert config.max_batch_size == 8 and config.HasField("dynamic_batching")


@pytest.mark.parametrize("change,expected", [
    (lambda d: d["stages"]["omni"]["engine_args"]["stages"].update(thinker="nope"),
     "stages.omni.engine_args.stages.thinker: no stage named 'nope'; stages: llm, talker, aenc, "
     "dec, omni"),
    (lambda d: d["stages"]["omni"]["engine_args"]["stages"].update(thinker="dec"),
     "stages.omni.engine_args.stages.thinker: stage 'dec' has backend omni_audio; the thinker "
     "role needs omni_llm"),
    (lambda d: d["stages"]["omni"]["engine_args"]["stages"].update(painter="llm"),
     "stages.omni.engine_args.stages.painter: unknown role; roles: thinker, talker, "
     "image_encoder, audio_encoder, audio_decoder, image_generator"),
    (lambda d: d["stages"]["omni"]["engine_args"]["stages"].pop("thinker"),
     "stages.omni.engine_args.stages.thinker: required key is missing"),
    (lambda d: d["stages"]["omni"].update(model="/somewhere"),
     "stages.omni.model: not used by backend omni_orchestrator (it only calls the other stages); "
     "remove the key"),
    (lambda d: d["stages"]["dec"].pop("model"),
     "stages.dec.model: required: a checkpoint directory or tiny:<name>"),
    (lambda d: d["stages"]["llm"]["env"].update({"lower": "1"}),
     "stages.llm.env.lower: not an environment variable name ([A-Z_][A-Z0-9_]*)"),
    (lambda d: d["stages"]["aenc"]["engine_args"].update(modalty="audio"),
     "stages.aenc.engine_args.modalty: unknown omni_encoder argument; did you mean modality?"),
])
def test_bad_omni_specs_name_the_key(tmp_path, models, change, expected):
    data = omni_spec(models)
    change(data)
    assert problems(tmp_path, data) == [expected]


@pytest.mark.parametrize("key,value,says", [
    ("transport", "bls", "removed: the stages are always called over Triton gRPC"),
    ("mode", "sequential", "removed: the orchestrator always pipelines"),
])
def test_a_removed_orchestrator_setting_says_what_to_do_instead(tmp_path, models, key, value,
                                                                 says):
    data = omni_spec(models)
    data["stages"]["omni"]["engine_args"][key] = value
    (problem,) = problems(tmp_path, data)
    assert problem.startswith(f"stages.omni.engine_args.{key}: {says}")
    assert problem.endswith("Delete the key")


@pytest.mark.parametrize("stage,key,value,new", [
    ("omni", "speakers", ["Chelsie", "Ethan"], "voices"),
    ("dec", "default_speaker", "Chelsie", "default_voice"),
])
def test_an_old_name_of_a_setting_names_the_new_one(tmp_path, models, stage, key, value, new):
    """docs/glossary.md: one name per concept; a spec that still says the old one is told."""
    data = omni_spec(models)
    data["stages"][stage].setdefault("engine_args", {})[key] = value
    (problem,) = problems(tmp_path, data)
    assert problem == (f"stages.{stage}.engine_args.{key}: renamed to {new} (docs/glossary.md: "
                       "one name per concept)")


def test_omni_gen_repo_check_reports_an_old_name(tmp_path, models, capsys):
    data = omni_spec(models)
    data["stages"]["omni"]["engine_args"]["speakers"] = ["Chelsie"]
    data["stages"]["dec"]["engine_args"] = {"default_speaker": "Chelsie"}
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert gen_repo.main(["--check", str(spec_path)]) == 2
    err = capsys.readouterr().err
    assert "stages.omni.engine_args.speakers: renamed to voices" in err
    assert "stages.dec.engine_args.default_speaker: renamed to default_voice" in err


def test_engine_arg_values_are_checked_by_the_stage_config_before_writing(tmp_path, models):
    data = omni_spec(models)
    data["stages"]["omni"]["engine_args"]["parallel_chunks"] = 0
    with pytest.raises(SpecError) as err:
        gen_repo.generate(parse_spec(data, base_dir=tmp_path), tmp_path / "repo")
    assert err.value.problems[0].startswith("stages.omni.engine_args.parallel_chunks: Input "
                                            "should be greater than or equal to 1")
    assert not (tmp_path / "repo").exists()


# --- video limits ---------------------------------------------------------------------------

def test_the_specs_video_limits_reach_every_stage_that_checks_a_clip(tmp_path, models):
    """Set once at the top level: the orchestrator's engine.json (its probe of a clip's
    header) and the thinker's (its decode) carry them; the other stages check no clip."""
    from omni_serve import families
    from omni_serve.encoder.config import VideoLimits
    from omni_serve.encoder.video import probe_video
    from omni_serve.errors import RequestError
    from omni_serve.orchestrator.config import OrchestratorConfig
    from tests.video_clip import clip

    data = omni_spec(models)
    data["video_limits"] = {"max_video_seconds": 2, "max_video_frames": 600}
    gen_repo.generate(parse_spec(data, base_dir=tmp_path), tmp_path / "r")
    engines = {name: json.loads((tmp_path / "r" / name / ENGINE_ARGS_FILE).read_text())
               for name in data["stages"]}
    want = VideoLimits(max_video_seconds=2, max_video_frames=600)
    assert engines["llm"]["video_limits"] == engines["omni"]["video_limits"] == want.model_dump()
    assert not any("video_limits" in engines[name] for name in ("talker", "aenc", "dec"))
    assert VideoLimits.from_engine_args(engines["llm"]["video_limits"]) == want
    cfg = OrchestratorConfig.model_validate(engines["omni"])
    assert cfg.video_limits == want
    with pytest.raises(RequestError) as err:  # 2.5 s: under the default 120 s, over 2 s
        probe_video(clip(fps=10, frames=25), cfg.clip_limits, families.get(cfg.family).video)
    assert err.value.field == "video"
    assert "2.50 s long; at most 2 s are accepted (max_video_seconds)" in err.value.message


def test_without_video_limits_no_stage_gets_any(tmp_path, models):
    gen_repo.generate(parse_spec(omni_spec(models), base_dir=tmp_path), tmp_path / "r")
    for name in ("llm", "omni"):
        assert "video_limits" not in json.loads((tmp_path / "r" / name / ENGINE_ARGS_FILE).read_text())


@pytest.mark.parametrize("change,expected", [
    (lambda d: d.update(video_limits={"max_video_seconds": 0}),
     "video_limits.max_video_seconds: Input should be greater than 0 (got 0)"),
    (lambda d: d.update(video_limits={"max_video_frames": 1}),
     "video_limits.max_video_frames: Input should be greater than or equal to 2 (got 1)"),
    (lambda d: d.update(video_limits={"max_video_secs": 5}),
     "video_limits.max_video_secs: unknown key; allowed keys here: max_video_bytes, "
     "max_video_seconds, max_video_frames, max_video_pixels"),
    (lambda d: d["stages"]["omni"]["engine_args"].update(video_limits={"max_video_seconds": 5}),
     "stages.omni.engine_args.video_limits: not a stage setting: set the video limits once, in "
     "the spec's top-level `video_limits` (omni-gen-repo writes them to every stage that checks "
     "a clip)"),
])
def test_bad_video_limits_name_the_key(tmp_path, models, change, expected):
    data = omni_spec(models)
    change(data)
    assert problems(tmp_path, data) == [expected]


def test_an_encoder_stage_refuses_video_limits_it_would_not_apply(tmp_path, models):
    data = omni_spec(models)
    data["stages"]["aenc"]["engine_args"]["max_video_seconds"] = 10
    with pytest.raises(SpecError) as err:
        gen_repo.plan(parse_spec(data, base_dir=tmp_path), resolve_models=False)
    assert err.value.problems == [
        "stages.aenc.engine_args: max_video_seconds: an encoder stage decodes no video (the "
        "thinker does); set the video limits once, in the spec's top-level video_limits"]


# --- batching, queue policy, parallelism, schema -----------------------------------------

def test_queue_policy_and_ordering_reach_the_dynamic_batcher(tmp_path, models):
    data = omni_spec(models)
    data["stages"]["dec"].update(preserve_ordering=True, queue={
        "max_queue_size": 64, "default_timeout_us": 500000, "timeout_action": "DELAY",
        "allow_timeout_override": True})
    generated = tmp_path / "r"
    gen_repo.generate(parse_spec(data, base_dir=tmp_path), generated)
    config = text_format.Parse((generated / "dec" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    batching = config.dynamic_batching
    assert batching.preserve_ordering
    policy = batching.default_queue_policy
    assert (policy.max_queue_size, policy.default_timeout_microseconds) == (64, 500000)
    assert policy.timeout_action == model_config_pb2.ModelQueuePolicy.DELAY
    assert policy.allow_timeout_override


def test_an_llm_queue_bound_reaches_the_stage(tmp_path, models):
    data = omni_spec(models)
    data["stages"]["llm"]["queue"] = {"max_queue_size": 3}
    gen_repo.generate(parse_spec(data, base_dir=tmp_path), tmp_path / "r")
    engine = json.loads((tmp_path / "r" / "llm" / "engine.json").read_text())
    assert engine["max_queued_requests"] == 3
    config = (tmp_path / "r" / "llm" / "config.pbtxt").read_text()
    assert "dynamic_batching" not in config


@pytest.mark.parametrize("stage,extra,expected", [
    ("llm", {"queue": {"max_queue_size": 4, "default_timeout_us": 10}},
     "stages.llm.queue: backend omni_llm takes only max_queue_size (requests waiting beyond the "
     "engine's max_num_seqs running ones; 0: unbounded): its engine queues, not Triton's dynamic "
     "batcher; remove default_timeout_us"),
    ("omni", {"queue": {"max_queue_size": 4}},
     "stages.omni.queue: not used by backend omni_orchestrator: it queues nothing itself (its "
     "stages do); remove the key"),
    ("llm", {"preserve_ordering": True},
     "stages.llm.preserve_ordering: not used by backend omni_llm: Triton's dynamic batcher is off "
     "for it; remove the key"),
    ("dec", {"queue": {"timeout_action": "DROP"}},
     "stages.dec.queue.timeout_action: Input should be 'REJECT' or 'DELAY' (got 'DROP')"),
    ("dec", {"queue": {"max_queue_size": -1}},
     "stages.dec.queue.max_queue_size: Input should be greater than or equal to 0 (got -1)"),
    ("llm", {"instances": {"kind": "KIND_GPU", "gpus": [0, 1]},
             "engine_args": {"tensor_parallel_size": 2}},
     "stages.llm.instances.kind: KIND_GPU gives each instance exactly one GPU, but "
     "tensor_parallel_size=2 needs 2 per engine; use KIND_MODEL and let vLLM place its workers "
     "(choose GPUs with CUDA_VISIBLE_DEVICES in env)"),
    ("llm", {"instances": {"count": 2}, "engine_args": {"tensor_parallel_size": 2}},
     "stages.llm.instances.count: 2 instances of an engine with tensor_parallel_size=2 would need "
     "4 devices placed by hand; use count 1 (vLLM batches requests itself)"),
])
def test_batching_and_parallelism_errors_name_the_key(tmp_path, models, monkeypatch, stage,
                                                       extra, expected):
    from omni_tools import spec as spec_mod

    monkeypatch.setattr(spec_mod, "vllm_engine_arg_names",
                        lambda: frozenset({"tensor_parallel_size", "max_model_len"}))
    data = omni_spec(models)
    data["stages"][stage].update(extra)
    assert problems(tmp_path, data) == [expected]


@pytest.mark.parametrize("stage, extra, expected", [
    ("dec", {"instances": {"kind": "KIND_GPU", "gpus": [1]}},
     "stages.dec.engine_args.device: KIND_GPU runs each omni_audio instance on its GPU: set "
     "device: cuda (or use KIND_CPU)"),
    ("aenc", {"instances": {"kind": "KIND_GPU"}, "engine_args": {"modality": "audio",
                                                                  "device": "cpu"}},
     "stages.aenc.engine_args.device: KIND_GPU runs each omni_encoder instance on its GPU: set "
     "device: cuda (or use KIND_CPU)"),
    ("llm", {"instances": {"kind": "KIND_GPU", "gpus": [0]}, "env": {"CUDA_VISIBLE_DEVICES": "2"}},
     "stages.llm.env.CUDA_VISIBLE_DEVICES: KIND_GPU instances each get the GPU Triton gives them "
     "(choose them with instances.gpus); remove it, or use KIND_MODEL to pick the GPUs yourself"),
    ("omni", {"instances": {"kind": "KIND_GPU"}},
     "stages.omni.instances.kind: the orchestrator computes nothing on a GPU; use KIND_CPU or "
     "KIND_MODEL"),
])
def test_kind_gpu_placement_errors_say_what_each_backend_allows(tmp_path, models, stage, extra,
                                                                expected):
    data = omni_spec(models)
    for key, value in extra.items():
        if key == "engine_args":
            data["stages"][stage].setdefault("engine_args", {}).update(value)
        else:
            data["stages"][stage][key] = value
    assert problems(tmp_path, data) == [expected]


def test_kind_gpu_with_device_cuda_is_accepted(tmp_path, models):
    data = omni_spec(models)
    data["stages"]["dec"].update(instances={"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]},
                                 engine_args={"device": "cuda"})
    data["stages"]["llm"]["instances"] = {"kind": "KIND_GPU", "gpus": [2]}
    spec = parse_spec(data, base_dir=tmp_path)
    assert spec.stages["dec"].instances.gpus == [0, 1]


def test_tensor_parallel_with_kind_model_is_accepted(tmp_path, models, monkeypatch):
    from omni_tools import spec as spec_mod

    monkeypatch.setattr(spec_mod, "vllm_engine_arg_names",
                        lambda: frozenset({"tensor_parallel_size"}))
    data = omni_spec(models)
    data["stages"]["llm"].update(instances={"kind": "KIND_MODEL"},
                                 engine_args={"tensor_parallel_size": 2})
    assert parse_spec(data, base_dir=tmp_path).stages["llm"].engine_args["tensor_parallel_size"] == 2


def test_the_cli_prints_the_json_schema(capsys):
    assert gen_repo.main(["--print-schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    stage = schema["$defs"]["StageSpec"]
    assert stage["additionalProperties"] is False
    assert {"backend", "model", "engine_args", "instances", "queue", "env"} <= set(stage["properties"])


# --- servers ----------------------------------------------------------------------

def split(models: dict[str, str], engine_url: str | None = "10.0.0.2:8001") -> dict:
    data = omni_spec(models)
    data["servers"] = {"front": {}, "engine": {"grpc_url": engine_url} if engine_url else {}}
    data["stages"]["llm"]["server"] = "engine"
    for name in ("talker", "aenc", "dec", "omni"):
        data["stages"][name]["server"] = "front"
    return data


def test_a_spec_over_two_servers_writes_one_repository_each(tmp_path, models):
    gen_repo.generate(parse_spec(split(models), base_dir=tmp_path), tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["engine", "front"]
    assert sorted(p.name for p in (tmp_path / "out" / "engine").iterdir()
                  if p.is_dir()) == ["llm"]
    engine = json.loads((tmp_path / "out" / "front" / "omni" / ENGINE_ARGS_FILE).read_text())
    assert engine["remote"] == {"llm": {"server": "engine", "url": "10.0.0.2:8001"}}


def test_a_remote_stage_needs_its_server_url(tmp_path, models):
    assert problems(tmp_path, split(models, engine_url=None)) == [
        "servers.engine.grpc_url: required: stage 'llm' (thinker) on server 'engine' is called "
        "by 'omni' on server 'front'"]


def test_a_stage_must_name_a_known_server(tmp_path, models):
    data = split(models)
    data["stages"]["dec"]["server"] = "elsewhere"
    assert problems(tmp_path, data) == [
        "stages.dec.server: no server named 'elsewhere'; servers: front, engine"]


def test_the_remote_url_can_be_overridden_at_run_time(monkeypatch):
    from omni_serve.orchestrator.config import OrchestratorConfig

    cfg = OrchestratorConfig.model_validate({
        "stages": {"thinker": "llm"}, "remote": {"llm": {"server": "engine-a", "url": "h:1"}}})
    assert cfg.remote_url("llm") == "h:1"
    monkeypatch.setenv("OMNI_SERVER_ENGINE_A_URL", "other:2")
    assert cfg.remote_url("llm") == "other:2"
    assert cfg.remote_url("talker") is None


# --- the checkpoint's voices -------------------------------------------------------------

def _engine(tmp_path, models) -> dict:
    generated = tmp_path / "repo"
    gen_repo.generate(parse_spec(omni_spec(models), base_dir=tmp_path), generated)
    return json.loads((generated / "omni" / ENGINE_ARGS_FILE).read_text())


def _spk_dict(folder: Path, *names: str) -> None:
    import torch

    torch.save({name: {"cond": torch.zeros(1, 4), "bos_token": i} for i, name in enumerate(names)},
               folder / "spk_dict.pt")


def test_the_orchestrator_knows_the_voices_of_the_spk_dict(tmp_path, models):
    _spk_dict(Path(models["t2w"]), "Chelsie", "Ethan")
    assert _engine(tmp_path, models)["voices"] == ["Chelsie", "Ethan"]


def test_voices_come_from_the_audio_stage_index_or_else_the_talker(tmp_path, models):
    (Path(models["t2w"]) / "speakers.json").write_text(json.dumps({"speakers": ["Ethan"],
                                                                   "default": "Ethan"}))
    _spk_dict(Path(models["talker"]), "Chelsie", "Ethan")
    # the decoder's own list first (the default voice map's Chelsie is not there)
    data = omni_spec(models)
    data["stages"]["omni"]["engine_args"]["voice_map"] = {"alloy": "Ethan"}
    generated = tmp_path / "repo"
    gen_repo.generate(parse_spec(data, base_dir=tmp_path), generated)
    engine = json.loads((generated / "omni" / ENGINE_ARGS_FILE).read_text())
    assert engine["voices"] == ["Ethan"] and engine["voice_map"] == {"alloy": "Ethan"}
    (Path(models["t2w"]) / "speakers.json").unlink()
    assert _engine(tmp_path, models)["voices"] == ["Chelsie", "Ethan"]


def test_without_a_voice_file_the_voices_stay_unknown(tmp_path, models):
    assert "voices" not in _engine(tmp_path, models)


def test_a_voice_map_onto_voices_the_checkpoint_lacks_is_a_spec_error(tmp_path, models):
    _spk_dict(Path(models["t2w"]), "Aria")
    with pytest.raises(SpecError) as err:
        _engine(tmp_path, models)
    assert err.value.problems[0].startswith(
        "stages.omni.engine_args: voice_map: 'alloy' -> 'Chelsie', which is not a voice of "
        "the checkpoint (Aria)")


def test_an_unreadable_spk_dict_names_the_file(tmp_path, models):
    (Path(models["t2w"]) / "spk_dict.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SpecError) as err:
        _engine(tmp_path, models)
    assert err.value.problems[0].startswith("stages.omni.engine_args.voices: ")
    assert "spk_dict.pt: cannot be read" in err.value.problems[0]

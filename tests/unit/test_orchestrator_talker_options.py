"""The omni entry model's talker options and voices: parsing, ranges, defaults, the voice
map, and codec ids in responses (no Triton: parse_request and the adapter's tensors)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from omni_serve.contract import OMNI, OMNI_CONTRACT
from omni_serve.errors import RequestError
from omni_serve.families.qwen2_5_omni import OPENAI_VOICE_MAP
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.pipeline import AudioChunk, CodecIds, Final, TextDelta
from omni_serve.orchestrator.request import parse_request

MODEL_PY = Path(__file__).resolve().parents[2] / "backends" / "omni_orchestrator" / "model.py"


def config(**overrides) -> OrchestratorConfig:
    base = {"stages": {"thinker": "llm", "talker": "talker", "audio_decoder": "dec"},
            "tokenizer": "/tok"}
    base.update(overrides)
    return OrchestratorConfig.model_validate(base)


def tensors(text: str = "hello", **extra) -> dict:
    out = {OMNI.TEXT_INPUT: np.array([text.encode()], dtype=np.object_)}
    for name, value in extra.items():
        if name == OMNI.MODALITIES:
            out[name] = np.array([m.encode() for m in value], dtype=np.object_)
        elif isinstance(value, bool):
            out[name] = np.array([value], dtype=np.bool_)
        elif isinstance(value, dict):
            out[name] = np.array([json.dumps(value).encode()], dtype=np.object_)
        else:
            out[name] = np.array([value], dtype=np.object_)
    return out


def parse(cfg: OrchestratorConfig | None = None, **extra):
    return parse_request("r", tensors(**extra), cfg or config())


def rejected(cfg: OrchestratorConfig | None = None, **extra) -> RequestError:
    with pytest.raises(RequestError) as err:
        parse(cfg, **extra)
    return err.value


# --- the contract ------------------------------------------------------------------

def test_the_contract_declares_the_new_inputs_and_output():
    assert OMNI_CONTRACT.input(OMNI.TALKER_SAMPLING_PARAMETERS).data_type == "TYPE_STRING"
    assert OMNI_CONTRACT.input(OMNI.STREAM_AUDIO).data_type == "TYPE_BOOL"
    assert OMNI_CONTRACT.input(OMNI.RETURN_CODEC_IDS).data_type == "TYPE_BOOL"
    for name in (OMNI.TALKER_SAMPLING_PARAMETERS, OMNI.STREAM_AUDIO, OMNI.RETURN_CODEC_IDS):
        assert OMNI_CONTRACT.input(name).optional
    codec_ids = OMNI_CONTRACT.output(OMNI.CODEC_IDS)
    assert (codec_ids.name, codec_ids.data_type, codec_ids.dims) == ("codec_ids", "TYPE_INT64",
                                                                      (-1, -1))


# --- defaults ----------------------------------------------------------------------

def test_without_the_new_inputs_audio_streams_with_the_checkpoint_sampling():
    req = parse(modalities=["audio"])
    assert req.talker_sampling == {}
    assert req.stream_audio is True
    assert req.return_codec_ids is False
    # what the pipeline merges a request's fields over: Qwen2.5-Omni's talker defaults
    assert config().talker_sampling == {"temperature": 0.9, "top_k": 40, "top_p": 0.8,
                                        "repetition_penalty": 1.05}


def test_the_flags_are_read():
    req = parse(modalities=["audio"], stream_audio=False, return_codec_ids=True)
    assert req.stream_audio is False and req.return_codec_ids is True


# --- talker_sampling_parameters ----------------------------------------------------

def test_talker_sampling_keeps_the_keys_sent_as_numbers():
    req = parse(modalities=["audio"], talker_sampling_parameters={
        "temperature": 0, "top_k": 5, "top_p": 1, "repetition_penalty": 1.1, "max_tokens": 300,
        "min_tokens": 20})
    assert req.talker_sampling == {"temperature": 0.0, "top_k": 5, "top_p": 1.0,
                                   "repetition_penalty": 1.1, "max_tokens": 300, "min_tokens": 20}
    assert isinstance(req.talker_sampling["temperature"], float)
    assert isinstance(req.talker_sampling["top_k"], int)


def test_temperature_zero_is_greedy_and_top_k_zero_or_minus_one_is_off():
    assert parse(talker_sampling_parameters={"temperature": 0}).talker_sampling == {
        "temperature": 0.0}
    assert parse(talker_sampling_parameters={"top_k": 0}).talker_sampling == {"top_k": 0}
    assert parse(talker_sampling_parameters={"top_k": -1}).talker_sampling == {"top_k": -1}


def test_an_empty_talker_sampling_object_or_string_is_no_override():
    assert parse(talker_sampling_parameters={}).talker_sampling == {}
    assert parse(talker_sampling_parameters=b"").talker_sampling == {}


@pytest.mark.parametrize("fields,field,message", [
    ({"temperature": -0.1}, "temperature", "must be a number in [0, 2] (0: greedy), got -0.1"),
    ({"temperature": 2.5}, "temperature", "must be a number in [0, 2]"),
    ({"temperature": "hot"}, "temperature", 'must be a number in [0, 2] (0: greedy), got "hot"'),
    ({"temperature": True}, "temperature", "must be a number in [0, 2]"),
    ({"temperature": None}, "temperature", "got null"),
    ({"top_k": -2}, "top_k", "must be an integer: 0 or -1 (no top-k), or at least 1, got -2"),
    ({"top_k": 2.5}, "top_k", "must be an integer"),
    ({"top_p": 0}, "top_p", "must be a number in (0, 1], got 0"),
    ({"top_p": 1.01}, "top_p", "must be a number in (0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "must be a number in (0, 2], got 0"),
    ({"repetition_penalty": 2.5}, "repetition_penalty", "must be a number in (0, 2]"),
    ({"max_tokens": 0}, "max_tokens", "must be an integer in [1, 32768], got 0"),
    ({"max_tokens": 40000}, "max_tokens", "must be an integer in [1, 32768]"),
    ({"max_tokens": 10.5}, "max_tokens", "must be an integer in [1, 32768]"),
    ({"min_tokens": -1}, "min_tokens", "must be an integer in [0, 32768], got -1"),
])
def test_talker_sampling_values_out_of_range_name_the_key_and_the_range(fields, field, message):
    err = rejected(modalities=["audio"], talker_sampling_parameters=fields)
    assert err.field == f"talker_sampling_parameters.{field}"
    assert message in err.message


def test_unknown_talker_sampling_keys_name_the_allowed_ones():
    err = rejected(talker_sampling_parameters={"temperature": 1, "stop": ["x"]})
    assert err.field == "talker_sampling_parameters.stop"
    assert err.message == ("unknown key; allowed: temperature, top_k, top_p, "
                           "repetition_penalty, max_tokens, min_tokens")


def test_a_talker_seed_points_to_the_seed_input():
    err = rejected(talker_sampling_parameters={"seed": 3})
    assert err.field == "talker_sampling_parameters.seed"
    assert "send the request's seed input" in err.message


@pytest.mark.parametrize("raw,message", [
    (b"{nope", "invalid JSON"),
    (b"[1, 2]", "must be a JSON object with keys among temperature, top_k"),
    (b"0.5", "must be a JSON object"),
])
def test_talker_sampling_must_be_a_json_object(raw, message):
    err = rejected(talker_sampling_parameters=raw)
    assert err.field == "talker_sampling_parameters" and message in err.message


# --- flags -------------------------------------------------------------------------

@pytest.mark.parametrize("name", [OMNI.STREAM_AUDIO, OMNI.RETURN_CODEC_IDS])
def test_the_flags_must_be_booleans(name):
    err = rejected(modalities=["audio"], **{name: np.int32(1)})
    assert err.field == name and "must be a boolean" in err.message


def test_codec_ids_without_speech_are_refused_naming_modalities():
    err = rejected(return_codec_ids=True)
    assert err.field == "modalities"
    assert "return_codec_ids needs speech output: add 'audio' to modalities" in err.message
    # task speech always makes audio
    assert parse(task="speech", return_codec_ids=True).return_codec_ids is True


def test_talker_options_without_speech_are_checked_then_unused():
    req = parse(stream_audio=False, talker_sampling_parameters={"temperature": 0.5})
    assert req.modalities == ("text",) and not req.wants_audio
    assert req.stream_audio is False and req.talker_sampling == {"temperature": 0.5}
    assert rejected(talker_sampling_parameters={"top_p": 3}).field == (
        "talker_sampling_parameters.top_p")


# --- voices ------------------------------------------------------------------------

QWEN = config(voices=["Chelsie", "Ethan"])


@pytest.mark.parametrize("voice,expected", [
    ("alloy", "Chelsie"), ("ALLOY", "Chelsie"), ("Nova", "Chelsie"), ("shimmer", "Chelsie"),
    ("echo", "Ethan"), ("Onyx", "Ethan"), ("verse", "Ethan"),
    ("Chelsie", "Chelsie"), ("Ethan", "Ethan"),
])
def test_openai_voices_map_onto_the_checkpoint_voices_in_any_case(voice, expected):
    assert parse(QWEN, voice=voice.encode()).voice == expected


def test_every_openai_voice_has_a_default_alias():
    openai_voices = {"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
                     "shimmer", "verse"}
    assert set(OPENAI_VOICE_MAP) == openai_voices
    assert set(OPENAI_VOICE_MAP.values()) == {"Chelsie", "Ethan"}


def test_voice_names_match_exactly():
    err = rejected(QWEN, voice=b"chelsie")
    assert err.field == "voice"
    assert err.message.startswith("unknown voice 'chelsie'; voices: Chelsie, Ethan; voice "
                                  "aliases (case-insensitive): alloy -> Chelsie, ")
    assert "echo -> Ethan" in err.message


def test_no_voice_or_an_empty_one_is_the_default_voice():
    assert parse(QWEN).voice is None
    assert parse(QWEN, voice=b"").voice is None


def test_with_the_voices_unknown_names_pass_through_and_aliases_still_map():
    cfg = config()  # voices not known
    assert cfg.voices is None
    assert parse(cfg, voice=b"Someone").voice == "Someone"
    assert parse(cfg, voice=b"Coral").voice == "Chelsie"


def test_a_configured_voice_map_replaces_the_default():
    cfg = config(voices=["Aria", "Bo"], voice_map={"Alloy": "Aria", "narrator": "Bo"})
    assert parse(cfg, voice=b"alloy").voice == "Aria"
    assert parse(cfg, voice=b"NARRATOR").voice == "Bo"
    err = rejected(cfg, voice=b"echo")
    assert err.message == ("unknown voice 'echo'; voices: Aria, Bo; voice aliases "
                           "(case-insensitive): Alloy -> Aria, narrator -> Bo")
    assert parse(config(voices=["Aria"], voice_map={}), voice=b"Aria").voice == "Aria"


@pytest.mark.parametrize("overrides,message", [
    ({"voices": ["Aria"]}, "voice_map: 'alloy' -> 'Chelsie', which is not a voice of the "
                             "checkpoint (Aria)"),
    ({"voices": []}, "give the checkpoint's voice names"),
    ({"voices": ["Aria", "Aria"]}, "each name may appear once"),
    ({"voices": [" Aria"]}, "no surrounding spaces"),
    ({"voice_map": {"Alloy": "Chelsie", "alloy": "Ethan"}}, "are the same alias"),
    ({"voice_map": {"": "Chelsie"}}, "names must not be empty"),
])
def test_bad_voice_config_is_refused_at_load(overrides, message):
    with pytest.raises(ValueError, match="voice_map|voices") as err:
        config(**overrides)
    assert message in str(err.value)


def test_the_old_name_of_voices_is_an_error_naming_the_new_one():
    with pytest.raises(ValueError, match="speakers: renamed to voices"):
        config(speakers=["Chelsie", "Ethan"])


# --- codec ids in responses --------------------------------------------------------

@pytest.fixture(scope="module")
def adapter():
    spec = importlib.util.spec_from_file_location("omni_orchestrator_model_codec", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_codec_ids_go_out_as_the_codec_ids_output(adapter):
    out, final = adapter.response_tensors([CodecIds([[3, 30], [1, 10], [4, 40]])])
    assert not final and set(out) == {OMNI.CODEC_IDS}
    assert out[OMNI.CODEC_IDS].dtype == np.int64
    assert out[OMNI.CODEC_IDS].tolist() == [[3, 30], [1, 10], [4, 40]]  # [frames, groups]


def test_codec_ids_that_piled_up_are_concatenated_in_order_with_the_rest(adapter):
    events = [TextDelta("a"), CodecIds([[5], [9]]), AudioChunk(np.ones(4, np.float32), 24000),
              CodecIds([[2]]), Final("stop", {})]
    out, final = adapter.response_tensors(events)
    assert final
    assert out[OMNI.CODEC_IDS].tolist() == [[5], [9], [2]]
    assert out[OMNI.TEXT_OUTPUT].tolist() == [b"a"] and out[OMNI.AUDIO_CHUNK].size == 4


def test_responses_without_codec_ids_have_no_codec_ids_output(adapter):
    out, _ = adapter.response_tensors([TextDelta("a"), CodecIds([])])
    assert OMNI.CODEC_IDS not in out
